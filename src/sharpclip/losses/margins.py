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
transpose, are T_r Iᵀ + γḠ_r (Ḡ is symmetric), with Ḡ_r = stopgrad(T_r Tᵀ), zero at each row's own positive. Both
are fused the same way, one on the left factor and one on the right:

    I_r Tᵀ + γ·Ḡ_r = (I_r + γ·stopgrad(T_r)) Tᵀ,        T_r Iᵀ + γ·Ḡ_r = T_r (I + γ·stopgrad(T))ᵀ

so the local form also costs InfoNCE's local products plus O(B·D + b·B). With a reference tower or
`duplicate_threshold`, Ḡ_r is materialised (one detached b×B×D product).

Blocks of other columns. The same kernel takes one rank's rows against any block of columns, as a loss dropped into
someone else's loop does (losses.drop_in: open_clip's `local_loss`, SigLIP's blocks of texts from other ranks):
`margin_block` is Ḡ between the rows' texts and the block's, zero at each row's own positive (i, offset + i) or
nowhere when the block holds none, and still detached.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sharpclip.losses._common import logits_of, scale_from_log, symmetric_cross_entropy, symmetric_row_cross_entropy
from sharpclip.losses.registry import register


class _BoostedSimilarity(torch.autograd.Function):
    """a·bᵀ + γ·(boost product), zero at the positives, in one matmul: (a + γ·c)·bᵀ (`left`) or a·(b + γ·c)ᵀ, c
    detached; the diagonal γ·‖t‖² of the positives at columns offset + i (if any) is removed in place. The backward
    returns exactly the gradients of a·bᵀ: whatever flows into the boost is dropped, as Ḡ's stop-gradient demands."""

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, c: Tensor, gamma: float, left: bool, offset: int | None, norms: Tensor):  # type: ignore[override]
        ctx.save_for_backward(a, b)
        out = torch.add(a, c, alpha=gamma) @ b.t() if left else a @ torch.add(b, c, alpha=gamma).t()
        if offset is not None:  # None: the columns hold no positive of these rows
            out[:, offset : offset + len(norms)].diagonal().sub_(gamma * norms)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        a, b = ctx.saved_tensors
        grad_a = grad @ b if ctx.needs_input_grad[0] else None
        grad_b = grad.t() @ a if ctx.needs_input_grad[1] else None
        return grad_a, grad_b, None, None, None, None, None


def _boosted(a: Tensor, b: Tensor, c: Tensor, gamma: float, left: bool, rows: slice, text_rows: Tensor) -> Tensor:
    norms = (text_rows.detach() * text_rows.detach()).sum(dim=-1)  # ‖t_i‖² of the rows' own captions
    return _BoostedSimilarity.apply(a, b, c.detach(), float(gamma), left, rows.indices(len(b))[0], norms)


def margin_block(reference_rows: Tensor, columns: Tensor, offset: int | None) -> Tensor:
    """stopgrad(R Cᵀ) with a zero at each row's own positive (i, offset + i); offset None: the block holds none.

    reference_rows: (b, D) L2-normalised R; columns: (N, D) C. Returns (b, N), no grad.
    """
    with torch.no_grad():
        g = reference_rows.detach() @ columns.detach().t()
        if offset is not None:
            g[:, offset : offset + len(g)].diagonal().zero_()
    return g


def margin_matrix(reference_text: Tensor, rows: slice | None = None) -> Tensor:
    """Ḡ = stopgrad(R Rᵀ) with a zero diagonal. reference_text: (B, D) L2-normalised. Returns (B, B), no grad;
    rows: only those rows of Ḡ, (b, B), zero at each row's own column."""
    rows = slice(0, len(reference_text)) if rows is None else rows
    return margin_block(reference_text[rows], reference_text, rows.indices(len(reference_text))[0])


def boosted_similarity(
    image: Tensor,
    text: Tensor,
    gamma: float,
    reference_text: Tensor | None = None,
    *,
    rows: Tensor | None = None,
    reference_rows: Tensor | None = None,
    offset: int | None = 0,
) -> tuple[Tensor, Tensor | None]:
    """S + γ·Ḡ, (b, N). Ḡ comes from `reference_text` when given (e.g. a frozen text tower), else from `text`.

    image: (b, D) the rows; text: (N, D) the columns (b = N: the square batch). For one rank's rows against another
    block of columns, `rows` are the rows' own texts (b, D) (default `text`: the square batch), `reference_rows`
    their reference embeddings, and `offset` is where row i's positive sits among the columns (None: nowhere).
    Returns the similarity and Ḡ when it was materialised (reference given), else None (fused path).
    """
    if reference_text is None:
        own = text if rows is None else rows
        norms = (own.detach() * own.detach()).sum(dim=-1)  # ‖t_i‖² of the rows' own captions
        return _BoostedSimilarity.apply(image, text, own.detach(), float(gamma), True, offset, norms), None
    g = margin_block(reference_text if reference_rows is None else reference_rows, reference_text, offset)
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
        return hn_clip_rows(image, text, logit_scale, logit_bias, reference_text, rows, gamma, duplicate_threshold)
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


def hn_clip_rows(
    image: Tensor,
    text: Tensor,
    logit_scale: Tensor,
    logit_bias: Tensor | None,
    reference_text: Tensor | None,
    rows: slice,
    gamma: float,
    duplicate_threshold: float | None,
    detach_columns: bool = False,
) -> Tensor:
    """The share of eq. 2 held by query rows `rows` (see the module docstring): both directions' rows, (b, B).
    `hn_clip(..., rows=rows)` calls it; `detach_columns`: the (B, D) column operands pass no gradient, only the
    rows do (open_clip's local loss over features gathered without gradient, losses.drop_in)."""
    image_columns, text_columns = (image.detach(), text.detach()) if detach_columns else (image, text)
    if reference_text is None and duplicate_threshold is None:  # Ḡ_r fused into both products
        mine = text[rows]
        image_rows = _boosted(image[rows], text_columns, mine, gamma, True, rows, mine)  # (I_r + γT_r) Tᵀ
        text_rows = _boosted(mine, image_columns, text, gamma, False, rows, mine)  # T_r (I + γT)ᵀ
        return symmetric_row_cross_entropy(
            logits_of(image_rows, logit_scale, logit_bias), logits_of(text_rows, logit_scale, logit_bias), rows
        )
    g = margin_matrix(text if reference_text is None else reference_text, rows)
    image_rows = logits_of(image[rows] @ text_columns.t() + gamma * g, logit_scale, logit_bias)
    text_rows = logits_of(text[rows] @ image_columns.t() + gamma * g, logit_scale, logit_bias)
    if duplicate_threshold is not None:
        duplicates = g >= duplicate_threshold
        duplicates[:, rows].diagonal().fill_(False)
        image_rows, text_rows = (x.masked_fill(duplicates, float("-inf")) for x in (image_rows, text_rows))
    return symmetric_row_cross_entropy(image_rows, text_rows, rows)
