"""Dense patch features of a dual encoder by Zhou et al.'s method (MaskCLIP, "Extract Free Dense Labels from CLIP",
ECCV 2022), the features CLIP-IN's Fig. 3 draws: each patch's embedding in the joint space, compared with a caption.

CLIP's image embedding is the CLS token after the last block's attention has pooled the patches into it; the patch
tokens themselves are not trained to live in the text space. MaskCLIP keeps the last block but drops its attention
mixing: every token goes through the **value path** alone (as if each attended only to itself), then the final
norm and the projection, which puts each patch where the pooled embedding lives.

HF CLIP (`CLIPModel`; the vision tower's `last_hidden_state` is *not* post-layernormed), with x the input of the
last encoder block (embeddings, `pre_layrnorm`, blocks 1 … L−1), CLS dropped at the end:

    maskclip (the released code):  v = x + out_proj(v_proj(layer_norm1(x)));  v = v + mlp(layer_norm2(v))
    value    (value path only):    v = out_proj(v_proj(layer_norm1(x)))
    patch_i = normalize(visual_projection(post_layernorm(v_i)))

SigLIP (`SiglipModel`, `Siglip2Model`) pools with a multihead attention pooling (MAP) head instead of a CLS token:
a learned probe attends over the post-layernormed tokens of the full tower, then `h + mlp(layernorm(h))`; there is
no projection (the head's output is the embedding). The encoder's last block is an ordinary self-attention block
(CLIP's earlier blocks are too): the pooling that MaskCLIP removes is the head's attention. So for SigLIP, with x_i
the tower's post-layernormed tokens (all patches: there is no CLS), the head runs with its attention weights forced
to one-hot on the token itself:

    maskclip:  h_i = out_proj(W_v x_i + b_v);  h_i = h_i + mlp(layernorm(h_i))        (W_v, b_v: the packed
    value:     h_i = out_proj(W_v x_i + b_v)                                          in-projection's third part)
    patch_i = normalize(h_i)

The score of patch i is its cosine with the L2-normalised caption embedding (no logit scale: the map is ranked, and
scale and bias do not change a ranking). Shapes: pixel_values (B, 3, S, S) → features (B, S/p, S/p, E), row-major.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from sharpclip.models.hf import CLIPDualEncoder, SiglipDualEncoder

DENSE_PATHS = ("maskclip", "value")


def _last_block_input(vision: Any, pixel_values: Tensor) -> Tensor:
    """(B, 1 + N, D): what the vision tower's last encoder block receives, caught by a forward pre-hook."""
    caught: dict[str, Tensor] = {}

    def hook(module: Any, args: tuple, kwargs: dict) -> None:
        caught["x"] = args[0] if args else kwargs["hidden_states"]

    handle = vision.encoder.layers[-1].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        vision(pixel_values=pixel_values)
    finally:
        handle.remove()
    return caught["x"]


def clip_value_path(layer: Any, x: Tensor, path: str = "maskclip") -> Tensor:
    """A CLIP encoder block without attention mixing. x: (B, T, D) the block's input → (B, T, D)."""
    v = layer.self_attn.out_proj(layer.self_attn.v_proj(layer.layer_norm1(x)))
    if path == "value":
        return v
    v = x + v
    return v + layer.mlp(layer.layer_norm2(v))


def map_head_value_path(head: Any, x: Tensor, path: str = "maskclip") -> Tensor:
    """A SigLIP MAP head with each token attending only to itself. x: (B, N, D) post-layernormed tokens → (B, N, D)."""
    attn = head.attention
    d = x.shape[-1]
    w_v = attn.in_proj_weight[2 * d :]
    b_v = attn.in_proj_bias[2 * d :] if attn.in_proj_bias is not None else None
    h = attn.out_proj(F.linear(x, w_v, b_v))
    if path == "value":
        return h
    return h + head.mlp(head.layernorm(h))


def _grid(tokens: Tensor, pixel_values: Tensor, patch: int) -> Tensor:
    """(B, N, E) row-major patch tokens → (B, H/p, W/p, E)."""
    h, w = pixel_values.shape[-2] // patch, pixel_values.shape[-1] // patch
    if tokens.shape[1] != h * w:
        raise ValueError(f"{tokens.shape[1]} patch tokens for a {h}×{w} grid; the tower does not take this image size")
    return tokens.reshape(tokens.shape[0], h, w, tokens.shape[-1])


def dense_features(model: Any, pixel_values: Tensor, path: str = "maskclip") -> Tensor:
    """(B, H/p, W/p, E) L2-normalised patch embeddings of `model` (a CLIP or SigLIP dual encoder) by `path`
    (maskclip | value, see the module docstring). pixel_values: (B, 3, S, S) as the model's preprocessing makes them,
    on the model's device."""
    if path not in DENSE_PATHS:
        raise ValueError(f"dense path {path!r} is unknown; choose from {', '.join(DENSE_PATHS)}")
    vision = model.vision_model
    patch = int(vision.config.patch_size)
    if isinstance(model, CLIPDualEncoder):
        v = clip_value_path(vision.encoder.layers[-1], _last_block_input(vision, pixel_values), path)
        tokens = model.hf_model.visual_projection(vision.post_layernorm(v[:, 1:]))  # CLS dropped
    elif isinstance(model, SiglipDualEncoder):
        if getattr(vision, "head", None) is None:
            raise ValueError("this SigLIP vision tower has no attention-pooling head (vision_use_head: false)")
        out, _ = model._vision(pixel_values)  # the adapter's own call (SigLIP 2 NaFlex patchifies first)
        tokens = map_head_value_path(vision.head, out.last_hidden_state, path)
    else:
        raise TypeError(f"dense features need a CLIP or SigLIP dual encoder, not {type(model).__name__}")
    return F.normalize(_grid(tokens, pixel_values, patch), dim=-1)


@torch.no_grad()
def patch_similarity(model: Any, pixel_values: Tensor, text: Tensor, path: str = "maskclip") -> Tensor:
    """(B, H/p, W/p) cosine of every patch with a caption. text: (E,) the L2-normalised caption embedding."""
    feats = dense_features(model, pixel_values, path)
    return torch.einsum("bhwe,e->bhw", feats.float(), text.to(feats.device).float())
