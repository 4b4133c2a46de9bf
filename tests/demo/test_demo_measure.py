"""The demo's own measurements: within-family recall, hardest-companion siblings, run statistics, and the report's
gains and verdicts, each on a case small enough to compute by hand."""

from __future__ import annotations

import json

import pytest
import torch

from sharpclip.demo import report
from sharpclip.demo.measure import hardest_is_sibling, training_stats, within_family_r1


def test_within_family_r1_hand_case():
    # pairs 0, 1 are family A, pair 2 family B; sim[t, i] for text t, image i
    sim = torch.tensor(
        [
            [0.5, 0.9, 0.95],  # caption 0: its sibling image 1 beats it -> within miss; whole-set top-1 is image 2 (B)
            [0.1, 0.8, 0.2],  # caption 1: own image best -> hit
            [0.3, 0.9, 0.4],  # caption 2: alone in family B -> always a within hit; top-1 is image 1 (A)
        ]
    )
    out = within_family_r1(sim, ["A", "A", "B"])
    assert out["within_t2i_R@1"] == pytest.approx(200 / 3)
    assert out["family_hit_t2i"] == pytest.approx(100 / 3)  # only caption 1's top-1 is in its family
    # image queries (columns): image 0 -> captions (0.5, 0.1, 0.3) own best within A; image 1 -> (0.9, 0.8): miss
    assert out["within_i2t_R@1"] == pytest.approx(200 / 3)


def test_within_family_tie_is_a_miss():
    sim = torch.tensor([[0.5, 0.5], [0.0, 1.0]])
    assert within_family_r1(sim, ["A", "A"])["within_t2i_R@1"] == pytest.approx(50.0)


def test_hardest_is_sibling():
    text = torch.nn.functional.normalize(torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]]), dim=1)
    assert hardest_is_sibling(text, ["A", "A", "B", "B"]) == pytest.approx(100.0)
    assert hardest_is_sibling(text, ["A", "B", "A", "B"]) == pytest.approx(0.0)


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_training_stats_first_epoch_saturation(tmp_path):
    step = {"lr": 1e-4, "logit_scale": 100.0, "grad_norm": 1.0, "samples_per_s": 10.0, "loss": 0.5}
    metrics = [
        {**step, "epoch": 0, "infonce_monitor": 5e-4, "rows_saturated_monitor": 1.0, "loss": 5e-4},
        {**step, "epoch": 0, "infonce_monitor": 2e-3, "rows_saturated_monitor": 0.5},
        {"step": 2, "epoch": 1, "eval/mean_R@1": 10.0},  # an evaluation record is not a step
        {**step, "epoch": 1, "infonce_monitor": 1e-4, "rows_saturated_monitor": 1.0},
    ]
    _write(tmp_path / "metrics.jsonl", metrics)
    diag = {"loss_infonce": 1.0, "loss_hn": 2.0, "grad_norm_hn": 2.0}
    _write(
        tmp_path / "diagnostics.jsonl",
        [
            {**diag, "step": 0, "epoch": 0, "grad_norm_infonce": 0.0, "grad_zero_infonce": 1.0},
            {**diag, "step": 2, "epoch": 1, "grad_norm_infonce": 1.0, "grad_zero_infonce": 0.0},
        ],
    )
    s = training_stats(tmp_path)
    assert s["steps"] == 3 and s["steps_first_epoch"] == 2
    assert s["sat_batches_ep1"] == pytest.approx(50.0)
    assert s["sat_rows_ep1"] == pytest.approx(75.0)
    assert s["sat_batches"] == pytest.approx(200 / 3)
    assert s["active_batches"] == pytest.approx(200 / 3)  # the first step's own loss was below 1e-3
    assert s["zero_grad_infonce_ep1"] == pytest.approx(100.0)
    assert s["zero_grad_infonce"] == pytest.approx(50.0)
    assert s["grad_ratio_hn_over_infonce"] == pytest.approx(2.0)  # zero-gradient steps are left out of the ratio


def _results(hn_r1: list[float], base_r1: list[float], pairs: int = 600) -> report.Results:
    def arm(label, r1s):
        test = [{"mean_R@1": r, "test_pairs": pairs} for r in r1s]
        seeds = {s: {"test": t, "train": {}, "seconds": 1.0} for s, t in enumerate(test)}
        return {"label": label, "seeds": seeds}

    return {"infonce": arm("(a) InfoNCE", base_r1), "hn": arm("(b) HN", hn_r1)}


def test_gains_are_paired_by_seed():
    res = _results([12.0, 20.0], [10.0, 17.0])
    assert report.gains(res, "hn", "mean_R@1") == [2.0, 3.0]
    assert report.fmt([2.0, 3.0], 1, sign=True) == "+2.5 ± 0.7"
    assert report.fmt([2.0]) == "2.0"


@pytest.mark.parametrize(
    ("hn", "base", "verdict"),
    [([60.0], [50.0], "holds"), ([50.5], [50.0], "inconclusive (within noise)"), ([40.0], [50.0], "does not hold")],
)
def test_gain_verdict(hn, base, verdict):
    # noise at p = 0.5, n = 600: 2·√2·100·√(0.25/600) = 5.8 points
    assert report.noise(_results(hn, base)) == pytest.approx(5.77, abs=0.01)
    item = report._gain_verdict(_results(hn, base), "hn", "infonce", "mean_R@1", "claim")
    assert item["verdict"] == verdict


def test_unrun_claims_say_so_and_table_has_every_arm():
    res = _results([12.0], [10.0])
    items = {c["claim"]: c["verdict"] for c in report.claims(res)}
    assert items["γ plateau (HN-CLIP Table 3a)"] == "not run"
    table = report.markdown_table(res)
    assert "| (a) InfoNCE |" in table and "| (b) HN |" in table
    assert "+2.0" in table  # the gain column


def test_training_stats_count_every_micro_batch(tmp_path):
    """Under per_micro_batch a step holds several contrastive matrices; saturation is the share of all of them."""
    step = {"lr": 1e-4, "logit_scale": 100.0, "grad_norm": 1.0, "samples_per_s": 10.0, "loss": 0.5, "epoch": 0}
    metrics = [
        {
            **step,
            "infonce_monitor": 2e-3,
            "rows_saturated_monitor": 0.9,
            "saturated_monitor": 0.75,
            "matrices_monitor": 8,
        },
        {
            **step,
            "infonce_monitor": 5e-3,
            "rows_saturated_monitor": 0.5,
            "saturated_monitor": 0.25,
            "matrices_monitor": 8,
        },
    ]
    _write(tmp_path / "metrics.jsonl", metrics)
    s = training_stats(tmp_path)
    assert s["sat_batches_ep1"] == pytest.approx(50.0)  # 8 of 16 micro-batches; both steps' means are above 1e-3
