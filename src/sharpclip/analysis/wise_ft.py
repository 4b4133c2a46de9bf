"""`sharpclip blend --sweep`: the WiSE-FT trade-off between a target metric and the guards, over α.

For each α the blended model θ_α (models.blend) is evaluated on the target's suite and every guard's suite in one
`run_suite` call; guards are measured against α = 0, the initialisation, which is always evaluated. The picked α
maximises the target among the αs whose floors all hold (eval.guards' floor rule).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from sharpclip.analysis.plots import fig_wise_ft
from sharpclip.config import Config, DataConfig, EvalConfig
from sharpclip.eval.guards import Guard, guard_deltas, metric_value, pick_guarded, suites_for
from sharpclip.eval.suite import run_suite
from sharpclip.models.blend import WeightBlend
from sharpclip.models.factory import save_checkpoint
from sharpclip.train.checkpoint import resolve_source


def parse_alphas(spec: str) -> list[float]:
    """`0,0.25,0.5` → sorted unique αs in [0, 1]; a clear ValueError otherwise."""
    try:
        alphas = sorted({float(a) for a in spec.split(",") if a.strip()})
    except ValueError:
        raise ValueError(f"--sweep {spec!r}: expected comma-separated numbers, e.g. 0,0.25,0.5,0.75,1") from None
    if not alphas or alphas[0] < 0 or alphas[-1] > 1:
        raise ValueError(f"--sweep {spec!r}: every α must be in [0, 1]")
    return alphas


def sweep(
    blend: WeightBlend,
    alphas: Sequence[float],
    eval_cfg: EvalConfig,
    data_cfg: DataConfig | None,
    target: str,
    guards: Sequence[Guard],
) -> dict[str, Any]:
    """{"target", "guards", "initial", "points": [{alpha, target, guard values, deltas}], "best_alpha"}."""
    cfg = replace(eval_cfg, suites=suites_for([target, *(g.metric for g in guards)]))
    reports = {a: run_suite(blend.at(a), cfg, data_cfg).results for a in sorted({0.0, *alphas})}
    initial = reports[0.0]
    points = [
        {
            "alpha": a,
            "target": metric_value(reports[a], target),
            "guards": {g.metric: metric_value(reports[a], g.metric) for g in guards},
            "deltas": guard_deltas(reports[a], initial, guards),
        }
        for a in alphas
    ]
    best = pick_guarded([p["target"] for p in points], [p["deltas"] for p in points], guards)
    return {
        "target": target,
        "guards": [asdict(g) for g in guards],
        "initial": {
            "target": metric_value(initial, target),
            **{g.metric: metric_value(initial, g.metric) for g in guards},
        },
        "points": points,
        "best_alpha": None if best is None else points[best]["alpha"],
    }


def write_sweep(curve: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """wise_ft.json (the numbers) and wise_ft.png (fig_wise_ft) in out_dir."""
    return list(fig_wise_ft(curve, Path(out_dir) / "wise_ft"))


BLEND_RECORD = "sharpclip_blend.json"  # written last into every --to folder: the entries the blend wrote


def prepare_target(directory: str | Path, force: bool) -> Path:
    """An empty output folder: a non-empty one is refused unless `force` and it holds an earlier blend's output and
    nothing else (its BLEND_RECORD lists what it wrote); `force` then removes exactly those entries."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"--to {directory}: is a file, not a folder")
    found = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    if found and not force:
        raise ValueError(f"--to {directory}: folder is not empty; choose another or pass --force to replace it")
    if found:
        ours = _earlier_blend(directory)
        extra = [n for n in found if n not in ours or (directory / n).is_symlink()] + _unrecorded_inside(directory)
        if extra:
            shown = ", ".join(extra[:5]) + (", ..." if len(extra) > 5 else "")
            raise ValueError(
                f"--to {directory}: --force replaces only an earlier blend's output ({BLEND_RECORD} and what it "
                f"lists), but the folder holds {shown}; refusing to delete them: choose another folder"
            )
        for name in found:
            path = directory / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()  # written by that blend (its record says)
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _unrecorded_inside(directory: Path) -> list[str]:
    """Files inside the folders of `directory` (`best_alpha/`, ...) that its blend record does not list: a file the
    user put into a blend's folder since (an older record listing none: every one)."""
    try:
        inside = {str(n) for n in json.loads((directory / BLEND_RECORD).read_text()).get("inside", [])}
    except (OSError, ValueError, AttributeError, TypeError):
        inside = set()
    folders = [p for p in directory.iterdir() if p.is_dir() and not p.is_symlink()]
    found = sorted(str(f.relative_to(directory)) for d in folders for f in d.rglob("*") if not f.is_dir())
    return [f for f in found if f not in inside]


def _earlier_blend(directory: Path) -> set[str]:
    try:
        return {str(n) for n in json.loads((directory / BLEND_RECORD).read_text())["written"]} | {BLEND_RECORD}
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def _record(out: Path, written: list[Path]) -> list[Path]:
    names = sorted(p.name for p in out.iterdir())
    inside = sorted(str(f.relative_to(out)) for f in out.rglob("*") if f.parent != out and not f.is_dir())
    (out / BLEND_RECORD).write_text(json.dumps({"written": names, "inside": inside}, indent=2) + "\n")
    return written


def run_blend(
    init: str,
    finetuned: str,
    to: str | Path,
    cfg: Config,
    alphas: Sequence[float],
    target: str = "",
    guards: Sequence[Guard] = (),
    best: bool = False,
    force: bool = False,
) -> list[Path]:
    """Entry point of `sharpclip blend`: one α → its checkpoint in `to`; several (a sweep, `target` required) → the
    curve (wise_ft.json / .png) and the picked α's checkpoint in `to/best_alpha`. Returns the paths written."""
    if len(alphas) > 1 and not target:
        raise ValueError("sharpclip blend --sweep needs --target SUITE/METRIC (e.g. retrieval/mean_R@1)")
    out = prepare_target(to, force)
    blend = WeightBlend(init, resolve_source(finetuned, best))
    if len(alphas) == 1:
        return _record(out, [save_checkpoint(blend.at(alphas[0]), out, blend.model_config)])
    curve = sweep(blend, alphas, cfg.eval, cfg.data, target, guards)
    written = write_sweep(curve, out)
    if curve["best_alpha"] is not None:
        written.append(save_checkpoint(blend.at(curve["best_alpha"]), out / "best_alpha", blend.model_config))
    return _record(out, written)
