"""Caption-geometry statistics (analysis/geometry.py) against hand-computed values and a dense reference."""

from __future__ import annotations

import pytest
import torch

from sharpclip.analysis.geometry import (
    caption_geometry,
    effective_dimension,
    geometry_table,
    hardness_buckets,
    mean_pairwise_similarity,
)


def test_hand_computed_three_captions() -> None:
    # cos(0,1) = 0.95, cos(0,2) = 0, cos(1,2) = 0.3122... computed below from the vectors.
    t = torch.tensor([[1.0, 0.0, 0.0], [0.95, 0.31224990, 0.0], [0.0, 0.0, 1.0]])
    t = torch.nn.functional.normalize(t, dim=1)
    s = caption_geometry(t, chunk_size=2)
    g01 = float(t[0] @ t[1])
    assert s["mean_pairwise"] == pytest.approx((g01 + 0 + 0) / 3, abs=1e-6)
    assert s["mean_hardest"] == pytest.approx((g01 + g01 + 0.0) / 3, abs=1e-6)
    # Off-diagonal ordered pairs: 6, of which (0,1) and (1,0) are >= 0.9 and >= 0.8.
    assert s["share_negatives_at_least"] == {"0.8": pytest.approx(2 / 6), "0.9": pytest.approx(2 / 6)}
    assert sum(s["hist_pairwise"]) == 6 and sum(s["hist_hardest"]) == 3
    buckets = hardness_buckets(s)
    assert buckets == {">= 0.9": pytest.approx(1 / 3), "[0.8, 0.9)": pytest.approx(0.0), "< 0.8": pytest.approx(2 / 3)}


def test_matches_dense_reference() -> None:
    t = torch.nn.functional.normalize(torch.randn(50, 8, generator=torch.Generator().manual_seed(0)) + 2, dim=1)
    s = caption_geometry(t, chunk_size=7)
    g = t @ t.t()
    off = g[~torch.eye(50, dtype=torch.bool)]
    assert s["mean_pairwise"] == pytest.approx(float(off.mean()), abs=1e-5)
    assert mean_pairwise_similarity(t) == pytest.approx(float(off.mean()), abs=1e-5)
    hardest = g.fill_diagonal_(-2).max(1).values
    assert s["mean_hardest"] == pytest.approx(float(hardest.mean()), abs=1e-5)
    assert s["share_negatives_at_least"]["0.8"] == pytest.approx(float((off >= 0.8).double().mean()))


def test_in_batch_scope_and_table() -> None:
    t = torch.nn.functional.normalize(torch.randn(40, 4, generator=torch.Generator().manual_seed(1)), dim=1)
    s = caption_geometry(t, batch_size=8)
    assert "batches of 8" in s["negatives_scope"]
    assert 0.0 <= s["share_negatives_at_least"]["0.8"] <= 1.0
    table = geometry_table({"toy": s})
    assert table.startswith("| dataset | captions | pairwise sim | hardest sim | ≥ 0.8 | ≥ 0.9 |")
    assert "| toy | 40 |" in table
    with pytest.raises(ValueError, match="no full batch"):
        caption_geometry(t, batch_size=64)
    with pytest.raises(ValueError, match="N >= 2"):
        caption_geometry(t[:1])


def test_effective_dimension_counts_the_directions_captions_vary_along() -> None:
    # ±e1, ±e2, ±e3 about a shared direction e0: three equal variances, so (Σλ)² / Σλ² = 9 / 3 = 3
    rows = [[1.0, sign * (k == 1), sign * (k == 2), sign * (k == 3)] for k in (1, 2, 3) for sign in (1.0, -1.0)]
    t = torch.nn.functional.normalize(torch.tensor(rows), dim=1)
    assert effective_dimension(t) == pytest.approx(3.0)
    assert caption_geometry(t)["effective_dim"] == pytest.approx(3.0)
    # unequal spreads count less than their number: variances 4 : 1 give (5)² / 17
    wide = torch.tensor([[2.0, 0.0], [-2.0, 0.0], [0.0, 1.0], [0.0, -1.0]])
    assert effective_dimension(wide) == pytest.approx(25 / 17)
    assert effective_dimension(torch.ones(4, 3)) == 0.0
