"""Forgetting guards: evaluation numbers that fine-tuning must not give away, measured against the initial model.

A guard names one number of an evaluation report by its path, `suite/key/…` (e.g. `zeroshot/top1`,
`coco/t2i/R@1`, or `coco/mean_R@1`, the mean of a retrieval suite's t2i and i2t R@1), and optionally a floor:
`max_drop` points below the initial model's value. Everything here is pure arithmetic on reports; the trainer and
`sharpclip blend --sweep` decide when to evaluate.

The floor rule (picking a checkpoint or a WiSE-FT α): among the candidates whose every floored guard holds, the one
with the highest target metric; ties go to the earliest candidate. When no candidate holds, there is no pick.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MEAN_R1 = "mean_R@1"  # derived key of a retrieval suite: (t2i R@1 + i2t R@1) / 2


@dataclass(frozen=True)
class Guard:
    """One guarded number: its report path and the largest drop (points) that still holds (None: watched only)."""

    metric: str
    max_drop: float | None = None

    @classmethod
    def parse(cls, spec: str) -> Guard:
        """`suite/key[:max_drop]`, e.g. `zeroshot/top1:2.0` (the command-line form)."""
        path, _, drop = spec.partition(":")
        if "/" not in path:
            raise ValueError(f"guard {spec!r}: expected suite/metric[:max_drop], e.g. zeroshot/top1:2.0")
        try:
            return cls(path, float(drop) if drop else None)
        except ValueError:
            raise ValueError(f"guard {spec!r}: max_drop {drop!r} is not a number") from None


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
