"""The demo's own measurements: within-family recall, hardest-companion siblings, run statistics, and the report's
gains and verdicts, each on a case small enough to compute by hand."""

from __future__ import annotations

import json

import pytest
import torch

from sharpclip.demo import report
from sharpclip.demo.measure import family_r1, hardest_is_sibling, mmvp_breakdown, training_stats, within_family_r1


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
    assert s["diag_sat_infonce"] == s["diag_sat_hn"] == 0.0  # losses 1.0 and 2.0: nothing measured below 1e-3


@pytest.mark.parametrize(
    ("clip", "hn", "verdict"),
    [([0.0, 0.0, 1.0], [2.0, 3.0, 1.5], "holds"), ([0.0, 0.0], [0.0, 2.0], "partly"), ([0.5], [2.0], "trivially")],
)
def test_the_boost_keeps_batches_active_on_the_same_micro_batches(tmp_path, clip, hn, verdict):
    """Fig. 4's claim from the measured micro-batches: L_CLIP below 1e-3 where L_HN is not."""
    step = {"epoch": 0, "infonce_monitor": 0.1, "rows_saturated_monitor": 0.0, "loss": 0.1, "logit_scale": 100.0,
            "grad_norm": 1.0, "samples_per_s": 1.0}  # fmt: skip
    _write(tmp_path / "metrics.jsonl", [step])
    record = {"step": 0, "epoch": 0, "loss_infonce": 0.1, "loss_hn": 1.0, "grad_norm_infonce": 1.0,
              "grad_norm_hn": 3.0, "grad_zero_infonce": 0.0, "micro_loss_infonce": clip, "micro_loss_hn": hn,
              "micro_grad_zero_infonce": [0.0] * len(clip)}  # fmt: skip
    _write(tmp_path / "diagnostics.jsonl", [record])
    stats = training_stats(tmp_path)
    assert stats["diag_sat_infonce"] == pytest.approx(100.0 * sum(x < 1e-3 for x in clip) / len(clip))
    results = {"infonce": {"label": "(a) InfoNCE", "seeds": {0: {"test": {}, "train": stats}}}}
    item = report._active(results)
    assert item["verdict"].startswith(verdict), item


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


def test_the_gamma_plateau_is_judged_on_the_gammas_that_ran():
    res = _results([40.0, 41.0], [50.0, 51.0])
    res["hn_g1.0"] = _results([30.0, 31.0], [50.0, 51.0])["hn"] | {"label": "(f) HN γ=1.0"}
    item = report._plateau(res)
    assert item["measured"].startswith("mean R@1 gain over InfoNCE by γ: 0.5: -10.0 (noise ±")
    assert "1.0: -20.0" in item["measured"] and "0.75" not in item["measured"]
    # γ 0.5 and 1.0 differ by 10 points, beyond the binomial bar (5.8 at 600 pairs): not a plateau
    assert item["verdict"] == "does not hold (gain varies with γ beyond noise)"
    res["hn_g1.0"] = _results([38.0, 39.0], [50.0, 51.0])["hn"] | {"label": "(f) HN γ=1.0"}
    assert report._plateau(res)["verdict"] == "flat, and every γ ≥ 0.5 loses to InfoNCE beyond noise"  # -10, -12
    res["hn_g1.0"] = _results([47.0, 48.0], [50.0, 51.0])["hn"] | {"label": "(f) HN γ=1.0"}
    assert report._plateau(res)["verdict"] == "does not hold (gain varies with γ beyond noise)"  # -10 vs -3: 7 > 5.8
    res["hn"] = _results([48.0, 49.0], [50.0, 51.0])["hn"] | {"label": "(b) HN"}
    assert report._plateau(res)["verdict"] == "flat, but no γ gains beyond noise"  # -2 and -3, within noise
    del res["hn_g1.0"]
    assert report._plateau(res)["verdict"] == "not run"  # γ 0.5 alone is no sweep


def test_the_learnable_scale_claim_is_judged_against_the_scale_the_arms_start_from():
    def arms(frozen, learned):
        seeds = lambda v: {"0": {"train": {"final_scale": v}}}  # noqa: E731
        return {"hn": {"seeds": seeds(frozen)}, "hn_learn_s": {"seeds": seeds(learned)}}

    # from 500, a learnable scale at 300 sank; at 480 it did not, even though both are above 100
    assert report._scale(arms(500.0, 300.0))["verdict"] == "holds"
    assert report._scale(arms(500.0, 480.0))["verdict"] == "does not hold"
    assert report._scale(arms(100.0, 85.0))["verdict"] == "holds"
    assert "from 500.0" in report._scale(arms(500.0, 300.0))["measured"]
    assert report._scale({"hn_learn_s": arms(1.0, 1.0)["hn_learn_s"]})["verdict"] == "not run"


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


def test_family_r1_is_the_per_family_mean_of_both_directions():
    sim = torch.tensor([[0.5, 0.9, 0.95], [0.1, 0.8, 0.2], [0.3, 0.9, 0.4]])  # the within-family hand case above
    out = family_r1(sim, ["A", "A", "B"])
    # whole set: t2i hits caption 1 only; i2t: image 0 -> (0.5, 0.1, 0.3) hit, image 1 -> miss, image 2 -> miss
    assert out["family_r1"] == pytest.approx([50.0, 0.0])  # A: (0 + 1 + 1 + 0) / 4; B: 0
    assert out["family_within"] == pytest.approx([50.0, 100.0])


def test_paired_noise_uses_the_spread_of_per_family_differences():
    res = _results([12.0], [10.0])
    res["infonce"]["seeds"][0]["test"]["t2i_R@1"] = 10.0
    res["hn"]["seeds"][0]["test"]["family_r1"] = [12.0, 14.0, 10.0, 12.0]
    res["infonce"]["seeds"][0]["test"]["family_r1"] = [10.0, 10.0, 10.0, 10.0]
    # differences 2, 4, 0, 2: sd = 1.633, SE = 0.816, bar = 2·SE
    assert report.paired_noise(res, "hn", "infonce", "mean_R@1") == pytest.approx(2 * 1.63299 / 2, rel=1e-4)
    # without per-family values: the binomial bar of two independent arms
    assert report.paired_noise(res, "hn", "infonce", "t2i_R@1") == report.noise(res, "t2i_R@1")


def test_every_seed_is_compared_with_the_one_init_and_the_headroom_claim():
    res = _results([60.0, 61.0], [56.0, 58.0])
    for seed, sat in ((0, 75.0), (1, 55.0)):
        res["infonce"]["seeds"][seed]["test"]["within_mean_R@1"] = 40.0 + seed
        res["infonce"]["seeds"][seed]["train"]["sat_batches_ep1"] = sat
    res["init"] = {"label": "A2", "seeds": {0: {"test": {"mean_R@1": 50.0, "within_mean_R@1": 30.0}}}}
    assert report.gains(res, "infonce", "mean_R@1", report.INIT) == [6.0, 8.0]
    assert report._headroom(res)["verdict"] == "holds"
    res["infonce"]["seeds"][1]["train"]["sat_batches_ep1"] = 45.0  # one seed saturates less than half its batches
    assert report._headroom(res)["verdict"] == "does not hold"
    head, rows = report.table_rows(res)
    assert "Δ init" in head and any("+7.0 ± 1.4" in r for r in rows)


def test_mmvp_breakdown_counts_same_image_picks_and_the_chance_they_leave():
    # (P, statement, image); statement k is true of image k
    scores = torch.tensor(
        [
            [[0.9, 0.1], [0.1, 0.9]],  # right
            [[0.9, 0.1], [0.8, 0.2]],  # both statements pick image a
            [[0.2, 0.8], [0.1, 0.9]],  # both pick image b
            [[0.1, 0.9], [0.9, 0.1]],  # different images, the wrong way round
        ]
    )
    out = mmvp_breakdown(scores, torch.tensor([0.9, 0.99, 0.99, 0.5]), ["colour", "count", "count", "colour"])
    assert out["right"] == 25.0 and out["same_image"] == 50.0 and out["both_pick_a"] == 25.0
    assert out["chance"] == 25.0  # half of the 2 pairs whose statements pick different images
    assert out["per_pattern"]["count"]["same_image"] == 100.0 and out["statement_cos"] == pytest.approx(0.845)


def test_exact_zero_gradients_are_counted_on_saturated_micro_batches(tmp_path):
    step = {"epoch": 0, "infonce_monitor": 1e-4, "rows_saturated_monitor": 1.0, "loss": 1e-4, "logit_scale": 100.0}
    _write(tmp_path / "metrics.jsonl", [{**step, "grad_norm": 0.0, "samples_per_s": 1.0}])
    diag = {"step": 0, "epoch": 0, "loss_infonce": 1e-3, "loss_hn": 1.0, "grad_norm_infonce": 1.0, "grad_norm_hn": 2.0}
    micro = {"micro_loss_infonce": [0.0, 1e-5, 0.5, 2e-4], "micro_grad_zero_infonce": [1.0, 0.0, 0.0, 1.0]}
    _write(tmp_path / "diagnostics.jsonl", [{**diag, **micro, "grad_zero_infonce": 0.0}])
    s = training_stats(tmp_path)
    assert s["saturated_measured"] == 3 and s["zero_grad_saturated"] == pytest.approx(200 / 3)
    assert s["zero_grad_micro"] == pytest.approx(50.0)


def test_the_guard_claim_reports_every_arms_change_from_the_init_against_the_floor():
    res = _results([60.0], [56.0])
    res["init"] = {"label": "A2", "seeds": {0: {"test": {"mean_R@1": 50.0, "zeroshot_top1": 80.0}}}}
    res["infonce"]["seeds"][0]["test"]["zeroshot_top1"] = 79.0  # −1: within the 2-point floor
    res["hn"]["seeds"][0]["test"]["zeroshot_top1"] = 75.0  # −5: crossed
    item = report._guard(res)
    assert item["verdict"] == "holds for 1 of 2 arms" and "(b) HN -5.0" in item["measured"]
    head, rows = report.table_rows(res)
    column, hn = head.index("zero-shot guard top-1"), next(r for r in rows if r[0] == "(b) HN")
    assert head[column + 1] == "Δ init" and hn[column : column + 2] == ["75.0", "-5.0"]


def test_the_wise_ft_claim_reads_the_picked_alpha_of_each_curve():
    def point(alpha, target, delta):
        return {"alpha": alpha, "target": target, "guards": {}, "deltas": {"zeroshot/top1": delta}}

    held = {"initial": {"target": 20.0}, "best_alpha": 0.5,
            "points": [point(0.0, 20.0, 0.0), point(0.5, 26.0, -1.0), point(1.0, 28.0, -4.0)]}  # fmt: skip
    lost = {"initial": {"target": 20.0}, "best_alpha": None, "points": [point(0.0, 20.0, -3.0), point(1.0, 25.0, -4.0)]}
    assert report._wise(None)["verdict"] == "not run"
    item = report._wise({"infonce": held})
    assert item["verdict"] == "holds" and "picked α = 0.5: target 26.0, guard -1.0" in item["measured"]
    assert report._wise({"infonce": held, "hn": lost})["verdict"] == "partly"
