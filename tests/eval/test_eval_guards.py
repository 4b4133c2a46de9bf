"""Forgetting guards: report paths, deltas from the initial model, and the floor rule on hand-made sequences."""

from __future__ import annotations

import pytest

from sharpclip.eval.guards import Guard, crossed_floors, guard_deltas, metric_value, parse_guard, pick_guarded

REPORT = {"coco": {"t2i": {"R@1": 40.0}, "i2t": {"R@1": 50.0}}, "zeroshot": {"top1": 62.5}}


def test_metric_paths_and_the_derived_mean_r1() -> None:
    assert metric_value(REPORT, "zeroshot/top1") == 62.5
    assert metric_value(REPORT, "coco/t2i/R@1") == 40.0
    assert metric_value(REPORT, "coco/mean_R@1") == 45.0
    with pytest.raises(KeyError, match=r"no 'top5'.*has top1"):
        metric_value(REPORT, "zeroshot/top5")
    with pytest.raises(KeyError, match="no 'docci'"):
        metric_value(REPORT, "docci/mean_R@1")


def test_guard_parsing() -> None:
    assert parse_guard("zeroshot/top1:2") == Guard("zeroshot/top1", 2.0)
    assert parse_guard("coco/mean_R@1") == Guard("coco/mean_R@1", None)
    with pytest.raises(ValueError, match="suite/metric"):
        parse_guard("top1:2")
    with pytest.raises(ValueError, match="not a number"):
        parse_guard("zeroshot/top1:two")


def test_deltas_are_against_the_initial_evaluation() -> None:
    initial = {"zeroshot": {"top1": 70.0}, "coco": {"t2i": {"R@1": 41.0}, "i2t": {"R@1": 49.0}}}
    guards = [Guard("zeroshot/top1", 5.0), Guard("coco/mean_R@1")]
    deltas = guard_deltas(REPORT, initial, guards)
    assert deltas == {"zeroshot/top1": -7.5, "coco/mean_R@1": 0.0}
    assert crossed_floors(deltas, guards) == ["zeroshot/top1 (Δ -7.50 < -5.00)"]
    assert crossed_floors({"zeroshot/top1": -5.0, "coco/mean_R@1": -50.0}, guards) == []  # at the floor holds


def test_floor_rule_picks_the_best_target_among_checkpoints_that_hold() -> None:
    guards = [Guard("zeroshot/top1", 2.0), Guard("coco/mean_R@1", None)]  # the second is watched only
    targets = [50.0, 58.0, 61.0, 58.0, 55.0]
    deltas = [
        {"zeroshot/top1": 0.0, "coco/mean_R@1": 0.0},
        {"zeroshot/top1": -1.5, "coco/mean_R@1": -9.0},
        {"zeroshot/top1": -2.5, "coco/mean_R@1": 1.0},  # best target, but its floor is crossed
        {"zeroshot/top1": -0.5, "coco/mean_R@1": 0.0},  # ties 58.0: the earlier one wins
        {"zeroshot/top1": 0.0, "coco/mean_R@1": 0.0},
    ]
    assert pick_guarded(targets, deltas, guards) == 1
    assert pick_guarded(targets, deltas, []) == 2  # no guards: plain best
    assert pick_guarded([1.0], [{"zeroshot/top1": -3.0, "coco/mean_R@1": 0.0}], guards) is None
