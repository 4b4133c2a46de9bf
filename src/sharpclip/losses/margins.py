"""HN-CLIP's adaptive similarity margins (HN-CLIP eq. 2).

    L_HN = ½ [CE(s(S + γḠ), y) + CE(s(S + γḠ)ᵀ, y)],   Ḡ = stopgrad(T Tᵀ) ⊙ (1 − I)

Because Ḡ is detached, eq. 2 is eq. 1 on shifted logits: negative j of query i is handicapped by γ·Ḡ_ij, so the
positive must beat a near-duplicate caption by a margin proportional to their caption similarity. Ḡ is symmetric,
so the text→image logits are the transpose of the image→text ones.

Cost. Written naively, Ḡ is one extra detached B×B×D product on top of InfoNCE's three (forward S, and the two
gradient products), a 4/3 bound. On one process the boost is fused into the forward product instead:

    S + γ·stopgrad(T Tᵀ) = (I + γ·stopgrad(T)) Tᵀ

evaluated as one matmul, with a hand-written backward that returns exactly the gradients of S (the second factor's
gradient through stopgrad(T) is dropped, as the stop-gradient demands). The diagonal γ·‖t_i‖² is then removed with
an O(B·D) correction. The boost therefore costs O(B·D + B²) element-wise work, not a matmul.

Local loss (`rows`, losses.registry: a process computes the query rows of its own b samples against all B columns).
Both directions read the same margin rows: image→text rows are I_r Tᵀ + γḠ_r and text→image rows, the rows of the
transpose, are T_r Iᵀ + γḠ_r (Ḡ is symmetric), with Ḡ_r = stopgrad(T_r Tᵀ), zero at each row's own positive. That
is one detached b×B×D product beside InfoNCE's, materialised rather than fused.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sharpclip.losses._common import logits_of, scale_from_log, symmetric_cross_entropy, symmetric_row_cross_entropy
from sharpclip.losses.registry import register


class _BoostedSimilarity(torch.autograd.Function):
    """S + γ·Ḡ with Ḡ = stopgrad(T Tᵀ), zero diagonal, in one matmul; gradients are those of S = I Tᵀ alone."""

    @staticmethod
    def forward(ctx, image: Tensor, text: Tensor, gamma: float) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(image, text)
        out = torch.add(image, text, alpha=gamma) @ text.t()
        out.diagonal().sub_(gamma * (text * text).sum(dim=-1))
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:  # type: ignore[override]
        image, text = ctx.saved_tensors
        grad_image = grad @ text if ctx.needs_input_grad[0] else None
        grad_text = grad.t() @ image if ctx.needs_input_grad[1] else None
        return grad_image, grad_text, None


def margin_matrix(reference_text: Tensor, rows: slice | None = None) -> Tensor:
    """Ḡ = stopgrad(R Rᵀ) with a zero diagonal. reference_text: (B, D) L2-normalised. Returns (B, B), no grad;
    rows: only those rows of Ḡ, (b, B), zero at each row's own column."""
    with torch.no_grad():
        ref = reference_text.detach()
        rows = slice(0, len(ref)) if rows is None else rows
        g = ref[rows] @ ref.t()
        g[:, rows].diagonal().zero_()
    return g


def boosted_similarity(
    image: Tensor, text: Tensor, gamma: float, reference_text: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """S + γ·Ḡ, (B, B). Ḡ comes from `reference_text` when given (e.g. a frozen text tower), else from `text`.

    Returns the similarity and Ḡ when it was materialised (reference given), else None (fused path).
    """
    if reference_text is None:
        return _BoostedSimilarity.apply(image, text, float(gamma)), None
    g = margin_matrix(reference_text)
    return image @ text.t() + gamma * g, g


@register("hn_clip")
def hn_clip(
    image: Tensor,
    text: Tensor,
    logit_scale: Tensor,
    logit_bias: Tensor | None = None,
    reference_text: Tensor | None = None,
    rows: slice | None = None,
    *,
    gamma: float = 0.5,
    duplicate_threshold: float | None = None,
) -> Tensor:
    """InfoNCE with detached caption-similarity margins on the negatives (HN-CLIP eq. 2).

    image, text: (B, D) L2-normalised pairs; logit_scale: scalar, log space.
    reference_text: (B, D) embeddings the margin is built from instead of `text` (HN-CLIP Table 3c, Ḡ from the
        frozen initial text tower); default None recomputes Ḡ from the current `text` every step.
    duplicate_threshold: captions whose similarity is ≥ this are the same caption in all but name: they are masked
        out of both softmaxes (a false negative is not a negative) instead of being boosted. None disables it.
    rows: compute these query rows only and return their share of the loss (local loss); None: every row.
    """
    if rows is not None:
        return _hn_clip_rows(image, text, logit_scale, logit_bias, reference_text, rows, gamma, duplicate_threshold)
    if duplicate_threshold is None:
        sim, _ = boosted_similarity(image, text, gamma, reference_text)
        duplicates = None
    else:
        g = margin_matrix(text if reference_text is None else reference_text)
        sim = image @ text.t() + gamma * g
        duplicates = g >= duplicate_threshold
        duplicates.fill_diagonal_(False)
    logits = scale_from_log(logit_scale) * sim
    if logit_bias is not None:
        logits = logits + logit_bias
    if duplicates is not None:
        logits = logits.masked_fill(duplicates, float("-inf"))
    return symmetric_cross_entropy(logits)


def _hn_clip_rows(
    image: Tensor,
    text: Tensor,
    logit_scale: Tensor,
    logit_bias: Tensor | None,
    reference_text: Tensor | None,
    rows: slice,
    gamma: float,
    duplicate_threshold: float | None,
) -> Tensor:
    """The share of eq. 2 held by query rows `rows` (see the module docstring): both directions' rows, (b, B)."""
    g = margin_matrix(text if reference_text is None else reference_text, rows)
    image_rows = logits_of(image[rows] @ text.t() + gamma * g, logit_scale, logit_bias)
    text_rows = logits_of(text[rows] @ image.t() + gamma * g, logit_scale, logit_bias)
    if duplicate_threshold is not None:
        duplicates = g >= duplicate_threshold
        duplicates[:, rows].diagonal().fill_(False)
        image_rows, text_rows = (x.masked_fill(duplicates, float("-inf")) for x in (image_rows, text_rows))
    return symmetric_row_cross_entropy(image_rows, text_rows, rows)
