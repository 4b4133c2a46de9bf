"""Symmetric InfoNCE, the CLIP loss (HN-CLIP eq. 1; CLIP-IN eqs. 1-2 up to the factor 1/2).

    L = ½ [CE(s·S + b, y) + CE(s·Sᵀ + b, y)],   S = I Tᵀ,  y_i = i

with s = exp(logit_scale) and an optional scalar logit bias b (zero when absent).
"""

from __future__ import annotations

from torch import Tensor

from sharpclip.losses._common import scale_from_log, symmetric_cross_entropy
from sharpclip.losses.registry import register


@register("infonce")
def infonce(image: Tensor, text: Tensor, logit_scale: Tensor, logit_bias: Tensor | None = None) -> Tensor:
    """Symmetric CLIP loss over the batch (HN-CLIP eq. 1).

    image, text: (B, D) L2-normalised, row i of each forms the positive pair; logit_scale: scalar, log space.
    """
    logits = scale_from_log(logit_scale) * (image @ text.t())
    if logit_bias is not None:
        logits = logits + logit_bias
    return symmetric_cross_entropy(logits)
