"""Cosine distillation of a text tower (CLIP-IN eq. 7; TULIP's stage 1).

    L_distill = 1 − mean_b cos(g_T(y_b), g_S(y_b))

The teacher's embeddings come from the frozen original tower on captions truncated to its context; the student
(the RoPE tower) sees the same tokens. Inputs need not be normalised: the cosine normalises them.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from sharpclip.losses.registry import register


@register("distill_cosine", per_sample=True)
def distill_cosine(teacher: Tensor, student: Tensor, rows: slice | None = None) -> Tensor:
    """1 − cosine between teacher and student embeddings, averaged over the batch (CLIP-IN eq. 7).

    teacher, student: (B, D); the teacher is expected to carry no gradient (a frozen tower).
    rows: these rows' share of the mean only (local loss, losses.registry); None: every row.
    """
    if rows is None:
        return 1.0 - F.cosine_similarity(teacher, student, dim=-1).mean()
    return (1.0 - F.cosine_similarity(teacher[rows], student[rows], dim=-1)).sum() / len(teacher)
