"""The demo's WiSE-FT curves: each chosen arm blended back towards the stage-A2 init, θ_α = (1 − α)·θ_init + α·θ_arm.

At every α the blend is scored on the test split's whole-set retrieval (the target, `retrieval/mean_R@1`) and on the
forgetting guard, zero-shot colour + shape classification of single-object scenes (`zeroshot/top1`, what stage A
taught; demo.measure.zeroshot_guard), with a floor of GUARD_MAX_DROP points below the init. The picked α is the best
target whose guard holds (eval.guards' floor rule), as `sharpclip blend --sweep` picks it; the figures and numbers go
to `<out>/wise_ft_<arm>/wise_ft.png|json`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sharpclip.analysis.wise_ft import sweep, write_sweep
from sharpclip.config import DataConfig, EvalConfig, GuardConfig
from sharpclip.data.synthdense.corpus import ZEROSHOT_PROMPTS
from sharpclip.models.blend import WeightBlend
from sharpclip.train.checkpoint import resolve_source

TARGET = "retrieval/mean_R@1"
GUARD_MAX_DROP = 2.0  # points of zero-shot top-1 the fine-tuning may give away
GUARD = GuardConfig("zeroshot/top1", GUARD_MAX_DROP)
ARMS = ("infonce", "hn")  # the curves docs/reproduction.md reports: the control and the boost


def eval_config(data: DataConfig) -> EvalConfig:
    """The target (the run's own data: SynthDense's test split) and the guard's suite (its zero-shot classes)."""
    root = Path(data.root)
    return EvalConfig(
        suites=["retrieval", "zeroshot"], roots={"zeroshot": str(root / "images" / "zeroshot")},
        prompts=str(root / ZEROSHOT_PROMPTS), split="test", zeroshot_k=[1], progress=False,
    )  # fmt: skip


def curves(
    init: Path, run_dirs: dict[str, Path], data: DataConfig, alphas: Sequence[float], out: Path
) -> dict[str, dict[str, Any]]:
    """The sweep of every arm of ARMS in `run_dirs` (its final checkpoint): {arm: analysis.wise_ft.sweep's curve}."""
    results = {}
    for arm in (a for a in ARMS if a in run_dirs):
        blend = WeightBlend(str(init), resolve_source(run_dirs[arm]))  # the arm's newest (final) checkpoint
        curve = sweep(blend, alphas, eval_config(data), data, TARGET, [GUARD])
        curve["files"] = [str(p) for p in write_sweep(curve, out / f"wise_ft_{arm}")]
        results[arm] = curve
    return results
