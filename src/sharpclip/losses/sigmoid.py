"""SigLIP's pairwise sigmoid loss, with HN-CLIP's adaptive margin as an option.

    L = −(1/B) Σ_ij log σ(z_ij · (s·(S + γḠ)_ij + b)),   z = 2I − 1

Every pair is an independent binary problem: positives on the diagonal, negatives elsewhere. With γ > 0, the same
detached caption-similarity margin as HN-CLIP eq. 2 is added to the negative logits (Ḡ has a zero diagonal), so a
near-duplicate caption must be pushed further below the decision boundary. γ = 0 is plain SigLIP.

The loss is a sum over image rows, so the share of rows r (local loss, losses.registry) is the same sum over
i ∈ r, against every text: (b, B) logits, the margin rows Ḡ_r as in HN-CLIP's local form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from sharpclip.losses._common import logits_of
from sharpclip.losses.margins import boosted_similarity, margin_matrix
from sharpclip.losses.registry import register


def pairwise_sigmoid(logits: Tensor, offset: int | None = 0, count: int | None = None) -> Tensor:
    """−Σ_ij log σ(z_ij · logits_ij) / count, z = +1 at each row's positive (i, offset + i), −1 elsewhere.

    logits: (b, N); offset None: the block holds no positive (one rank's images against another rank's texts);
    count: the rows of the whole loss this block is a share of (default b).
    """
    signs = -torch.ones_like(logits)
    if offset is not None:
        signs[:, offset : offset + len(logits)].diagonal().fill_(1.0)
    return -F.logsigmoid(signs * logits).sum() / (len(logits) if count is None else count)


@register("sigmoid")
def sigmoid(
    image: Tensor,
    text: Tensor,
    logit_scale: Tensor,
    logit_bias: Tensor | None = None,
    reference_text: Tensor | None = None,
    rows: slice | None = None,
    *,
    gamma: float = 0.0,
) -> Tensor:
    """SigLIP pairwise sigmoid loss with bias, optionally with HN-CLIP margins γ·Ḡ on the negatives.

    image, text: (B, D) L2-normalised; logit_scale: scalar, log space; logit_bias: scalar (SigLIP inits at −10).
    rows: compute these image rows only and return their share of the loss (local loss); None: every row.
    """
    if rows is None:
        sim = image @ text.t() if gamma == 0 else boosted_similarity(image, text, gamma, reference_text)[0]
        return pairwise_sigmoid(logits_of(sim, logit_scale, logit_bias))
    sim = image[rows] @ text.t()
    if gamma != 0:
        sim = sim + gamma * margin_matrix(text if reference_text is None else reference_text, rows)
    return pairwise_sigmoid(logits_of(sim, logit_scale, logit_bias), rows.indices(len(image))[0], len(image))
