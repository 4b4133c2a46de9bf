"""Training dynamics read back from a run directory: gradient analysis (HN-CLIP §2.4, Fig. 4) and convergence.

`diagnostics.jsonl` — one JSON object per measurement (the trainer measures every k optimizer steps). Fields read:

| field             | type               | meaning                                                             |
|-------------------|--------------------|---------------------------------------------------------------------|
| step              | int                | optimizer step                                                      |
| epoch             | int or float       | epoch of the step (0-based; a float is floored)                     |
| loss_infonce      | float              | standard InfoNCE, HN-CLIP eq. 1, on the measured batch              |
| loss_hn           | float              | the boosted loss, eq. 2, on the same batch                          |
| grad_norm_infonce | float              | ‖∇θ L_CLIP‖ over all trainable parameters (fp32)                    |
| grad_norm_hn      | float              | ‖∇θ L_HN‖, same parameters                                          |
| grad_cosine       | float, NaN or null | cos(∇θ L_CLIP, ∇θ L_HN); NaN / null when either gradient is zero    |
| grad_zero_infonce | bool or 0/1        | optional: ∇θ L_CLIP is exactly zero in fp32 (default: its norm = 0) |

train/diagnostics.py writes these. Any other fields (Ḡ statistics, ratio, ...) are kept and ignored here. A batch is
*saturated* for a loss when that loss is below `SATURATION` (1e-3, the paper's "declared solved"). Per epoch we
report the share of saturated batches for each loss, the share of exact-zero L_CLIP gradients, the median and
interquartile range of ‖∇L_HN‖ / ‖∇L_CLIP‖ over measurements where ∇L_CLIP ≠ 0, and the mean and std of the cosine.

`metrics.jsonl` — the trainer's log: step records, and after each validated epoch one object with `epoch` and the
validation metrics (`eval/mean_R@1`, ...), nested as eval reports are ({"docci": {"t2i": {"R@1": ..}}}) or already
flat ("docci/t2i/R@1"); both are read as flat "a/b/c" keys.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from sharpclip.losses.monitors import INFONCE_MONITOR, SATURATED
from sharpclip.train.diagnostics import (
    GRAD_COSINE,
    GRAD_NORM_HN,
    GRAD_NORM_INFONCE,
    GRAD_ZERO_INFONCE,
    LOSS_HN,
    LOSS_INFONCE,
    MICRO_GRAD_ZERO_INFONCE,
    MICRO_LOSS_HN,
    MICRO_LOSS_INFONCE,
)

SATURATION = SATURATED  # the paper's "declared solved" (losses.monitors)
REQUIRED = ("step", "epoch", LOSS_INFONCE, LOSS_HN, GRAD_NORM_INFONCE, GRAD_NORM_HN)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Records of a JSON-lines file; a malformed line is an error naming file and line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found; is this a run directory written by `sharpclip train`?")
    out = []
    for no, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{no}: not JSON ({err.msg})") from None
    return out


def read_diagnostics(path: str | Path) -> list[dict[str, Any]]:
    """diagnostics.jsonl records, checked for the fields in the table above."""
    records = read_jsonl(path)
    for no, r in enumerate(records, 1):
        missing = [k for k in REQUIRED if k not in r]
        if missing:
            raise ValueError(f"{path}: record {no} lacks {missing}; the trainer must write {', '.join(REQUIRED)}")
    if not records:
        raise ValueError(f"{path}: no measurements")
    return records


def _number(value: Any) -> float | None:
    """A finite float, or None for null / NaN / inf (how JSON writers mark an undefined value)."""
    return float(value) if value is not None and math.isfinite(float(value)) else None


def _quartiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "q25": None, "q75": None}
    q25, med, q75 = np.quantile(np.asarray(values, dtype=np.float64), [0.25, 0.5, 0.75]).tolist()
    return {"median": med, "q25": q25, "q75": q75}


def _per_matrix(rs: list[dict[str, Any]], key: str, micro: str) -> list[float]:
    """`key` of each measured contrastive matrix: the per-micro-batch list under per_micro_batch, else the step's."""
    return [v for r in rs for v in (r[micro] if micro in r else [r[key]])]


def _epoch_summary(rs: list[dict[str, Any]], saturation: float) -> dict[str, Any]:
    zero = [bool(r.get(GRAD_ZERO_INFONCE, r[GRAD_NORM_INFONCE] == 0.0)) for r in rs]
    ratios = [r[GRAD_NORM_HN] / r[GRAD_NORM_INFONCE] for r, z in zip(rs, zero, strict=True) if not z]
    cos = [c for c in (_number(r.get(GRAD_COSINE)) for r in rs) if c is not None]
    infonce, hn = _per_matrix(rs, LOSS_INFONCE, MICRO_LOSS_INFONCE), _per_matrix(rs, LOSS_HN, MICRO_LOSS_HN)
    zero_matrix = (
        [bool(z) for z in _per_matrix(rs, GRAD_ZERO_INFONCE, MICRO_GRAD_ZERO_INFONCE)]
        if all(GRAD_ZERO_INFONCE in r or MICRO_GRAD_ZERO_INFONCE in r for r in rs)
        else zero
    )
    return {
        "measurements": len(rs),
        "saturated_infonce": sum(v < saturation for v in infonce) / len(infonce),
        "saturated_hn": sum(v < saturation for v in hn) / len(hn),
        "zero_grad_infonce": sum(zero_matrix) / len(zero_matrix),
        "grad_ratio": _quartiles(ratios),
        "cosine_mean": float(np.mean(cos)) if cos else None,
        "cosine_std": float(np.std(cos)) if cos else None,
    }


def gradient_dynamics(records: list[dict[str, Any]], saturation: float = SATURATION) -> dict[str, Any]:
    """Per-step series and per-epoch summaries of diagnostics records (Fig. 4's numbers)."""
    by_epoch: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_epoch[math.floor(r["epoch"])].append(r)
    series = {k: [r.get(k) for r in records] for k in REQUIRED}
    series[GRAD_COSINE] = [_number(r.get(GRAD_COSINE)) for r in records]
    per_epoch = {str(e): _epoch_summary(rs, saturation) for e, rs in sorted(by_epoch.items())}
    overall = _epoch_summary(records, saturation)
    return {"saturation_threshold": saturation, "series": series, "per_epoch": per_epoch, "overall": overall}


def flatten(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a/b": 1}."""
    out: dict[str, Any] = {}
    for k, v in record.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "/"))
        else:
            out[key] = v
    return out


def convergence(run_dir: str | Path, metric: str = "R@1", file: str = "metrics.jsonl") -> dict[str, list]:
    """{"epoch": [...], "<key>": [...]} for every flattened key ending in `metric`, from records with an epoch."""
    records = [flatten(r) for r in read_jsonl(Path(run_dir) / file) if "epoch" in r]
    keys = sorted({k for r in records for k in r if k.endswith(metric)})
    if not keys:
        raise ValueError(f"{Path(run_dir) / file}: no epoch records with a metric ending in {metric!r}")
    rows = [r for r in records if any(k in r for k in keys)]
    return {"epoch": [r["epoch"] for r in rows], **{k: [r.get(k) for r in rows] for k in keys}}


def training_curve(run_dir: str | Path, file: str = "metrics.jsonl") -> dict[str, list]:
    """{"step": [...], "loss": [...], "infonce_monitor": [...]} of the training steps (skipped steps left out)."""
    records = [r for r in read_jsonl(Path(run_dir) / file) if "loss" in r and "step" in r and not r.get("skipped")]
    if not records:
        raise ValueError(f"{Path(run_dir) / file}: no training steps")
    return {k: [r.get(k) for r in records] for k in ("step", "loss", INFONCE_MONITOR)}


def comparison_table(curves: dict[str, dict[str, list]]) -> str:
    """Markdown: per run and metric key, the last value, the best value and its epoch."""
    lines = ["| run | metric | last | best | best epoch |", "|---|---|---|---|---|"]
    for run, c in curves.items():
        for key, values in c.items():
            if key == "epoch":
                continue
            pts = [(e, v) for e, v in zip(c["epoch"], values, strict=True) if v is not None]
            if not pts:
                continue
            best_e, best_v = max(pts, key=lambda p: p[1])
            lines.append(f"| {run} | {key} | {pts[-1][1]:.2f} | {best_v:.2f} | {best_e} |")
    return "\n".join(lines) + "\n"
