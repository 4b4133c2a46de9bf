"""A rotary-position (RoPE) text tower for long captions (CLIP-IN §3.3; TULIP, Najdenkoska et al. 2024).

Rotary embeddings (Su et al. 2021, RoFormer eq. 34) rotate each query and key pair of channels by an angle that
grows with the position, so the attention score depends on relative position only:

    angle(p, i) = p · θ^(−2i/d_h)          q'[2i], q'[2i+1] = rot(angle(p, i)) · (q[2i], q[2i+1])   (same for k)

Pairs are interleaved (0,1), (2,3), … as in TULIP's `apply_rotary_emb` (Meta-Llama's complex form), not HF's
half-split `rotate_half`. Every layer of the tower rotates q and k; the absolute position table is removed, so the
tower has no built-in length limit, and transformers builds the causal mask (CLIP) or padding mask (SigLIP) for the
actual input length. For contexts beyond the distilled length, TULIP's NTK-aware rescaling of the base is optional:

    θ' = θ · (s · L_new / L_train − (s − 1)) ^ (d_h / (d_h − 2))          (s = model.rope_ntk_factor; 0 = off)

The text config records `sharpclip_rope = {theta, ntk_factor, trained_length}` (`max_position_embeddings` is the
usable context), so `models.factory.load_checkpoint` rebuilds the tower. Stock transformers does not know this
attribute and would build an absolute-position tower: such a model is saved as a sharpclip checkpoint, not an HF
export (models.export).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.clip.modeling_clip import eager_attention_forward

ROPE_KEY = "sharpclip_rope"  # text-config attribute: {"theta", "ntk_factor", "trained_length"}


def ntk_theta(theta: float, head_dim: int, trained_length: int, length: int, factor: float) -> float:
    """TULIP's NTK-scaled base for `length` > `trained_length` (see the module docstring); θ otherwise."""
    if factor <= 0 or length <= trained_length:
        return theta
    return theta * (factor * length / trained_length - (factor - 1)) ** (head_dim / (head_dim - 2))


class Rotary(nn.Module):
    """Rotates (B, H, L, d_h) queries or keys by their position 0..L−1 (interleaved channel pairs)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head dimension, got {head_dim}")
        self.head_dim = head_dim
        self.theta = theta

    def angles(self, length: int, device: torch.device) -> Tensor:
        """(L, d_h/2) rotation angles in float32."""
        inv = self.theta ** (-torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32) / self.head_dim)
        return torch.arange(length, device=device, dtype=torch.float32)[:, None] * inv[None]

    def forward(self, x: Tensor) -> Tensor:
        """`x` rotated by position, in its own dtype (computed in float32)."""
        ang = self.angles(x.shape[-2], x.device)
        cos, sin = ang.cos(), ang.sin()
        pairs = x.float().unflatten(-1, (-1, 2))  # (..., L, d_h/2, 2)
        even, odd = pairs[..., 0], pairs[..., 1]
        out = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
        return out.flatten(-2).to(x.dtype)


class RotaryAttention(nn.Module):
    """A CLIP/SigLIP attention block that rotates q and k before the attention kernel (any `attn_implementation`).

    Built from an existing `CLIPAttention` / `SiglipAttention`: it takes over its projections (same parameter
    names, so teacher weights, peft targets and state dicts carry over).
    """

    def __init__(self, attention: nn.Module, rotary: Rotary) -> None:
        super().__init__()
        self.config = attention.config
        self.head_dim, self.scale = attention.head_dim, attention.scale
        self.dropout, self.is_causal = attention.dropout, attention.is_causal
        self.q_proj, self.k_proj, self.v_proj = attention.q_proj, attention.k_proj, attention.v_proj
        self.out_proj = attention.out_proj
        self.rotary = rotary

    def forward(
        self, hidden_states: Tensor, attention_mask: Tensor | None = None, **kwargs: Any
    ) -> tuple[Tensor, Tensor | None]:
        """hidden_states: (B, L, E) → (B, L, E) and the attention weights when the kernel returns them."""
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.rotary(self.q_proj(hidden_states).view(shape).transpose(1, 2))  # (B, H, L, d_h)
        k = self.rotary(self.k_proj(hidden_states).view(shape).transpose(1, 2))
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, weights = attend(
            self, q, k, v, attention_mask, scaling=self.scale, dropout=self.dropout if self.training else 0.0, **kwargs
        )
        return self.out_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights


class TokenEmbeddings(nn.Module):
    """Text embeddings without positions: `token_embedding(input_ids)` (same parameter name as CLIP's)."""

    def __init__(self, token_embedding: nn.Embedding) -> None:
        super().__init__()
        self.token_embedding = token_embedding

    def forward(
        self, input_ids: Tensor | None = None, position_ids: Tensor | None = None, inputs_embeds: Tensor | None = None
    ) -> Tensor:
        """Token embeddings of `input_ids`, or `inputs_embeds` as given; positions are ignored."""
        return self.token_embedding(input_ids) if inputs_embeds is None else inputs_embeds


def is_rope(text_model: nn.Module) -> bool:
    """True when the text tower was converted by `to_rope`."""
    return isinstance(text_model.embeddings, TokenEmbeddings)


def to_rope(text_model: nn.Module, theta: float = 10000.0, ntk_factor: float = 0.0, trained_length: int | None = None):
    """Turn a CLIP/SigLIP text tower into a RoPE tower in place (weights kept, position table dropped).

    trained_length: the context the tower is (or will be) distilled at; defaults to the current table length.
    """
    cfg = text_model.config
    rope = {"theta": theta, "ntk_factor": ntk_factor, "trained_length": trained_length or cfg.max_position_embeddings}
    setattr(cfg, ROPE_KEY, rope)
    text_model.embeddings = TokenEmbeddings(text_model.embeddings.token_embedding)
    for layer in text_model.encoder.layers:
        attn = layer.self_attn
        layer.self_attn = RotaryAttention(attn, Rotary(attn.head_dim, theta))
    set_rope_context(text_model, cfg.max_position_embeddings)


def set_rope_context(text_model: nn.Module, length: int) -> None:
    """Set the usable context to `length` tokens, NTK-rescaling θ from the recorded settings when enabled."""
    cfg = text_model.config
    rope = getattr(cfg, ROPE_KEY)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    theta = ntk_theta(rope["theta"], head_dim, rope["trained_length"], length, rope["ntk_factor"])
    cfg.max_position_embeddings = length
    for layer in text_model.encoder.layers:
        layer.self_attn.rotary.theta = theta
