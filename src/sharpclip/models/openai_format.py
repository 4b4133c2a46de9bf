"""Load OpenAI-format CLIP state dicts (OpenAI CLIP `state_dict()`, Long-CLIP's `longclip-L.pt`) into an HF CLIPModel.

The architecture is read from the tensor shapes, as OpenAI's `build_model` does (heads = width / 64 unless given),
and every tensor is mapped key by key (docs/method-notes.md §8; OpenAI → HF):

    token_embedding.weight            → text_model.embeddings.token_embedding.weight
    positional_embedding (L, D)       → text_model.embeddings.position_embedding.weight
    transformer.resblocks.i.attn.in_proj_{weight,bias}  → …layers.i.self_attn.{q,k,v}_proj (chunk(3) along rows)
    ….attn.out_proj / ln_1 / ln_2 / mlp.c_fc / mlp.c_proj → …self_attn.out_proj / layer_norm1 / layer_norm2 / fc1 / fc2
    ln_final                          → text_model.final_layer_norm
    text_projection (D, P)            → text_projection.weight = text_projectionᵀ
    visual.conv1 / class_embedding / positional_embedding / ln_pre / ln_post
                                      → vision_model.embeddings.{patch_embedding, class_embedding,
                                        position_embedding} / pre_layrnorm (sic) / post_layernorm
    visual.proj (W, P)                → visual_projection.weight = projᵀ
    logit_scale                       → logit_scale

Long-CLIP (docs/method-notes.md §4) stores two 248-row tables, `positional_embedding` (used for rows < 20, frozen) and
`positional_embedding_res` (rows ≥ 20); the effective table is their masked sum, and the kept count (20) is recorded
so fine-tuning keeps those rows frozen (models.long_context). Files are read with `torch.load(weights_only=True)`
(no pickle code runs) or from safetensors.

A checkpoint converts completely or not at all: every tensor of the state dict must land in the CLIPModel (only
OpenAI's integer bookkeeping entries `input_resolution`, `context_length`, `vocab_size` are dropped, as OpenAI's
`build_model` drops them). A tensor left over means a layer CLIPModel does not have; dropping it would load a
different function without a word, so `UnusedTensors` names them instead.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor
from transformers import CLIPConfig, CLIPModel

from sharpclip.models.long_context import KEEP_KEY, restore_kept_positions

LONGCLIP_KEEP = 20
IGNORED = frozenset({"input_resolution", "context_length", "vocab_size"})  # OpenAI's ints, not weights


class UnusedTensors(ValueError):
    """Tensors of a state dict that no CLIPModel parameter takes (`keys`); the message lists a few."""

    def __init__(self, keys: list[str], source: str = "") -> None:
        self.keys = keys
        shown = ", ".join(keys[:6]) + (f", ... ({len(keys)} in all)" if len(keys) > 6 else "")
        super().__init__(
            f"{source or 'state dict'}: {len(keys)} tensors have no place in a transformers CLIPModel ({shown}); "
            "the checkpoint has layers this converter cannot express, so it is refused rather than loaded without them"
        )


class _Reads(dict):
    """A state dict that remembers which keys were read, so the converter can prove it used every tensor."""

    def __init__(self, state: dict[str, Tensor]) -> None:
        super().__init__(state)
        self.used: set[str] = set()

    def __getitem__(self, key: str) -> Tensor:
        if key not in self:
            raise ValueError(f"missing tensor {key!r}: not a complete OpenAI-format ViT CLIP state dict")
        self.used.add(key)
        return super().__getitem__(key)


TRAINING_KEYS = ("epoch", "name", "optimizer")  # what open_clip_train saves beside "state_dict" in epoch_N.pt


def read_checkpoint(path: str | Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """(tensors, metadata) of a `.safetensors` file or a `torch.save`d state dict (never unpickles code).

    A training checkpoint's wrapper, e.g. open_clip_train's `epoch_N.pt` = {"state_dict": {"module.…": …},
    "epoch", "name", "optimizer", ...}, is unwrapped (and a DDP `module.` prefix dropped); metadata then holds
    its `epoch` and `name` (the run name), else it is empty.
    """
    path = Path(path)
    if path.suffix == ".safetensors":
        try:
            return load_file(str(path)), {}
        except Exception as err:  # safetensors' own error type: bad header, truncated file
            raise ValueError(f"{path}: corrupt or truncated safetensors file ({err})") from None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # TorchScript archives (OpenAI's original .pt) and pickled modules land here
        raise ValueError(
            f"{path}: not a plain state dict loadable with torch.load(weights_only=True) ({type(err).__name__}). "
            "OpenAI's original TorchScript .pt files are not supported: use the HF folder "
            "(e.g. openai/clip-vit-large-patch14) instead, or re-save the state dict as safetensors"
        ) from None
    wrapped = isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict)
    state = obj["state_dict"] if wrapped else obj
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ValueError(f"{path}: expected a dict of tensors (an OpenAI-format CLIP state dict)")
    meta = {k: obj[k] for k in ("epoch", "name") if k in obj} if wrapped else {}
    if wrapped and any(k in obj for k in TRAINING_KEYS):
        meta["training_checkpoint"] = True
    return {k.removeprefix("module."): v for k, v in state.items()}, meta


def read_state_dict(path: str | Path) -> dict[str, Tensor]:
    """The tensors of `read_checkpoint(path)`."""
    return read_checkpoint(path)[0]


def _count_blocks(state: dict[str, Tensor], prefix: str) -> int:
    pattern = re.compile(re.escape(prefix) + r"transformer\.resblocks\.(\d+)\.")
    return 1 + max(int(m.group(1)) for k in state if (m := pattern.match(k)))


def config_from_state_dict(
    state: dict[str, Tensor],
    text_heads: int | None = None,
    vision_heads: int | None = None,
    activation: str = "quick_gelu",
) -> CLIPConfig:
    """The HF config of an OpenAI-format ViT CLIP state dict (eps 1e-5, eos = the largest id); `activation` is the
    MLP's: OpenAI's QuickGELU by default, `gelu` (exact) for open_clip models trained without QuickGELU."""
    if "visual.proj" not in state:
        raise ValueError("only ViT CLIP state dicts are supported (no 'visual.proj': a ResNet CLIP?)")
    width, vwidth = state["ln_final.weight"].shape[0], state["visual.conv1.weight"].shape[0]
    vocab, patch = state["token_embedding.weight"].shape[0], state["visual.conv1.weight"].shape[-1]
    grid = round((state["visual.positional_embedding"].shape[0] - 1) ** 0.5)
    text = dict(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=state["transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
        num_hidden_layers=_count_blocks(state, ""),
        num_attention_heads=text_heads or width // 64,
        max_position_embeddings=state["positional_embedding"].shape[0],
        bos_token_id=vocab - 2,
        eos_token_id=vocab - 1,
        pad_token_id=vocab - 1,
        hidden_act=activation,
    )
    vision = dict(
        hidden_size=vwidth,
        intermediate_size=state["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
        num_hidden_layers=_count_blocks(state, "visual."),
        num_attention_heads=vision_heads or vwidth // 64,
        image_size=grid * patch,
        patch_size=patch,
        hidden_act=activation,
    )
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=state["text_projection"].shape[1])


def _block(src: str, dst: str, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """One residual block: OpenAI names under `src` → HF names under `dst`."""
    q, k, v = state[f"{src}attn.in_proj_weight"].chunk(3)
    qb, kb, vb = state[f"{src}attn.in_proj_bias"].chunk(3)
    out = {
        f"{dst}self_attn.q_proj.weight": q,
        f"{dst}self_attn.k_proj.weight": k,
        f"{dst}self_attn.v_proj.weight": v,
        f"{dst}self_attn.q_proj.bias": qb,
        f"{dst}self_attn.k_proj.bias": kb,
        f"{dst}self_attn.v_proj.bias": vb,
    }
    renames = {"attn.out_proj": "self_attn.out_proj", "ln_1": "layer_norm1", "ln_2": "layer_norm2"}
    renames |= {"mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}
    for old, new in renames.items():
        for p in ("weight", "bias"):
            out[f"{dst}{new}.{p}"] = state[f"{src}{old}.{p}"]
    return out


def _text_positions(state: dict[str, Tensor]) -> Tensor:
    """The effective text position table; Long-CLIP's split tables are merged (rows < 20 from the frozen one)."""
    pos = state["positional_embedding"]
    if "positional_embedding_res" not in state:
        return pos
    return torch.cat([pos[:LONGCLIP_KEEP], state["positional_embedding_res"][LONGCLIP_KEEP:]])


def hf_state_dict(state: dict[str, Tensor], config: CLIPConfig) -> dict[str, Tensor]:
    """Map every OpenAI key to its HF CLIPModel key (see the module docstring)."""
    out = {
        "text_model.embeddings.token_embedding.weight": state["token_embedding.weight"],
        "text_model.embeddings.position_embedding.weight": _text_positions(state),
        "text_model.final_layer_norm.weight": state["ln_final.weight"],
        "text_model.final_layer_norm.bias": state["ln_final.bias"],
        "text_projection.weight": state["text_projection"].T,
        "vision_model.embeddings.patch_embedding.weight": state["visual.conv1.weight"],
        "vision_model.embeddings.class_embedding": state["visual.class_embedding"],
        "vision_model.embeddings.position_embedding.weight": state["visual.positional_embedding"],
        "vision_model.pre_layrnorm.weight": state["visual.ln_pre.weight"],
        "vision_model.pre_layrnorm.bias": state["visual.ln_pre.bias"],
        "vision_model.post_layernorm.weight": state["visual.ln_post.weight"],
        "vision_model.post_layernorm.bias": state["visual.ln_post.bias"],
        "visual_projection.weight": state["visual.proj"].T,
        "logit_scale": state["logit_scale"].reshape(()),
    }
    for i in range(config.text_config.num_hidden_layers):
        out |= _block(f"transformer.resblocks.{i}.", f"text_model.encoder.layers.{i}.", state)
    for i in range(config.vision_config.num_hidden_layers):
        out |= _block(f"visual.transformer.resblocks.{i}.", f"vision_model.encoder.layers.{i}.", state)
    return {k: v.contiguous() for k, v in out.items()}


def clip_from_openai(
    state: dict[str, Tensor],
    text_heads: int | None = None,
    vision_heads: int | None = None,
    activation: str = "quick_gelu",
    source: str = "",
) -> CLIPModel:
    """An HF CLIPModel computing the same function as the OpenAI-format `state` (Long-CLIP's 248 positions kept).

    Raises `UnusedTensors` when a tensor of `state` has no place in the model; `source` names the file in errors.
    """
    try:
        config = config_from_state_dict(state, text_heads, vision_heads, activation)
    except KeyError as err:
        raise ValueError(f"{source or 'state dict'}: missing tensor {err}: not an OpenAI-format ViT CLIP") from None
    model = CLIPModel(config)
    reads = _Reads(state)
    mapped = hf_state_dict(reads, config)
    unused = sorted(set(state) - reads.used - IGNORED)
    if unused:
        raise UnusedTensors(unused, source)
    missing, unexpected = model.load_state_dict(mapped, strict=False)
    if missing or unexpected:
        raise ValueError(f"OpenAI → HF conversion left keys unmapped: missing {missing}, unexpected {unexpected}")
    if "positional_embedding_res" in state:
        for cfg in (model.config.text_config, model.text_model.config):
            setattr(cfg, KEEP_KEY, LONGCLIP_KEEP)
        restore_kept_positions(model.text_model)
    return model.eval()
