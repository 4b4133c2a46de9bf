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
HF text towers, CoCa's multimodal decoder, SigLIP's logit bias, attentional or non-token pooling, layer scale.
The tokenizer comes from `model.processor`, else from tokenizer files in the folder (hub folders often carry them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import Tensor
from transformers import CLIPImageProcessor, CLIPModel

from sharpclip.models.openai_format import clip_from_openai, read_state_dict

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
)


class UnsupportedOpenClipModel(ValueError):
    """The open_clip config describes a tower the HF CLIPModel cannot compute; the message names the field."""


def is_open_clip_folder(path: Path) -> bool:
    """True when `path` is a folder holding an open_clip config."""
    return (path / CONFIG).is_file()


def read_config(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model_cfg, preprocess_cfg) of an open_clip folder (a bare model config is accepted as model_cfg)."""
    path = folder / CONFIG
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: line {err.lineno} column {err.colno}: not valid JSON ({err.msg})") from None
    model_cfg = raw.get("model_cfg", raw)
    return model_cfg, raw.get("preprocess_cfg", {})


def _refuse(field: str, why: str) -> UnsupportedOpenClipModel:
    return UnsupportedOpenClipModel(
        f"{CONFIG}: model_cfg.{field}: {why}; sharpclip converts standard ViT + text-transformer CLIPs only. "
        "Use a transformers checkpoint of this model if one exists (model.name=<HF folder>)"
    )


def check_convertible(model_cfg: dict[str, Any]) -> None:
    """Raise `UnsupportedOpenClipModel` naming the first config field the converter cannot honour."""
    if model_cfg.get("multimodal_cfg"):
        raise _refuse("multimodal_cfg", "a CoCa model (image-conditioned text decoder)")
    if model_cfg.get("init_logit_bias") is not None:
        raise _refuse("init_logit_bias", "a sigmoid-loss (SigLIP-style) model with a logit bias")
    vision, text = model_cfg.get("vision_cfg", {}), model_cfg.get("text_cfg", {})
    if isinstance(vision.get("layers"), list | tuple):
        raise _refuse("vision_cfg.layers", "a ResNet (ModifiedResNet) image tower")
    for section, name, fine in _REFUSED:
        value = (vision if section == "vision_cfg" else text).get(name, fine)
        if value is not None and value != fine and value != {}:
            raise _refuse(f"{section}.{name}", f"{value!r} is not supported (only {fine!r})")
    if vision.get("pool_type", "tok") != "tok":
        raise _refuse("vision_cfg.pool_type", f"{vision['pool_type']!r} pooling (CLIPModel pools the class token)")
    if text.get("pool_type", "argmax") not in ("argmax", "eos"):
        raise _refuse("text_cfg.pool_type", f"{text['pool_type']!r} pooling (CLIPModel pools the eos token)")
    if vision.get("pos_embed_type", "learnable") != "learnable":
        raise _refuse("vision_cfg.pos_embed_type", f"{vision['pos_embed_type']!r} position embeddings")


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


def check_shapes(model: CLIPModel, model_cfg: dict[str, Any]) -> None:
    """The tensors must agree with the config's widths, image size and context length (else the wrong file)."""
    vision, text = model_cfg.get("vision_cfg", {}), model_cfg.get("text_cfg", {})
    have = {
        "vision_cfg.width": model.config.vision_config.hidden_size,
        "vision_cfg.image_size": model.config.vision_config.image_size,
        "text_cfg.width": model.config.text_config.hidden_size,
        "text_cfg.context_length": model.config.text_config.max_position_embeddings,
        "embed_dim": model.config.projection_dim,
    }
    want = {
        "vision_cfg.width": vision.get("width"),
        "vision_cfg.image_size": _square(vision["image_size"], "vision_cfg.image_size")
        if "image_size" in vision
        else None,
        "text_cfg.width": text.get("width"),
        "text_cfg.context_length": text.get("context_length"),
        "embed_dim": model_cfg.get("embed_dim"),
    }
    for key, value in want.items():
        if value is not None and int(value) != have[key]:
            raise ValueError(f"{CONFIG}: model_cfg.{key} is {value} but the weights have {have[key]}: wrong weights?")


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


def clip_from_open_clip(folder: str | Path) -> tuple[CLIPModel, CLIPImageProcessor, str]:
    """(HF CLIPModel, its image processor, the activation used) for an open_clip folder."""
    folder = Path(folder)
    model_cfg, preprocess_cfg = read_config(folder)
    check_convertible(model_cfg)
    activation = "quick_gelu" if model_cfg.get("quick_gelu", False) else "gelu"
    text_heads, vision_heads = _heads(model_cfg)
    state = _standard_keys(read_state_dict(weights_file(folder)))
    model = clip_from_openai(state, text_heads, vision_heads, activation)
    check_shapes(model, model_cfg)
    processor = image_processor(preprocess_cfg, model_cfg, model.config.vision_config.image_size)
    return model, processor, activation
