"""Symmetric InfoNCE, the CLIP loss (HN-CLIP eq. 1; CLIP-IN eqs. 1-2 up to the factor 1/2).

    L = ½ [CE(s·S + b, y) + CE(s·Sᵀ + b, y)],   S = I Tᵀ,  y_i = i

with s = exp(logit_scale) and an optional scalar logit bias b (zero when absent). Given `rows` (local loss,
losses.registry), the image→text rows are those images against every text and the text→image rows those texts
against every image: I_r Tᵀ and T_r Iᵀ, (b, B) each.
"""

from __future__ import annotations

from torch import Tensor

from sharpclip.losses._common import logits_of, symmetric_cross_entropy, symmetric_row_cross_entropy
from sharpclip.losses.registry import register


@register("infonce")
def infonce(
    image: Tensor, text: Tensor, logit_scale: Tensor, logit_bias: Tensor | None = None, rows: slice | None = None
) -> Tensor:
    """Symmetric CLIP loss over the batch (HN-CLIP eq. 1).

    image, text: (B, D) L2-normalised, row i of each forms the positive pair; logit_scale: scalar, log space.
    rows: compute these query rows only and return their share of the loss (local loss); None: every row.
    """
    if rows is None:
        return symmetric_cross_entropy(logits_of(image @ text.t(), logit_scale, logit_bias))
    image_rows = logits_of(image[rows] @ text.t(), logit_scale, logit_bias)
    text_rows = logits_of(text[rows] @ image.t(), logit_scale, logit_bias)
    return symmetric_row_cross_entropy(image_rows, text_rows, rows)
