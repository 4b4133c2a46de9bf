"""HN-CLIP's adaptive similarity margins (HN-CLIP eq. 2).

    L_HN = ½ [CE(s(S + γḠ), y) + CE(s(S + γḠ)ᵀ, y)],   Ḡ = stopgrad(T Tᵀ) ⊙ (1 − I)

Because Ḡ is detached, eq. 2 is eq. 1 on shifted logits: negative j of query i is handicapped by γ·Ḡ_ij, so the
positive must beat a near-duplicate caption by a margin proportional to their caption similarity. Ḡ is symmetric,
so the text→image logits are the transpose of the image→text ones.

Cost. Written naively, Ḡ is one extra detached B×B×D product on top of InfoNCE's three (forward S, and the two
gradient products), a 4/3 bound. Here the boost is fused into the forward product instead:

    S + γ·stopgrad(T Tᵀ) = (I + γ·stopgrad(T)) Tᵀ

evaluated as one matmul, with a hand-written backward that returns exactly the gradients of S (the second factor's
gradient through stopgrad(T) is dropped, as the stop-gradient demands). The diagonal γ·‖t_i‖² is then removed with
an O(B·D) correction. The boost therefore costs O(B·D + B²) element-wise work, not a matmul.

Rows against other columns. The same pieces take a block of rows against a wider set of columns, as when one rank
holds B rows of a gathered batch of N (losses.drop_in, open_clip's `local_loss`): Ḡ is then the rows' texts against
the gathered texts, zero at each row's own positive (i, offset + i), and still detached.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sharpclip.losses._common import scale_from_log, symmetric_cross_entropy
from sharpclip.losses.registry import register


class _BoostedSimilarity(torch.autograd.Function):
    """S + γ·Ḡ with Ḡ = stopgrad(R Tᵀ), zero at each row's own positive, in one matmul; gradients are those of
    S = I Tᵀ alone. image, rows: (B, D); text: (N, D); row i's positive is column offset + i (None: no positive)."""

    @staticmethod
    def forward(ctx, image: Tensor, rows: Tensor, text: Tensor, gamma: float, offset: int | None) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(image, text)
        out = torch.add(image, rows, alpha=gamma) @ text.t()
        if offset is not None:
            own = text[offset : offset + rows.shape[0]]
            out.diagonal(offset).sub_(gamma * (rows * own).sum(dim=-1))
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, None, Tensor | None, None, None]:  # type: ignore[override]
        image, text = ctx.saved_tensors
        grad_image = grad @ text if ctx.needs_input_grad[0] else None
        grad_text = grad.t() @ image if ctx.needs_input_grad[2] else None
        return grad_image, None, grad_text, None, None


def margin_matrix(reference_text: Tensor, columns: Tensor | None = None, offset: int | None = 0) -> Tensor:
    """Ḡ = stopgrad(R Cᵀ) with a zero at each row's own positive (i, offset + i). Returns (B, N), no grad.

    reference_text: (B, D) L2-normalised rows R; columns: (N, D) C, default R (the square batch, zero diagonal);
    offset: where row i's positive sits among the columns (a rank's first row in a gathered batch), None when the
    columns hold no positive of these rows (SigLIP's blocks of texts from other ranks).
    """
    with torch.no_grad():
        cols = reference_text if columns is None else columns
        g = reference_text.detach() @ cols.detach().t()
        if offset is not None:
            g.diagonal(offset)[: reference_text.shape[0]].fill_(0.0)
    return g


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
    """S + γ·Ḡ, (B, N). Ḡ comes from `reference_text` when given (e.g. a frozen text tower), else from `text`.

    image: (B, D) the rows; text: (N, D) the columns, N = B for the square batch. For rows against other columns
    (a rank's rows against the gathered batch) `rows` are the rows' own texts (B, D), `reference_rows` their
    reference embeddings, and `offset` is where row i's positive sits among the columns (None: nowhere).
    Returns the similarity and Ḡ when it was materialised (reference given), else None (fused path).
    """
    if reference_text is None:
        return _BoostedSimilarity.apply(
            image, (text if rows is None else rows).detach(), text, float(gamma), offset
        ), None
    reference_rows = reference_text if reference_rows is None else reference_rows
    g = margin_matrix(reference_rows, reference_text, offset)
    return image @ text.t() + gamma * g, g


@register("hn_clip")
def hn_clip(
    image: Tensor,
    text: Tensor,
    logit_scale: Tensor,
    logit_bias: Tensor | None = None,
    reference_text: Tensor | None = None,
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
    """
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
