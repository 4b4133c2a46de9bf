"""The `DualEncoder` protocol every backbone adapter implements, and the `Embeddings` it returns.

A dual encoder maps images and captions into one space (CLIP, Radford et al. 2021, eq. in §2.3):

    img = normalize(W_i · f_image(x))   (B, D)        txt = normalize(W_t · f_text(y))   (B, D)

and, on request, per-token embeddings for the token-level term (FILIP; HN-CLIP §2.3): image patches through the
vision tower's final norm and projection (CLS excluded), text tokens through the text projection, each L2-normalised
and paired with a mask (True = real token). Losses read a flat dict of features; `Embeddings.features(prefix)`
builds its part of that dict, so the trainer's mapping is one line per modality:

    feats = {**model.encode_image(px, tokens=True).features("image"),
             **model.encode_text(ids, mask, tokens=True).features("text")}
    # keys: image, image_tokens, image_token_mask, text, text_tokens, text_token_mask
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn


@dataclass
class Embeddings:
    """What `encode_image` / `encode_text` return.

    embedding:  (B, D) L2-normalised global embedding.
    tokens:     (B, N, D) L2-normalised token embeddings, or None when not requested.
    token_mask: (B, N) bool, True where `tokens` holds a real token (not padding), or None with `tokens`.
    """

    embedding: Tensor
    tokens: Tensor | None = None
    token_mask: Tensor | None = None

    def features(self, prefix: str) -> dict[str, Tensor]:
        """The loss-facing keys for this modality: `{prefix}`, `{prefix}_tokens`, `{prefix}_token_mask`."""
        out = {prefix: self.embedding}
        if self.tokens is not None:
            out[f"{prefix}_tokens"] = self.tokens
            out[f"{prefix}_token_mask"] = self.token_mask
        return out


class DualEncoder(nn.Module, ABC):
    """An image tower and a text tower with a shared embedding space, a log-space logit scale and optional bias.

    Subclasses wrap one backbone (`self.backbone`, e.g. a `transformers.CLIPModel`) and carry the tokenizer and
    image processor that belong to it, so that checkpoints and exports are self-contained.
    """

    backbone: nn.Module
    tokenizer: Any
    image_processor: Any

    @abstractmethod
    def encode_image(self, pixel_values: Tensor, tokens: bool = False) -> Embeddings:
        """pixel_values: (B, 3, H, W) as the image processor makes them."""

    @abstractmethod
    def encode_text(self, input_ids: Tensor, attention_mask: Tensor | None = None, tokens: bool = False) -> Embeddings:
        """input_ids: (B, L) token ids with the end-of-text token; attention_mask: (B, L), 1 = real token."""

    @property
    @abstractmethod
    def logit_scale(self) -> nn.Parameter:
        """log s: the similarity scale in log space (CLIP initialises it to log(1/0.07))."""

    @property
    def logit_bias(self) -> nn.Parameter | None:
        """b of the sigmoid loss (SigLIP); None for softmax-trained models."""
        return None

    @property
    @abstractmethod
    def text_model(self) -> nn.Module:
        """The text tower (a transformers `*TextModel`): embeddings, encoder.layers, final_layer_norm."""

    @property
    @abstractmethod
    def vision_model(self) -> nn.Module:
        """The vision tower (a transformers `*VisionModel`): embeddings, encoder.layers, post_layernorm."""

    @property
    def pads_to_context(self) -> bool:
        """True when captions must be padded to the full context (the tower reads its padding, as SigLIP's does);
        False lets batches be padded to their longest caption (causal towers that pool eos: CLIP, RoPE)."""
        return False

    @property
    def context_length(self) -> int:
        """The longest caption (in tokens) the text tower accepts."""
        return int(self.text_model.config.max_position_embeddings)

    def forward(
        self, pixel_values: Tensor, input_ids: Tensor, attention_mask: Tensor | None = None, tokens: bool = False
    ) -> dict[str, Tensor]:
        """Both towers at once, as the loss-facing feature dict (see the module docstring)."""
        return {
            **self.encode_image(pixel_values, tokens=tokens).features("image"),
            **self.encode_text(input_ids, attention_mask, tokens=tokens).features("text"),
        }


def normalize(x: Tensor) -> Tensor:
    """L2-normalise the last dimension (eps-safe)."""
    return nn.functional.normalize(x, dim=-1)


def first_eos_mask(input_ids: Tensor, eos_token_id: int) -> Tensor:
    """(B, L) bool: True up to and including the first end-of-text token (pad = eos in CLIP tokenizers)."""
    is_eos = input_ids == eos_token_id
    first = torch.where(is_eos.any(-1), is_eos.int().argmax(-1), input_ids.shape[-1] - 1)
    return torch.arange(input_ids.shape[-1], device=input_ids.device)[None] <= first[:, None]
