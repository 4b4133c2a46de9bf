"""Pieces shared by the contrastive losses: the logit scale and the symmetric cross-entropy."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

LN_100 = math.log(100.0)  # the CLIP convention: the inverse temperature never exceeds 100


def scale_from_log(logit_scale: Tensor | float) -> Tensor:
    """exp of the log-space logit scale, clamped to ln 100 (the parameter itself is clamped by the trainer)."""
    logit_scale = torch.as_tensor(logit_scale)
    return logit_scale.clamp(max=LN_100).exp()


def symmetric_cross_entropy(logits: Tensor) -> Tensor:
    """(CE over rows + CE over columns) / 2 with the diagonal as targets. logits: (B, B), row i = image i."""
    labels = torch.arange(logits.shape[0], device=logits.device)
    return 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels))
