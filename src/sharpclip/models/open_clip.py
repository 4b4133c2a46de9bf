"""open_clip checkpoints → transformers CLIPModel, without open_clip: the folder the hub holds for an open_clip model.

    <folder>/open_clip_config.json                     {"model_cfg": {...}, "preprocess_cfg": {...}}
    <folder>/open_clip_model.safetensors               (or open_clip_pytorch_model.bin, read with weights_only=True)

A standard open_clip CLIP (ViT image tower + text transformer) stores the OpenAI key layout, so the OpenAI-format
converter maps its tensors (models.openai_format); what the tensors cannot say comes from the config:
- the activation: `model_cfg.quick_gelu` true → QuickGELU (OpenAI-trained weights), else exact GELU (LAION,
  DataComp, ...). Loading with the wrong one silently degrades every score;
- the heads: vision `width / head_width` (head_width 64 by default; 80 for ViT-H/14, 104 for ViT-bigG/14, where
  OpenAI's width / 64 is wrong), text `text_cfg.heads` (default 8);
- image size and context length (checked against the tensors), mean/std, interpolation and resize mode
  (`shortest` = CLIP's resize + centre crop, `squash` = whole image to a square) for the image processor.
Towers the converter cannot express are refused with the config field named: timm or ResNet image towers,
HF or "modern" text towers, CoCa's multimodal decoder, SigLIP's logit bias, attentional or non-token pooling, layer
scale, and open_clip's custom attention-block options (`qk_norm`, `scaled_cosine_attn`, `scale_heads`,
`scale_attn_inner`, `scale_attn`, `scale_fc`). Whatever the config says, every tensor of the state dict must land in
the CLIPModel: a tensor left over is refused naming the option that makes it (e.g. `attn.ln_q` → `qk_norm`).
The tokenizer comes from `model.processor`, else from tokenizer files in the folder (hub folders often carry them).

`open_clip_train` checkpoints (`epoch_N.pt`: {"state_dict", "epoch", "name", "optimizer"}) carry no config. The
architecture is then given by `model.open_clip_config`: a name of the configs shipped in `open_clip_configs/`
(open_clip's own model_configs values for the common ViTs, e.g. ViT-B-32, ViT-H-14-quickgelu) or a path to a model
JSON (a bare model config, or an `open_clip_config.json`).
"""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

from torch import Tensor
from transformers import CLIPImageProcessor, CLIPModel

from sharpclip.models.openai_format import UnusedTensors, clip_from_openai, read_state_dict

CONFIG = "open_clip_config.json"
WEIGHTS = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")
RESAMPLE = {"bicubic": 3, "bilinear": 2}  # PIL filter codes
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)

# (section, field, value that is fine): anything else is a tower the converter cannot express
_REFUSED = (
    ("vision_cfg", "timm_model_name", None),
    ("vision_cfg", "attentional_pool", False),
    ("vision_cfg", "global_average_pool", False),
    ("vision_cfg", "final_ln_after_pool", False),
    ("vision_cfg", "no_ln_pre", False),
    ("vision_cfg", "ls_init_value", None),
    ("vision_cfg", "input_patchnorm", False),
    ("vision_cfg", "act_kwargs", None),
    ("vision_cfg", "norm_kwargs", None),
    ("text_cfg", "hf_model_name", None),
    ("text_cfg", "proj_bias", False),
    ("text_cfg", "embed_cls", False),
    ("text_cfg", "no_causal_mask", False),
    ("text_cfg", "ls_init_value", None),
    ("text_cfg", "final_ln_after_pool", False),
    ("text_cfg", "act_kwargs", None),
    ("text_cfg", "norm_kwargs", None),
    ("text_cfg", "text_arch", "clip"),
    ("text_cfg", "proj_type", "linear"),
    *((section, option, False) for section in ("vision_cfg", "text_cfg") for option in (
        "qk_norm", "scaled_cosine_attn", "scale_heads", "scale_attn_inner", "scale_attn", "scale_fc",
    )),  # open_clip's custom attention block: extra norms and scales a CLIPModel layer does not have
)  # fmt: skip
# an unused tensor's key → the open_clip option that creates it (open_clip transformer.py's parameter names)
_TENSOR_OPTIONS = (
    (re.compile(r"\.attn\.ln_[qk]\."), "qk_norm"),
    (re.compile(r"\.attn\.logit_scale$"), "scaled_cosine_attn"),
    (re.compile(r"\.attn\.head_scale$"), "scale_heads"),
    (re.compile(r"\.attn\.ln_inner\."), "scale_attn_inner"),
    (re.compile(r"\.ln_attn\."), "scale_attn"),
    (re.compile(r"\.mlp\.ln\."), "scale_fc"),
    (re.compile(r"\.ls_[12]\."), "ls_init_value"),
)
BUNDLED = "open_clip_configs"  # package folder of open_clip model configs, one <name>.json each


class UnsupportedOpenClipModel(ValueError):
    """The open_clip config describes a tower the HF CLIPModel cannot compute; the message names the field."""


def is_open_clip_folder(path: Path) -> bool:
    """True when `path` is a folder holding an open_clip config."""
    return (path / CONFIG).is_file()


def read_config_file(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model_cfg, preprocess_cfg) of an open_clip JSON: `open_clip_config.json` or a bare model config."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: line {err.lineno} column {err.colno}: not valid JSON ({err.msg})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model_cfg", raw).get("vision_cfg"), dict):
        raise ValueError(f"{path}: not an open_clip model config (no vision_cfg)")
    return raw.get("model_cfg", raw), raw.get("preprocess_cfg", {})


def read_config(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model_cfg, preprocess_cfg) of an open_clip folder (a bare model config is accepted as model_cfg)."""
    return read_config_file(folder / CONFIG)


def bundled_configs() -> list[str]:
    """Names of the open_clip model configs shipped with sharpclip (`model.open_clip_config=<name>`)."""
    folder = resources.files("sharpclip.models") / BUNDLED
    return sorted(f.name.removesuffix(".json") for f in folder.iterdir() if f.name.endswith(".json"))


def find_config(ref: str) -> Path:
    """The JSON file `model.open_clip_config` names: a shipped config's name, else a path."""
    bundled = resources.files("sharpclip.models") / BUNDLED / f"{ref}.json"
    if bundled.is_file():
        return Path(str(bundled))
    path = Path(ref).expanduser()
    if path.is_dir() and (path / CONFIG).is_file():
        return path / CONFIG
    if path.is_file():
        return path
    raise FileNotFoundError(
        f"model.open_clip_config={ref!r}: neither a shipped config ({', '.join(bundled_configs())}) nor a JSON file; "
        "for another architecture give the path of its open_clip model config JSON"
    )


def _refuse(field: str, why: str, source: str = CONFIG) -> UnsupportedOpenClipModel:
    return UnsupportedOpenClipModel(
        f"{source}: model_cfg.{field}: {why}; sharpclip converts standard ViT + text-transformer CLIPs only. "
        "Use a transformers checkpoint of this model if one exists (model.name=<HF folder>)"
    )


def check_convertible(model_cfg: dict[str, Any], source: str = CONFIG) -> None:
    """Raise `UnsupportedOpenClipModel` naming the first config field the converter cannot honour."""
    if model_cfg.get("multimodal_cfg"):
        raise _refuse("multimodal_cfg", "a CoCa model (image-conditioned text decoder)", source)
    if model_cfg.get("init_logit_bias") is not None:
        raise _refuse("init_logit_bias", "a sigmoid-loss (SigLIP-style) model with a logit bias", source)
    vision, text = model_cfg.get("vision_cfg", {}), model_cfg.get("text_cfg", {})
    if isinstance(vision.get("layers"), list | tuple):
        raise _refuse("vision_cfg.layers", "a ResNet (ModifiedResNet) image tower", source)
    for section, name, fine in _REFUSED:
        value = (vision if section == "vision_cfg" else text).get(name, fine)
        if value is not None and value != fine and value != {}:
            raise _refuse(f"{section}.{name}", f"{value!r} is not supported (only {fine!r})", source)
    if vision.get("pool_type", "tok") != "tok":
        raise _refuse("vision_cfg.pool_type", f"{vision['pool_type']!r} pooling (CLIPModel pools the class token)",
                      source)  # fmt: skip
    if text.get("pool_type", "argmax") not in ("argmax", "eos"):
        raise _refuse("text_cfg.pool_type", f"{text['pool_type']!r} pooling (CLIPModel pools the eos token)", source)
    if vision.get("pos_embed_type", "learnable") != "learnable":
        raise _refuse("vision_cfg.pos_embed_type", f"{vision['pos_embed_type']!r} position embeddings", source)


def option_of(key: str) -> str:
    """The open_clip config field whose option creates the tensor `key` (e.g. `vision_cfg.qk_norm`); '' if unknown."""
    if key == "logit_bias":
        return "init_logit_bias"
    section = "vision_cfg" if key.startswith("visual.") else "text_cfg"
    return next((f"{section}.{name}" for pattern, name in _TENSOR_OPTIONS if pattern.search(key)), "")


def refuse_unused(err: UnusedTensors, source: str) -> UnsupportedOpenClipModel:
    """The one-line refusal of tensors the conversion left over, naming the config option that made them."""
    options = sorted({option_of(k) for k in err.keys} - {""})
    shown = ", ".join(err.keys[:4]) + (f", ... ({len(err.keys)} in all)" if len(err.keys) > 4 else "")
    if not options:
        return UnsupportedOpenClipModel(f"{source}: {err}")
    why = f"{len(err.keys)} tensors ({shown}) belong to {' / '.join(options)}, which CLIPModel has no layer for"
    return _refuse(options[0], why, source)


def _standard_keys(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A CustomTextCLIP's `text.*` keys (its own text transformer) in the plain CLIP layout."""
    if "token_embedding.weight" in state or "text.token_embedding.weight" not in state:
        return state
    out = {k: v for k, v in state.items() if not k.startswith("text.")}
    out |= {k.removeprefix("text."): v for k, v in state.items() if k.startswith("text.")}
    if "text_projection.weight" in out:  # a bias-free Linear projection: y = x Wᵀ, the parameter form is Wᵀ
        out["text_projection"] = out.pop("text_projection.weight").T
    return out


def _heads(model_cfg: dict[str, Any]) -> tuple[int, int]:
    vision, text = model_cfg.get("vision_cfg", {}), model_cfg.get("text_cfg", {})
    width = int(vision.get("width", 768))
    head_width = int(vision.get("head_width", 64))
    if width % head_width:
        raise _refuse("vision_cfg.head_width", f"width {width} is not a multiple of head_width {head_width}")
    return int(text.get("heads", 8)), width // head_width


def _square(value: Any, field: str) -> int:
    if isinstance(value, list | tuple):
        if len(set(value)) != 1:
            raise _refuse(field, f"a non-square size {value}")
        value = value[0]
    return int(value)


def check_shapes(model: CLIPModel, model_cfg: dict[str, Any], source: str = CONFIG) -> None:
    """The tensors must agree with the config's widths, depths, patch and image size and context length (else the
    wrong config or the wrong file)."""
    vision, text = model_cfg.get("vision_cfg", {}), model_cfg.get("text_cfg", {})
    v, t = model.config.vision_config, model.config.text_config
    have = {
        "vision_cfg.width": v.hidden_size,
        "vision_cfg.layers": v.num_hidden_layers,
        "vision_cfg.patch_size": v.patch_size,
        "vision_cfg.image_size": v.image_size,
        "text_cfg.width": t.hidden_size,
        "text_cfg.layers": t.num_hidden_layers,
        "text_cfg.context_length": t.max_position_embeddings,
        "text_cfg.vocab_size": t.vocab_size,
        "embed_dim": model.config.projection_dim,
    }
    want = {key: (vision if key.startswith("vision") else text).get(key.split(".")[-1]) for key in have}
    want["embed_dim"] = model_cfg.get("embed_dim")
    if "image_size" in vision:
        want["vision_cfg.image_size"] = _square(vision["image_size"], "vision_cfg.image_size")
    if "patch_size" in vision:
        want["vision_cfg.patch_size"] = _square(vision["patch_size"], "vision_cfg.patch_size")
    for key, value in want.items():
        if value is not None and int(value) != have[key]:
            raise ValueError(
                f"{source}: model_cfg.{key} is {value} but the weights have {have[key]}: the config does not "
                "describe these weights (wrong model.open_clip_config or wrong file?)"
            )


def image_processor(preprocess_cfg: dict[str, Any], model_cfg: dict[str, Any], size: int) -> CLIPImageProcessor:
    """The HF image processor of an open_clip model's preprocessing (mean/std, interpolation, resize mode)."""
    vision = model_cfg.get("vision_cfg", {})
    mean = preprocess_cfg.get("mean") or vision.get("image_mean") or OPENAI_MEAN
    std = preprocess_cfg.get("std") or vision.get("image_std") or OPENAI_STD
    interpolation = preprocess_cfg.get("interpolation", vision.get("image_interpolation", "bicubic"))
    if interpolation not in RESAMPLE:
        raise _refuse("preprocess_cfg.interpolation", f"{interpolation!r} (bicubic or bilinear)")
    mode = preprocess_cfg.get("resize_mode", vision.get("image_resize_mode", "shortest"))
    if mode not in ("shortest", "squash"):
        raise _refuse("preprocess_cfg.resize_mode", f"{mode!r} (shortest = resize + centre crop, or squash)")
    crop = mode == "shortest"
    return CLIPImageProcessor(
        do_resize=True,
        size={"shortest_edge": size} if crop else {"height": size, "width": size},
        resample=RESAMPLE[interpolation],
        do_center_crop=crop,
        crop_size={"height": size, "width": size},
        image_mean=list(mean),
        image_std=list(std),
    )


def weights_file(folder: Path) -> Path:
    """The folder's open_clip weights (safetensors preferred)."""
    for name in WEIGHTS:
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"{folder}: no {' or '.join(WEIGHTS)} beside {CONFIG}")


def convert(
    model_cfg: dict[str, Any], preprocess_cfg: dict[str, Any], state: dict[str, Tensor], source: str, weights: str
) -> tuple[CLIPModel, CLIPImageProcessor, str]:
    """(HF CLIPModel, its image processor, the activation used) for an open_clip state dict and its config;
    `source` (the config) and `weights` (the tensors' file) name what errors are about."""
    check_convertible(model_cfg, source)
    activation = "quick_gelu" if model_cfg.get("quick_gelu", False) else "gelu"
    text_heads, vision_heads = _heads(model_cfg)
    try:
        model = clip_from_openai(_standard_keys(state), text_heads, vision_heads, activation, source=weights)
    except UnusedTensors as err:
        raise refuse_unused(err, source) from None
    check_shapes(model, model_cfg, source)
    processor = image_processor(preprocess_cfg, model_cfg, model.config.vision_config.image_size)
    return model, processor, activation


def clip_from_open_clip(folder: str | Path) -> tuple[CLIPModel, CLIPImageProcessor, str]:
    """(HF CLIPModel, its image processor, the activation used) for an open_clip folder."""
    folder = Path(folder)
    model_cfg, preprocess_cfg = read_config(folder)
    weights = weights_file(folder)
    return convert(model_cfg, preprocess_cfg, read_state_dict(weights), str(folder / CONFIG), str(weights))


def clip_from_open_clip_file(
    path: Path, state: dict[str, Tensor], config_ref: str
) -> tuple[CLIPModel, CLIPImageProcessor, str]:
    """The same for a bare checkpoint file's tensors (`state`, e.g. open_clip_train's epoch_N.pt) with the config
    `model.open_clip_config` names (`config_ref`)."""
    config = find_config(config_ref)
    model_cfg, preprocess_cfg = read_config_file(config)
    return convert(model_cfg, preprocess_cfg, state, str(config), str(path))


def run_name_architecture(name: str) -> str:
    """The `--model` an open_clip_train run name records (`<date>-model_ViT-B-32-lr_...`), or ''."""
    found = re.search(r"model_(.+?)-lr_", name or "")
    return found.group(1) if found else ""
