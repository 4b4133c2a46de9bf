"""The margin in the paper's units (analysis.geometry): spread and uniform part in logits, the γ for a spread, and the
reach √(2 − 2G) of a unit image vector, against hand-computed cases and an independent brute-force search."""

from __future__ import annotations

import math

import pytest
import torch

from sharpclip.analysis import geometry as g


def test_the_papers_fig1_spreads_and_uniform_parts_in_logits():
    # HN-CLIP Fig. 1 at γ 0.5, s 100: DOCCI 100·0.5·(0.93 − 0.84) = 4.5 over 42; DCI 3.5 over 42.5; Urban-1K 3.0 over 44
    want = {"DOCCI": (4.5, 42.0), "DCI": (3.5, 42.5), "Urban-1K": (3.0, 44.0)}
    for name, (p, h) in g.PAPER_FIG1.items():
        m = g.margin_logits(p, h, g.PAPER_GAMMA, g.PAPER_SCALE)
        assert (m["spread"], m["uniform"]) == pytest.approx(want[name])
    assert g.paper_spread() == pytest.approx(11.0 / 3.0)


def test_gamma_for_a_spread_inverts_the_spread_and_refuses_no_spread():
    gamma = g.gamma_for_spread(4.0, pairwise=0.9, hardest=0.98, scale=500.0)
    assert gamma == pytest.approx(4.0 / 40.0)
    assert g.margin_logits(0.9, 0.98, gamma, 500.0)["spread"] == pytest.approx(4.0)
    with pytest.raises(ValueError, match="no γ"):
        g.gamma_for_spread(4.0, pairwise=0.9, hardest=0.9, scale=100.0)


def test_reach_matches_the_issue_numbers_and_a_brute_force_search():
    assert g.reach(0.999) == pytest.approx(0.0447, abs=1e-4)  # a one-word twin: γ 0.5 asks 0.50
    assert g.reach(0.93) == pytest.approx(0.374, abs=1e-3)  # Fig. 1's hardest: γ 0.5 asks 0.465
    # independent check: the best unit v for max v·(t_i − t_j) over 20,000 random directions never exceeds the reach,
    # and the direction of t_i − t_j attains it
    torch.manual_seed(0)
    for cos in (0.3, 0.9, 0.99):
        ti = torch.tensor([1.0, 0.0, 0.0])
        tj = torch.tensor([cos, math.sqrt(1 - cos * cos), 0.0])
        v = torch.nn.functional.normalize(torch.randn(20000, 3), dim=-1)
        best = float((v @ (ti - tj)).max())
        assert best <= g.reach(cos) + 1e-6 and best > 0.98 * g.reach(cos)
        d = (ti - tj) / (ti - tj).norm()
        assert float(d @ (ti - tj)) == pytest.approx(g.reach(cos), abs=1e-6)
        assert float(g.reach(torch.tensor(cos))) == pytest.approx(g.reach(cos), abs=1e-6)


def _pairs(*cosines: float) -> torch.Tensor:
    """Two captions per cosine, each pair in its own 2-D plane (pairs orthogonal to each other): (2·len, 2·len)."""
    rows = []
    for k, c in enumerate(cosines):
        a, b = torch.zeros(2 * len(cosines)), torch.zeros(2 * len(cosines))
        a[2 * k] = 1.0
        b[2 * k], b[2 * k + 1] = c, math.sqrt(1 - c * c)
        rows += [a, b]
    return torch.stack(rows)


def test_unreachable_share_counts_captions_whose_hardest_asks_more_than_the_reach():
    # γ 0.5: the threshold is (√(1 + 2γ²) − 1) / γ² = 0.899; pairs at 0.95 are out of reach, pairs at 0.5 are not
    text = _pairs(0.95, 0.5)
    stats = g.caption_geometry(text, gammas=(0.5, 0.1), scale=100.0)
    margin = stats["margin"]
    assert margin["per_gamma"]["0.5"]["unreachable_share"] == pytest.approx(0.5)
    assert margin["per_gamma"]["0.1"]["unreachable_share"] == 0.0  # 0.095 < √0.1 = 0.316
    threshold = (math.sqrt(1 + 2 * 0.25) - 1) / 0.25
    assert 0.5 * threshold == pytest.approx(g.reach(threshold))  # where the ask meets the reach
    # mean pairwise over the 12 ordered pairs: 2·0.95 + 2·0.5 + 8 orthogonal zeros; mean hardest (0.95 + 0.5) / 2
    p, h = (2 * 0.95 + 2 * 0.5) / 12, (0.95 + 0.5) / 2
    assert margin["per_gamma"]["0.5"]["spread"] == pytest.approx(100 * 0.5 * (h - p))
    assert margin["per_gamma"]["0.5"]["uniform"] == pytest.approx(100 * 0.5 * p)
    gamma = margin["gamma_for_paper_spread"]
    assert gamma == pytest.approx(g.paper_spread() / (100 * (h - p)))
    assert margin["per_gamma"][f"{gamma:.4g}"]["spread"] == pytest.approx(g.paper_spread())
    assert "margin" not in g.caption_geometry(text)  # without a scale: no logits to count


def test_margin_table_prints_the_paper_rows_beside_the_measured_ones():
    text = _pairs(0.95, 0.5)
    stats = {"mine": g.caption_geometry(text, gammas=(0.5,), scale=100.0)}
    md = g.margin_table({"mine": stats["mine"]["margin"]}, stats)
    assert "| HN-CLIP Fig. 1: DOCCI | 0.5 | 100 | 4.5 | 42.0 | 0.47 / 0.37 | – |" in md
    assert "| mine | 0.5 | 100 |" in md and "| 50.0% |" in md
