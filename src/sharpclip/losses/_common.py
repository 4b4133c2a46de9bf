"""Pieces shared by the contrastive losses: the logit scale, the symmetric cross-entropy and its local-loss form
(the share of some query rows, losses.registry's `rows`)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

# The lowest value of each loss hyperparameter, wherever it is given (a config term's weight and params, a drop-in
# loss's constructor); every numeric value must also be finite. γ scales the margin added to the negatives (HN-CLIP
# eq. 2): below 0 it eases them; a negative weight is gradient ascent on its term; FILIP's chunk_size counts rows.
# A loss may also declare bool and str hyperparameters (a switch, a mode's name): their type is checked against the
# annotation (losses.objective), never a range, except for the names above, which are numbers.
HYPERPARAMETER_FLOOR = {"gamma": 0.0, "weight": 0.0, "chunk_size": 1}


def hyperparameter_problem(name: str, value: Any) -> str | None:
    """Why `value` cannot be hyperparameter `name` ('must be a finite number >= 0'); None when it can (None itself:
    an optional one left unset)."""
    if value is None:
        return None
    if isinstance(value, Tensor) and value.numel() == 1:  # a 0-d tensor γ works as a number does
        value = value.item()
    low = HYPERPARAMETER_FLOOR.get(name)
    if isinstance(value, bool | str) and low is None:  # a switch or a name: no range to check
        return None
    number = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    if number and (low is None or value >= low):
        return None
    return "must be a finite number" + (f" >= {low:g}" if low is not None else "")


def check_hyperparameters(owner: str, **values: Any) -> None:
    """ValueError '<owner>: gamma=nan must be a finite number >= 0' for the first value out of its range."""
    for name, value in values.items():
        if (problem := hyperparameter_problem(name, value)) is not None:
            raise ValueError(f"{owner}: {name}={value!r} {problem}")


def scale_from_log(logit_scale: Tensor | float) -> Tensor:
    """s = exp(logit_scale), as given: like the reference losses (open_clip's, big_vision's, transformers'), no loss
    clamps it, so a frozen scale or a checkpoint's own (SigLIP's ≈ 112) is the one used. The trainer keeps a
    learnable scale in range after each step (`train.optim.clamp_logit_scale`)."""
    return torch.as_tensor(logit_scale).exp()


def logits_of(similarity: Tensor, logit_scale: Tensor, logit_bias: Tensor | None = None) -> Tensor:
    """s·similarity + b, s = exp(logit_scale) (`scale_from_log`), b the optional scalar bias."""
    logits = scale_from_log(logit_scale) * similarity
    return logits if logit_bias is None else logits + logit_bias


def symmetric_cross_entropy(logits: Tensor) -> Tensor:
    """(CE over rows + CE over columns) / 2 with the diagonal as targets. logits: (B, B), row i = image i."""
    labels = torch.arange(logits.shape[0], device=logits.device)
    return 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels))


def row_cross_entropy(logits: Tensor, rows: slice, total: int) -> Tensor:
    """Σ_i CE(logits_i, rows.start + i) / total: the share of a mean cross-entropy over `total` queries that the
    query rows `rows` hold, the target of row i being column rows.start + i. logits: (b, N), b = rows' length."""
    start = rows.indices(total)[0]
    labels = torch.arange(start, start + logits.shape[0], device=logits.device)
    return F.cross_entropy(logits, labels, reduction="sum") / total


def symmetric_row_cross_entropy(image_rows: Tensor, text_rows: Tensor, rows: slice) -> Tensor:
    """The share of `symmetric_cross_entropy` held by query rows `rows`: image_rows (b, B) are those images against
    every text (rows of the logits), text_rows (b, B) those texts against every image (rows of the transpose)."""
    total = image_rows.shape[1]
    return 0.5 * (row_cross_entropy(image_rows, rows, total) + row_cross_entropy(text_rows, rows, total))
