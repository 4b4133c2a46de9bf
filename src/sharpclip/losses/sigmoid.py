"""SigLIP's pairwise sigmoid loss, with HN-CLIP's adaptive margin as an option.

    L = −(1/B) Σ_ij log σ(z_ij · (s·(S + γḠ)_ij + b)),   z = 2I − 1

Every pair is an independent binary problem: positives on the diagonal, negatives elsewhere. With γ > 0, the same
detached caption-similarity margin as HN-CLIP eq. 2 is added to the negative logits (Ḡ has a zero diagonal), so a
near-duplicate caption must be pushed further below the decision boundary. γ = 0 is plain SigLIP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from sharpclip.losses._common import scale_from_log
from sharpclip.losses.margins import boosted_similarity
from sharpclip.losses.registry import register


def pairwise_sigmoid(logits: Tensor, positives: bool = True) -> Tensor:
    """−Σ_ij log σ(z_ij · logits_ij) / rows, z = 2I − 1; `positives` False: the block holds none (z = −1), as for
    one rank's images against another rank's texts. logits: (B, N)."""
    signs = -torch.ones_like(logits)
    if positives:
        signs.diagonal().fill_(1.0)
    return -F.logsigmoid(signs * logits).sum() / logits.shape[0]


@register("sigmoid")
def sigmoid(
    image: Tensor,
    text: Tensor,
    logit_scale: Tensor,
    logit_bias: Tensor | None = None,
    reference_text: Tensor | None = None,
    *,
    gamma: float = 0.0,
) -> Tensor:
    """SigLIP pairwise sigmoid loss with bias, optionally with HN-CLIP margins γ·Ḡ on the negatives.

    image, text: (B, D) L2-normalised; logit_scale: scalar, log space; logit_bias: scalar (SigLIP inits at −10).
    """
    sim = image @ text.t() if gamma == 0 else boosted_similarity(image, text, gamma, reference_text)[0]
    logits = scale_from_log(logit_scale) * sim
    if logit_bias is not None:
        logits = logits + logit_bias
    return pairwise_sigmoid(logits)
