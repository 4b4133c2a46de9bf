"""OpenAI-format (and Long-CLIP) state dicts → HF CLIPModel, checked against an independent OpenAI-style forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor

from sharpclip.config import ModelConfig
from sharpclip.models import create_model
from sharpclip.models.long_context import KeptPositionEmbedding
from sharpclip.models.openai_format import read_state_dict

WIDTH, VWIDTH, EMBED, VOCAB, PATCH, GRID, LAYERS = 128, 128, 48, 100, 8, 4, 2  # heads = width / 64 = 2


def _block(sd: dict, prefix: str, width: int, gen: torch.Generator) -> None:
    def rnd(*shape: int, scale: float = 0.05) -> Tensor:
        return torch.randn(*shape, generator=gen) * scale

    sd |= {
        f"{prefix}attn.in_proj_weight": rnd(3 * width, width),
        f"{prefix}attn.in_proj_bias": rnd(3 * width),
        f"{prefix}attn.out_proj.weight": rnd(width, width),
        f"{prefix}attn.out_proj.bias": rnd(width),
        f"{prefix}ln_1.weight": 1 + rnd(width),
        f"{prefix}ln_1.bias": rnd(width),
        f"{prefix}ln_2.weight": 1 + rnd(width),
        f"{prefix}ln_2.bias": rnd(width),
        f"{prefix}mlp.c_fc.weight": rnd(4 * width, width),
        f"{prefix}mlp.c_fc.bias": rnd(4 * width),
        f"{prefix}mlp.c_proj.weight": rnd(width, 4 * width),
        f"{prefix}mlp.c_proj.bias": rnd(width),
    }


def openai_state_dict(context: int = 77, longclip: bool = False, seed: int = 0) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    sd = {
        "token_embedding.weight": torch.randn(VOCAB, WIDTH, generator=gen) * 0.1,
        "positional_embedding": torch.randn(context, WIDTH, generator=gen) * 0.1,
        "ln_final.weight": 1 + torch.randn(WIDTH, generator=gen) * 0.05,
        "ln_final.bias": torch.randn(WIDTH, generator=gen) * 0.05,
        "text_projection": torch.randn(WIDTH, EMBED, generator=gen) * 0.1,
        "logit_scale": torch.tensor(4.6052),
        "visual.conv1.weight": torch.randn(VWIDTH, 3, PATCH, PATCH, generator=gen) * 0.05,
        "visual.class_embedding": torch.randn(VWIDTH, generator=gen) * 0.1,
        "visual.positional_embedding": torch.randn(GRID * GRID + 1, VWIDTH, generator=gen) * 0.1,
        "visual.ln_pre.weight": 1 + torch.randn(VWIDTH, generator=gen) * 0.05,
        "visual.ln_pre.bias": torch.randn(VWIDTH, generator=gen) * 0.05,
        "visual.ln_post.weight": 1 + torch.randn(VWIDTH, generator=gen) * 0.05,
        "visual.ln_post.bias": torch.randn(VWIDTH, generator=gen) * 0.05,
        "visual.proj": torch.randn(VWIDTH, EMBED, generator=gen) * 0.1,
    }
    if longclip:
        sd["positional_embedding_res"] = torch.randn(context, WIDTH, generator=gen) * 0.1
    for i in range(LAYERS):
        _block(sd, f"transformer.resblocks.{i}.", WIDTH, gen)
        _block(sd, f"visual.transformer.resblocks.{i}.", VWIDTH, gen)
    return sd


# --- the OpenAI architecture, written from the paper's code layout (not from transformers) -------------------------


def _attention(x: Tensor, sd: dict, p: str, heads: int, causal: bool) -> Tensor:
    b, n, w = x.shape
    q, k, v = (x @ sd[f"{p}attn.in_proj_weight"].T + sd[f"{p}attn.in_proj_bias"]).split(w, dim=-1)
    q, k, v = (t.reshape(b, n, heads, w // heads).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / (w // heads) ** 0.5
    if causal:
        scores = scores + torch.full((n, n), float("-inf")).triu(1)
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, w)
    return out @ sd[f"{p}attn.out_proj.weight"].T + sd[f"{p}attn.out_proj.bias"]


def _layer_norm(x: Tensor, sd: dict, p: str) -> Tensor:
    return F.layer_norm(x, x.shape[-1:], sd[f"{p}.weight"], sd[f"{p}.bias"], eps=1e-5)


def _transformer(x: Tensor, sd: dict, prefix: str, causal: bool) -> Tensor:
    heads = x.shape[-1] // 64
    for i in range(LAYERS):
        p = f"{prefix}transformer.resblocks.{i}."
        x = x + _attention(_layer_norm(x, sd, f"{p}ln_1"), sd, p, heads, causal)
        h = _layer_norm(x, sd, f"{p}ln_2") @ sd[f"{p}mlp.c_fc.weight"].T + sd[f"{p}mlp.c_fc.bias"]
        h = h * torch.sigmoid(1.702 * h)  # QuickGELU
        x = x + h @ sd[f"{p}mlp.c_proj.weight"].T + sd[f"{p}mlp.c_proj.bias"]
    return x


def openai_encode_text(sd: dict, ids: Tensor) -> Tensor:
    pos = sd["positional_embedding"]
    if "positional_embedding_res" in sd:  # Long-CLIP: pos·mask1 + pos_res·mask2
        mask1 = torch.zeros(pos.shape[0], 1)
        mask1[:20] = 1
        pos = pos * mask1 + sd["positional_embedding_res"] * (1 - mask1)
    x = sd["token_embedding.weight"][ids] + pos[: ids.shape[1]]
    x = _layer_norm(_transformer(x, sd, "", causal=True), sd, "ln_final")
    return F.normalize(x[torch.arange(len(ids)), ids.argmax(-1)] @ sd["text_projection"], dim=-1)


def openai_encode_image(sd: dict, pixels: Tensor) -> tuple[Tensor, Tensor]:
    x = F.conv2d(pixels, sd["visual.conv1.weight"], stride=PATCH).flatten(2).transpose(1, 2)
    cls = sd["visual.class_embedding"].expand(len(x), 1, -1)
    x = torch.cat([cls, x], 1) + sd["visual.positional_embedding"]
    x = _transformer(_layer_norm(x, sd, "visual.ln_pre"), sd, "visual.", causal=False)
    x = _layer_norm(x, sd, "visual.ln_post") @ sd["visual.proj"]
    return F.normalize(x[:, 0], dim=-1), F.normalize(x[:, 1:], dim=-1)


def _ids(context: int) -> Tensor:
    """OpenAI tokenisation: [sot] tokens [eot] then zero padding; eot = the largest id."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.zeros(3, context, dtype=torch.long)
    for row, n in enumerate([5, 20, context - 2]):
        ids[row, 0] = VOCAB - 2
        ids[row, 1 : n + 1] = torch.randint(1, VOCAB - 2, (n,), generator=gen)
        ids[row, n + 1] = VOCAB - 1
    return ids


@pytest.mark.parametrize(("context", "longclip", "suffix"), [(77, False, ".pt"), (248, True, ".safetensors")])
def test_converted_model_computes_the_openai_function(tmp_path, context: int, longclip: bool, suffix: str) -> None:
    sd = openai_state_dict(context, longclip)
    path = tmp_path / f"model{suffix}"
    torch.save(sd, path) if suffix == ".pt" else save_file(sd, str(path))
    model = create_model(ModelConfig(name=str(path)))
    assert model.context_length == context and model.logit_scale.item() == pytest.approx(4.6052)
    ids, pixels = _ids(context), torch.randn(2, 3, GRID * PATCH, GRID * PATCH, generator=torch.Generator())
    with torch.no_grad():
        got_img = model.encode_image(pixels, tokens=True)
        got_txt = model.encode_text(ids).embedding
    want_img, want_patches = openai_encode_image(sd, pixels)
    torch.testing.assert_close(got_txt, openai_encode_text(sd, ids), atol=1e-5, rtol=0)
    torch.testing.assert_close(got_img.embedding, want_img, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_img.tokens, want_patches, atol=1e-5, rtol=0)
    kept = isinstance(model.text_model.embeddings.position_embedding, KeptPositionEmbedding)
    assert kept == longclip  # Long-CLIP's first 20 rows stay frozen in fine-tuning


def test_pickled_objects_are_refused_not_executed(tmp_path) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"model": torch.nn.Linear(2, 2)}, path)
    with pytest.raises(ValueError, match="weights_only"):
        read_state_dict(path)


@pytest.mark.parametrize("longclip", [False, True], ids=["openai", "longclip"])
def test_a_tensor_the_conversion_would_drop_is_refused_naming_it(tmp_path, longclip: bool) -> None:
    """OpenAI's own state dicts keep three integer entries (dropped, as OpenAI's build_model drops them); any other
    tensor without a place in CLIPModel (here an attention-pool head left from another architecture) is refused."""
    sd = openai_state_dict(248 if longclip else 77, longclip)
    sd |= {k: torch.tensor(v) for k, v in {"input_resolution": 32, "context_length": 77, "vocab_size": VOCAB}.items()}
    path = tmp_path / "model.pt"
    torch.save(sd, path)
    create_model(ModelConfig(name=str(path)))  # the integer entries alone are fine
    torch.save({**sd, "visual.attnpool.q_proj.weight": torch.zeros(4, 4)}, path)
    with pytest.raises(ValueError, match=r"model\.pt: 1 tensors have no place .*visual\.attnpool\.q_proj\.weight"):
        create_model(ModelConfig(name=str(path)))


def test_a_missing_block_tensor_is_one_line_naming_it(tmp_path) -> None:
    sd = openai_state_dict()
    del sd["visual.transformer.resblocks.1.ln_2.bias"]
    path = tmp_path / "model.safetensors"
    save_file(sd, str(path))
    with pytest.raises(ValueError, match=r"missing tensor 'visual\.transformer\.resblocks\.1\.ln_2\.bias'"):
        create_model(ModelConfig(name=str(path)))


def test_a_sharpclip_checkpoint_with_a_foreign_tensor_is_refused(tmp_path) -> None:
    from sharpclip.models import save_checkpoint
    from sharpclip.models.factory import WEIGHTS, read_weights

    directory = save_checkpoint(create_model(ModelConfig()), tmp_path / "ckpt", ModelConfig())
    save_file({**read_weights(directory), "backbone.extra.weight": torch.zeros(2)}, str(directory / WEIGHTS))
    with pytest.raises(ValueError, match=r"unexpected \['backbone\.extra\.weight'\]"):
        create_model(ModelConfig(name=str(directory)))
