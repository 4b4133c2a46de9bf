"""Forgetting guards: evaluation numbers that fine-tuning must not give away, measured against the initial model.

A guard (config.GuardConfig) names one number of an evaluation report by its path, `suite/key/…` (e.g. `zeroshot/top1`,
`coco/t2i/R@1`, or `coco/mean_R@1`, the mean of a retrieval suite's t2i and i2t R@1), and optionally a floor:
`max_drop` points below the initial model's value. Apart from `evaluate_guards`, everything here is arithmetic on
reports; the trainer (train.guards) and `sharpclip blend --sweep` decide when to evaluate.

The floor rule (picking a checkpoint or a WiSE-FT α): among the candidates whose every floored guard holds, the one
with the highest target metric; ties go to the earliest candidate. When no candidate holds, there is no pick.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from sharpclip.config import DataConfig, EvalConfig, GuardConfig
from sharpclip.eval.embed import Embedder
from sharpclip.eval.evaluator import as_embedder
from sharpclip.eval.suite import run_suite

MEAN_R1 = "mean_R@1"  # derived key of a retrieval suite: (t2i R@1 + i2t R@1) / 2
GUARDS_HOLD = "guards_hold"  # validation key: 1.0 when every floored guard holds (train.Trainer's best rule)
Guard = GuardConfig  # a guard: `metric` (report path) and `max_drop` (points; None: watched only)


def parse_guard(spec: str) -> Guard:
    """`suite/key[:max_drop]`, e.g. `zeroshot/top1:2.0` (the command-line form)."""
    path, _, drop = spec.partition(":")
    if "/" not in path:
        raise ValueError(f"guard {spec!r}: expected suite/metric[:max_drop], e.g. zeroshot/top1:2.0")
    try:
        value = float(drop) if drop else None
    except ValueError:
        raise ValueError(f"guard {spec!r}: max_drop {drop!r} is not a number") from None
    return Guard(path, value)


def suites_for(paths: Sequence[str]) -> list[str]:
    """The evaluation suites that metric paths name, in order, each once."""
    return list(dict.fromkeys(path.split("/")[0] for path in paths))


def evaluate_guards(
    model: Any,
    guards: Sequence[Guard],
    cfg: EvalConfig,
    data: DataConfig | None,
    wrap: Callable[[Embedder], Embedder] | None = None,
    score: bool = True,
) -> dict[str, Any]:
    """The evaluation report of the guards' suites for `model`, on the device its parameters are on (a model being
    trained is never moved), without progress bars; `wrap`: applied to the model's embedder (sharding over ranks);
    score: False on a rank that only embeds its share (eval.suite.run_suite), which then returns {}."""
    device = str(next(model.parameters()).device)
    suites = suites_for([g.metric for g in guards])
    cfg = replace(cfg, suites=suites, device=device, progress=False)
    return run_suite(wrap(as_embedder(model, cfg)) if wrap else model, cfg, data, score=score).results


def guard_metrics(
    report: Mapping[str, Any], initial: Mapping[str, Any], guards: Sequence[Guard]
) -> tuple[dict[str, float], list[str]]:
    """What a validation records for the guards — `guard/<metric>` values, `guard_delta/<metric>` changes from the
    initial model and GUARDS_HOLD (1.0 or 0.0) — and the floors crossed (`crossed_floors`)."""
    deltas = guard_deltas(report, initial, guards)
    crossed = crossed_floors(deltas, guards)
    values = {f"guard/{g.metric}": metric_value(report, g.metric) for g in guards}
    return {**values, **{f"guard_delta/{m}": d for m, d in deltas.items()}, GUARDS_HOLD: float(not crossed)}, crossed


def metric_value(report: Mapping[str, Any], path: str) -> float:
    """The number at `path` (`suite/key/…`) of a report {suite: metrics}; KeyError names what exists there."""
    *parents, last = path.split("/")
    node: Any = report
    for part in parents:
        if not isinstance(node, Mapping) or part not in node:
            raise KeyError(f"{path}: no {part!r} in this report (has {_keys(node)})")
        node = node[part]
    if last == MEAN_R1 and isinstance(node, Mapping) and last not in node and "t2i" in node:
        return (float(node["t2i"]["R@1"]) + float(node["i2t"]["R@1"])) / 2
    if not isinstance(node, Mapping) or last not in node:
        raise KeyError(f"{path}: no {last!r} in this report (has {_keys(node)})")
    return float(node[last])


def _keys(node: Any) -> str:
    return ", ".join(sorted(map(str, node))) if isinstance(node, Mapping) else "no keys"


def guard_deltas(report: Mapping[str, Any], initial: Mapping[str, Any], guards: Sequence[Guard]) -> dict[str, float]:
    """Each guard's value minus its initial value (negative: fine-tuning cost that many points)."""
    return {g.metric: metric_value(report, g.metric) - metric_value(initial, g.metric) for g in guards}


def crossed_floors(deltas: Mapping[str, float], guards: Sequence[Guard]) -> list[str]:
    """The guards whose drop exceeds their max_drop, as `metric (Δ −3.10 < −2.00)` strings."""
    return [
        f"{g.metric} (Δ {deltas[g.metric]:+.2f} < {-g.max_drop:+.2f})"
        for g in guards
        if g.max_drop is not None and deltas[g.metric] < -g.max_drop
    ]


def pick_guarded(
    targets: Sequence[float], deltas: Sequence[Mapping[str, float]], guards: Sequence[Guard]
) -> int | None:
    """Index of the highest target among candidates whose floors all hold (earliest on ties), or None."""
    best: int | None = None
    for i, (target, delta) in enumerate(zip(targets, deltas, strict=True)):
        if not crossed_floors(delta, guards) and (best is None or target > targets[best]):
            best = i
    return best
