"""The exact-versus-micro-batch comparison: the softmax mass split and the gradient comparison."""

from __future__ import annotations

import math

import pytest
import torch

from sharpclip.demo.exact_gap import batch_comparison, mass_split


def test_mass_split_puts_each_rows_mass_where_the_logits_say():
    # 4 rows in micro-batches of 2: every row's positive at 0, its micro-batch partner at log 2, the others at log 3
    logits = torch.full((4, 4), math.log(3.0))
    logits[0, 1] = logits[1, 0] = logits[2, 3] = logits[3, 2] = math.log(2.0)
    logits.fill_diagonal_(0.0)
    split = mass_split(logits, micro=2)
    # per row: exp 1 (positive), 2 (partner), 3 + 3 (other micro-batch) of a total 9
    assert split == pytest.approx({"positive": 1 / 9, "own_negatives": 2 / 9, "other_negatives": 6 / 9})
    assert sum(split.values()) == pytest.approx(1.0)


def test_mass_split_averages_both_directions():
    logits = torch.zeros(2, 2)
    logits[0, 1] = math.log(3.0)  # image 0 prefers text 1; text 1 (column) prefers image 0 as well
    split = mass_split(logits, micro=1)
    # image rows: row 0 puts 3/4 on the other, row 1 1/2; text rows (columns): col 0 1/2, col 1 3/4
    assert split["other_negatives"] == pytest.approx((3 / 4 + 1 / 2 + 1 / 2 + 3 / 4) / 4)
    assert split["own_negatives"] == 0.0


class _Pair(torch.nn.Module):
    """Features are the inputs times one trained matrix: enough to differentiate both objectives."""

    def __init__(self, dim: int):
        super().__init__()
        self.w = torch.nn.Parameter(
            torch.eye(dim) + 0.1 * torch.randn(dim, dim, generator=torch.Generator().manual_seed(0))
        )
        self.logit_scale = torch.nn.Parameter(torch.tensor(math.log(10.0)), requires_grad=False)

    def forward(self, pixel_values, input_ids, attention_mask=None):
        norm = torch.nn.functional.normalize
        return {"image": norm(pixel_values @ self.w, dim=-1), "text": norm(input_ids @ self.w, dim=-1)}


class _Batch:
    def __init__(self, image, text):
        self.pixel_values, self.input_ids, self.attention_mask = image, text, None


def test_with_one_micro_batch_the_two_objectives_are_the_same():
    g = torch.Generator().manual_seed(1)
    image, text = torch.randn(8, 5, generator=g), torch.randn(8, 5, generator=g)
    same = batch_comparison(_Pair(5), _Batch(image, text), micro=8)
    assert same["loss_exact"] == pytest.approx(same["loss_micro"])
    assert same["grad_norm_ratio"] == pytest.approx(1.0) and same["grad_cosine"] == pytest.approx(1.0)
    split = batch_comparison(_Pair(5), _Batch(image, text), micro=2)
    assert split["loss_exact"] > split["loss_micro"]  # more negatives per row: a harder problem
    assert split["other_negatives"] > 0 and split["grad_cosine"] < 1.0
