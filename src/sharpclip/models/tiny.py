"""Tiny CLIP / SigLIP / SigLIP 2 models built in code, for tests and the CPU demo (no download, seconds to build).

They use the real transformers classes and file formats at toy sizes: by default 2 layers of width 32, 32×32 images in
8×8 patches, and an offline word tokenizer (models.tokenizer). The text context matches the real towers (77 for CLIP,
64 for SigLIP) so the Long-CLIP stretch (77 → 248, 64 → 196) runs on them unchanged. `config.TinyConfig`
(`model.tiny.*`) changes every size, e.g. the demo's SynthDense model: width 64, 2 + 2 layers, 48 px, 152 positions
(dense captions run to 141 tokens).

The pitfall they avoid (docs/method-notes.md §8): HF CLIP pools at the first `eos_token_id`, 49407 by default; a toy
vocabulary never contains it and pooling would silently take position 0. The configs set bos/eos/pad to the
tokenizer's ids.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from transformers import (
    CLIPConfig,
    CLIPImageProcessorPil,
    CLIPModel,
    CLIPTokenizer,
    Siglip2Config,
    Siglip2ImageProcessorPil,
    Siglip2Model,
    SiglipConfig,
    SiglipImageProcessorPil,
    SiglipModel,
)

from sharpclip.config import TinyConfig
from sharpclip.models.hf import HFDualEncoder, wrap
from sharpclip.models.tokenizer import build_word_tokenizer

# A compositional scene vocabulary (SynthDense-style); any other word still encodes, letter by letter.
_WORD_TEXT = (
    "a an the of and with is are there in on at to its one two three four five small medium large big tiny "
    "red green blue yellow purple orange white black gray grey brown pink cyan "
    "square circle triangle star hexagon diamond cross ring squares circles triangles stars shapes shape object "
    "striped dotted solid plain checkered textured left right above below near next top bottom middle center corner "
    "of behind front image picture scene background objects it , ."
)
TINY_WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())

DEFAULT_SIZE = TinyConfig()
IMAGE_SIZE, PATCH_SIZE, WIDTH = DEFAULT_SIZE.image_size, DEFAULT_SIZE.patch_size, DEFAULT_SIZE.width


def _layers(size: TinyConfig) -> dict:
    return dict(
        hidden_size=size.width,
        intermediate_size=size.mlp_ratio * size.width,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
    )


def _tower(tokenizer: CLIPTokenizer, context_length: int, size: TinyConfig, **extra: object) -> dict:
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    return dict(
        vocab_size=len(tokenizer),
        max_position_embeddings=context_length,
        pad_token_id=tokenizer.pad_token_id,
        **_layers(size),
        **ids,
        **extra,
    )


def _vision(size: TinyConfig, **extra: object) -> dict:
    return dict(image_size=size.image_size, patch_size=size.patch_size, **_layers(size), **extra)


def tiny_clip_config(tokenizer: CLIPTokenizer, context_length: int = 77, size: TinyConfig = DEFAULT_SIZE) -> CLIPConfig:
    """CLIP at toy size; `eos_token_id` is the tokenizer's (so pooling finds the end-of-text token)."""
    text = _tower(tokenizer, context_length, size)
    return CLIPConfig(text_config=text, vision_config=_vision(size), projection_dim=size.width)


def tiny_siglip_config(
    tokenizer: CLIPTokenizer, context_length: int = 64, size: TinyConfig = DEFAULT_SIZE
) -> SiglipConfig:
    """SigLIP at toy size: the text tower projects itself (`projection_size`), as SiglipTextModel's head does."""
    text = _tower(tokenizer, context_length, size, projection_size=size.width)
    return SiglipConfig(text_config=text, vision_config=_vision(size))


def tiny_siglip2_config(
    tokenizer: CLIPTokenizer, context_length: int = 64, size: TinyConfig = DEFAULT_SIZE
) -> Siglip2Config:
    """SigLIP 2 (NaFlex) at toy size: a patch budget (`num_patches`, the square grid) instead of an image size."""
    vision = _vision(size, num_patches=(size.image_size // size.patch_size) ** 2)
    del vision["image_size"]
    text = _tower(tokenizer, context_length, size, projection_size=size.width)
    return Siglip2Config(text_config=text, vision_config=vision)


def tiny_model(
    kind: str = "clip", words: Iterable[str] = TINY_WORDS, seed: int = 0, size: TinyConfig = DEFAULT_SIZE
) -> HFDualEncoder:
    """A randomly initialised tiny dual encoder with its tokenizer and image processor.

    kind: clip | siglip | siglip2. words: the tokenizer's vocabulary (e.g. SynthDense's). size: widths, depths, image
    and context sizes (`size.context_length` 0: the kind's real context). Same seed and size, same weights.
    """
    builders = {
        "clip": (tiny_clip_config, CLIPModel, 77),
        "siglip": (tiny_siglip_config, SiglipModel, 64),
        "siglip2": (tiny_siglip2_config, Siglip2Model, 64),
    }
    if kind not in builders:
        raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {', '.join(builders)}")
    make_config, model_cls, context = builders[kind]
    context = size.context_length or context
    tokenizer = build_word_tokenizer(words, model_max_length=context)
    torch.manual_seed(seed)
    backbone = model_cls(make_config(tokenizer, context, size)).eval()
    if kind != "clip":  # SigLIP's initialisation (Zhai et al. 2023, §3): t' = log 10, b = -10
        with torch.no_grad():
            backbone.logit_scale.fill_(math.log(10.0))
            backbone.logit_bias.fill_(-10.0)
    return wrap(backbone, tokenizer, tiny_image_processor(kind, size))


def tiny_image_processor(kind: str, size: TinyConfig = DEFAULT_SIZE) -> object:
    """The image processor that goes with a tiny model (saved by checkpoints and exports)."""
    side, patch = size.image_size, size.patch_size
    if kind == "clip":
        return CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    if kind == "siglip":
        return SiglipImageProcessorPil(size={"height": side, "width": side})
    return Siglip2ImageProcessorPil(patch_size=patch, max_num_patches=(side // patch) ** 2)
