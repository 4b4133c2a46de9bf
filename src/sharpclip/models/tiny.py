"""Tiny CLIP / SigLIP / SigLIP 2 models built in code, for tests and the CPU demo (no download, seconds to build).

They use the real transformers classes and file formats at toy sizes: 2 layers of width 32, 32×32 images in 8×8
patches, and an offline word tokenizer (models.tokenizer). The text context matches the real towers (77 for CLIP,
64 for SigLIP) so the Long-CLIP stretch (77 → 248, 64 → 196) runs on them unchanged.

The pitfall they avoid (methods.md §8): HF CLIP pools at the first `eos_token_id`, 49407 by default; a toy vocabulary
never contains it and pooling would silently take position 0. The configs set bos/eos/pad to the tokenizer's ids.
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

IMAGE_SIZE = 32
PATCH_SIZE = 8
WIDTH = 32


def _tower(tokenizer: CLIPTokenizer, context_length: int, **extra: object) -> dict:
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=WIDTH,
        intermediate_size=2 * WIDTH,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=context_length,
        pad_token_id=tokenizer.pad_token_id,
        **ids,
        **extra,
    )


def _vision(**extra: object) -> dict:
    return dict(
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        hidden_size=WIDTH,
        intermediate_size=2 * WIDTH,
        num_hidden_layers=2,
        num_attention_heads=4,
        **extra,
    )


def tiny_clip_config(tokenizer: CLIPTokenizer, context_length: int = 77) -> CLIPConfig:
    """CLIP at toy size; `eos_token_id` is the tokenizer's (so pooling finds the end-of-text token)."""
    return CLIPConfig(text_config=_tower(tokenizer, context_length), vision_config=_vision(), projection_dim=WIDTH)


def tiny_siglip_config(tokenizer: CLIPTokenizer, context_length: int = 64) -> SiglipConfig:
    return SiglipConfig(text_config=_tower(tokenizer, context_length, projection_size=WIDTH), vision_config=_vision())


def tiny_siglip2_config(tokenizer: CLIPTokenizer, context_length: int = 64) -> Siglip2Config:
    vision = _vision(num_patches=(IMAGE_SIZE // PATCH_SIZE) ** 2)
    del vision["image_size"]
    return Siglip2Config(text_config=_tower(tokenizer, context_length, projection_size=WIDTH), vision_config=vision)


def tiny_model(kind: str = "clip", words: Iterable[str] = TINY_WORDS, seed: int = 0) -> HFDualEncoder:
    """A randomly initialised tiny dual encoder with its tokenizer and image processor.

    kind: clip | siglip | siglip2. words: the tokenizer's vocabulary (e.g. SynthDense's). Same seed, same weights.
    """
    builders = {
        "clip": (tiny_clip_config, CLIPModel, 77),
        "siglip": (tiny_siglip_config, SiglipModel, 64),
        "siglip2": (tiny_siglip2_config, Siglip2Model, 64),
    }
    if kind not in builders:
        raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {', '.join(builders)}")
    make_config, model_cls, context = builders[kind]
    tokenizer = build_word_tokenizer(words, model_max_length=context)
    torch.manual_seed(seed)
    backbone = model_cls(make_config(tokenizer, context)).eval()
    if kind != "clip":  # SigLIP's initialisation (Zhai et al. 2023, §3): t' = log 10, b = -10
        with torch.no_grad():
            backbone.logit_scale.fill_(math.log(10.0))
            backbone.logit_bias.fill_(-10.0)
    return wrap(backbone, tokenizer, tiny_image_processor(kind))


def tiny_image_processor(kind: str) -> object:
    """The image processor that goes with a tiny model (saved by checkpoints and exports)."""
    if kind == "clip":
        return CLIPImageProcessorPil(
            size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
        )
    if kind == "siglip":
        return SiglipImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return Siglip2ImageProcessorPil(patch_size=PATCH_SIZE, max_num_patches=(IMAGE_SIZE // PATCH_SIZE) ** 2)
