"""Diagnostic terms: computed on the objective's features at every step, weight 0 and without a gradient, so they
are logged but never optimised. The step records them under the metric keys below (metrics.jsonl), which the demo
and the analysis read back.

InfoNCE saturation (HN-CLIP §2.1): a contrastive batch (or one query row of it) whose InfoNCE loss is below 1e-3 is
"solved": its softmax residual, hence its gradient, has all but vanished. Per row, over both directions,

    ℓ_i = CE(s·S_i:, i)  (image i → texts)    and    ℓ'_j = CE(s·S_:j, j)  (text j → images),   S = I Tᵀ

their mean is the batch's symmetric InfoNCE (HN-CLIP eq. 1, no bias) and `rows_saturated` the share below 1e-3.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from sharpclip.losses._common import scale_from_log

SATURATED = 1e-3  # HN-CLIP §2.1: a batch (or row) whose InfoNCE loss is below this is "solved"

# metrics.jsonl keys of the saturation monitor, one value per optimiser step (train.step.combine_monitors)
INFONCE_MONITOR = "infonce_monitor"  # row-weighted mean InfoNCE of the step's contrastive matrices
ROWS_SATURATED_MONITOR = "rows_saturated_monitor"  # share of query rows whose own InfoNCE is below SATURATED
SATURATED_MONITOR = "saturated_monitor"  # share of the step's contrastive matrices whose InfoNCE is below it
MATRICES_MONITOR = "matrices_monitor"  # contrastive matrices in the step (1 under exact accumulation)


def per_row_infonce(image: Tensor, text: Tensor, logit_scale: Tensor) -> Tensor:
    """(2B,) the InfoNCE of every query: B image → text rows, then B text → image columns. image, text: (B, D)."""
    logits = scale_from_log(logit_scale) * image @ text.t()
    labels = torch.arange(len(image), device=image.device)
    rows = F.cross_entropy(logits, labels, reduction="none")
    cols = F.cross_entropy(logits.t(), labels, reduction="none")
    return torch.cat([rows, cols])


def infonce_saturation(image: Tensor, text: Tensor, logit_scale: Tensor) -> dict[str, Tensor]:
    """The batch's InfoNCE and the share of its query rows below SATURATED, without a gradient."""
    with torch.no_grad():
        per_row = per_row_infonce(image.detach(), text.detach(), logit_scale.detach())
        return {"infonce": per_row.mean(), "rows_saturated": (per_row < SATURATED).float().mean()}
