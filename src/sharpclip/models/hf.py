"""Adapters from transformers' `CLIPModel`, `SiglipModel` (SigLIP and SigLIP 2 FixRes) and `Siglip2Model` (NaFlex)
to the `DualEncoder` protocol.

Global embeddings are exactly what transformers computes (`get_image_features` / `get_text_features`), normalised.
Token embeddings (docs/method-notes.md §3): CLIP's vision `last_hidden_state` is not post-layernormed, so patches
(CLS dropped) go through `post_layernorm` and `visual_projection`; the text `last_hidden_state` is already
`final_layer_norm`ed and goes through `text_projection`. SigLIP has no CLS and no visual projection: patch tokens are
the post-layernormed patches (the pooled embedding comes from the attention-pooling head), text tokens go through
the text `head` that projects the pooled token.

SigLIP was trained on captions padded to the full length with padding attended to, and pools the last position; its
adapter therefore does not pass `attention_mask` to the tower (the mask only marks real tokens for the token term).

CLIP's text tower (OpenAI CLIP, Long-CLIP, the RoPE tower of models.rope) is causal and pools its end-of-text token.
With captions padded on the right, no real token can attend to a padding token, so the tower runs without the
padding mask: its embeddings and real-token states are exactly the masked run's, attention gets `attn_mask=None,
is_causal=True` (flash-eligible on a GPU), and transformers does not read the mask on the host mid-forward. A
tokenizer that pads on the left keeps the mask. The mask still marks the real tokens for the token term (FILIP).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers import CLIPModel, PreTrainedModel, Siglip2Model, SiglipModel

from sharpclip.models.base import DualEncoder, Embeddings, first_eos_mask, normalize


class HFDualEncoder(DualEncoder):
    """Shared plumbing: holds the transformers model as `backbone` plus its tokenizer and image processor."""

    def __init__(self, backbone: PreTrainedModel, tokenizer: Any = None, image_processor: Any = None) -> None:
        super().__init__()
        self.backbone = backbone
        self.tokenizer = tokenizer
        self.image_processor = image_processor

    @property
    def hf_model(self) -> PreTrainedModel:
        """The transformers model under any peft wrapper (what `save_pretrained` writes)."""
        inner = self.backbone
        return inner.get_base_model() if hasattr(inner, "get_base_model") else inner

    @property
    def text_model(self) -> nn.Module:
        """The transformers text tower."""
        return self.hf_model.text_model

    @property
    def vision_model(self) -> nn.Module:
        """The transformers vision tower."""
        return self.hf_model.vision_model

    @property
    def logit_scale(self) -> nn.Parameter:
        """The backbone's log-scale parameter (the loss uses its exp)."""
        return self.hf_model.logit_scale


class CLIPDualEncoder(HFDualEncoder):
    """`transformers.CLIPModel` (OpenAI CLIP, Long-CLIP after conversion, any HF CLIP fine-tune)."""

    def end_of_text_id(self) -> int:
        """The tokenizer's end-of-text id; without a tokenizer, the config's, unless that is the legacy 2 of the
        OpenAI conversions (openai/clip-vit-large-patch14's config.json), where eot is the last vocabulary id."""
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is not None:
            return int(eos)
        config = self.text_model.config
        return config.vocab_size - 1 if config.eos_token_id == 2 else config.eos_token_id

    def encode_image(self, pixel_values: Tensor, tokens: bool = False) -> Embeddings:
        """Projected pooled embedding; with `tokens`, projected post-layernormed patches (CLS dropped)."""
        out = self.vision_model(pixel_values=pixel_values)
        proj = self.hf_model.visual_projection
        emb = normalize(proj(out.pooler_output))
        if not tokens:
            return Embeddings(emb)
        patches = normalize(proj(self.vision_model.post_layernorm(out.last_hidden_state[:, 1:])))
        mask = torch.ones(patches.shape[:2], dtype=torch.bool, device=patches.device)
        return Embeddings(emb, patches, mask)

    @property
    def pads_left(self) -> bool:
        """True when the tokenizer pads captions on the left: then the causal tower needs the padding mask."""
        return getattr(self.tokenizer, "padding_side", "right") == "left"

    def encode_text(self, input_ids: Tensor, attention_mask: Tensor | None = None, tokens: bool = False) -> Embeddings:
        """Projected eos embedding; with `tokens`, projected token states and a real-token mask (else up to eos).
        The tower reads the mask only under left padding (see the module docstring)."""
        tower_mask = attention_mask if self.pads_left else None
        out = self.text_model(input_ids=input_ids, attention_mask=tower_mask)
        proj = self.hf_model.text_projection
        emb = normalize(proj(out.pooler_output))
        if not tokens:
            return Embeddings(emb)
        given = attention_mask is not None
        mask = attention_mask.bool() if given else first_eos_mask(input_ids, self.end_of_text_id())
        return Embeddings(emb, normalize(proj(out.last_hidden_state)), mask)


class SiglipDualEncoder(HFDualEncoder):
    """`transformers.SiglipModel`: SigLIP and the fixed-resolution SigLIP 2 checkpoints; has a learnable bias."""

    @property
    def logit_bias(self) -> nn.Parameter:
        """The backbone's learnable sigmoid-loss bias."""
        return self.hf_model.logit_bias

    @property
    def pads_to_context(self) -> bool:
        """SigLIP attends to padding and pools the last position: captions are always padded to the context."""
        return True

    def _vision(self, pixel_values: Tensor) -> tuple[Any, Tensor]:
        """The vision tower's output and the (B, N) patch mask."""
        out = self.vision_model(pixel_values=pixel_values)
        mask = torch.ones(out.last_hidden_state.shape[:2], dtype=torch.bool, device=pixel_values.device)
        return out, mask

    def encode_image(self, pixel_values: Tensor, tokens: bool = False) -> Embeddings:
        """Attention-pooled embedding; with `tokens`, the post-layernormed patches."""
        out, mask = self._vision(pixel_values)
        emb = normalize(out.pooler_output)
        if not tokens:
            return Embeddings(emb)
        return Embeddings(emb, normalize(out.last_hidden_state), mask)

    def encode_text(self, input_ids: Tensor, attention_mask: Tensor | None = None, tokens: bool = False) -> Embeddings:
        """Last-position embedding (no attention mask passed); with `tokens`, head-projected states."""
        out = self.text_model(input_ids=input_ids)  # no attention_mask: see the module docstring
        emb = normalize(out.pooler_output)
        if not tokens:
            return Embeddings(emb)
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        return Embeddings(emb, normalize(self.text_model.head(out.last_hidden_state)), mask)


class Siglip2DualEncoder(SiglipDualEncoder):
    """`transformers.Siglip2Model` (NaFlex): takes (B, 3, H, W) images and cuts them into the patch sequence
    the model expects (row-major patches of `patch_size² · 3` values, as Siglip2ImageProcessor does), every patch real.
    """

    def _vision(self, pixel_values: Tensor) -> tuple[Any, Tensor]:
        patches, shapes = patchify(pixel_values, self.vision_model.config.patch_size)
        mask = torch.ones(patches.shape[:2], dtype=torch.bool, device=patches.device)
        out = self.vision_model(pixel_values=patches, pixel_attention_mask=mask.long(), spatial_shapes=shapes)
        return out, mask


def patchify(pixel_values: Tensor, patch: int) -> tuple[Tensor, Tensor]:
    """(B, C, H, W) → patches (B, (H/p)(W/p), p·p·C) in (row, col, py, px, c) order and spatial shapes (B, 2)."""
    b, c, h, w = pixel_values.shape
    if h % patch or w % patch:
        raise ValueError(f"image size {h}x{w} is not a multiple of the patch size {patch}; resize or crop first")
    x = pixel_values.reshape(b, c, h // patch, patch, w // patch, patch).permute(0, 2, 4, 3, 5, 1)
    shapes = torch.tensor([[h // patch, w // patch]] * b, device=pixel_values.device)
    return x.reshape(b, (h // patch) * (w // patch), patch * patch * c), shapes


ADAPTERS: dict[type[PreTrainedModel], type[HFDualEncoder]] = {
    CLIPModel: CLIPDualEncoder,
    SiglipModel: SiglipDualEncoder,
    Siglip2Model: Siglip2DualEncoder,
}


def wrap(backbone: PreTrainedModel, tokenizer: Any = None, image_processor: Any = None) -> HFDualEncoder:
    """The adapter for a transformers model instance (exact class match, so subclasses must register)."""
    for cls, adapter in ADAPTERS.items():
        if type(backbone) is cls:
            return adapter(backbone, tokenizer, image_processor)
    known = ", ".join(c.__name__ for c in ADAPTERS)
    raise TypeError(f"no sharpclip adapter for {type(backbone).__name__}; supported: {known}")
