"""Sample efficiency (HN-CLIP Fig. 6 / Table A9): R@1 against the fraction of training data, one line per method.

Of each run directory (trained with `data.train_fraction` / `data.train_count`, data.subset):

- the fraction: `selected / total` of its train_subset.json (data.subset's record), 1 for a run without one;
- the method: its objective's terms with weight ≠ 0, each by its registered loss and γ when it has one (`infonce`,
  `hn_clip γ=0.5`, `hn_clip γ=0.5 + filip`), prefixed by the adapter (`lora: ...`);
- the value: the best, over its validations (metrics.jsonl), of the metric (default `mean_R@1`; the mean of every
  key ending in it when several suites were validated), as HN-CLIP reports each run at its best epoch;
- the subset's digest, so that the table shows which runs shared a subset.

Runs of one method at one fraction (several seeds) are averaged, their spread kept. The reference line is the best
value of any run on the full data (fraction 1), HN-CLIP Fig. 6's dotted "strongest baseline trained on 100 %".
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from sharpclip.analysis.dynamics import flatten, read_jsonl
from sharpclip.config import Config, load_config
from sharpclip.train.run import RESOLVED_CONFIG, SUBSET_RECORD


def method_label(cfg: Config) -> str:
    """The run's objective in words: its terms with weight ≠ 0 (`hn_clip γ=0.5 + filip`), adapter first."""
    terms = []
    for term in cfg.loss.terms.values():
        if term.weight:
            gamma = term.params.get("gamma")
            terms.append(term.loss + (f" γ={gamma:g}" if gamma is not None else ""))
    label = " + ".join(terms) or "no objective"
    return f"{cfg.model.adapter.method}: {label}" if cfg.model.adapter.method != "none" else label


def best_value(run: Path, metric: str) -> tuple[float, list[str]]:
    """The best over the run's validation records of the mean of its keys ending in `metric`; and those keys."""
    records = [flatten(r) for r in read_jsonl(run / "metrics.jsonl") if "epoch" in r]
    keys = sorted({k for r in records for k in r if k.endswith(metric) and isinstance(r[k], int | float)})
    values = [statistics.fmean(r[k] for k in keys) for r in records if keys and all(k in r for k in keys)]
    if not values:
        raise ValueError(f"{run / 'metrics.jsonl'}: no validation record with a key ending in {metric!r}")
    return max(values), keys


def run_point(run: str | Path, metric: str = "mean_R@1") -> dict[str, Any]:
    """{"run", "method", "fraction", "selected", "total", "ids_sha256", "value", "keys"} of one run directory."""
    run = Path(run)
    if not (run / RESOLVED_CONFIG).is_file():
        raise ValueError(f"{run}: not a run directory (no {RESOLVED_CONFIG})")
    cfg = load_config(run / RESOLVED_CONFIG, saved=True)
    subset_file = run / SUBSET_RECORD
    subset = json.loads(subset_file.read_text()) if subset_file.is_file() else None
    value, keys = best_value(run, metric)
    point = {"run": str(run), "method": method_label(cfg), "value": value, "keys": keys}
    if subset:
        point.update(fraction=subset["selected"] / subset["total"], selected=subset["selected"])
        point.update(total=subset["total"], ids_sha256=subset["ids_sha256"])
    else:
        point.update(fraction=1.0, selected=None, total=None, ids_sha256=None)
    return point


def summarise(points: list[dict[str, Any]]) -> dict[str, Any]:
    """{"methods": {method: [{"fraction", "mean", "min", "max", "runs", "subsets"}, ...] by fraction}, "reference":
    the best full-data point or None}."""
    methods: dict[str, dict[float, list[dict[str, Any]]]] = {}
    for p in points:
        methods.setdefault(p["method"], {}).setdefault(round(p["fraction"], 6), []).append(p)
    out: dict[str, Any] = {"methods": {}}
    for method, by_fraction in methods.items():
        out["methods"][method] = [
            {
                "fraction": f, "mean": statistics.fmean(p["value"] for p in ps),
                "min": min(p["value"] for p in ps), "max": max(p["value"] for p in ps), "runs": len(ps),
                "subsets": sorted({(p["ids_sha256"] or "all")[:12] for p in ps}),
            }
            for f, ps in sorted(by_fraction.items())
        ]  # fmt: skip
    full = [p for p in points if p["fraction"] == 1.0]
    best = max(full, key=lambda p: p["value"]) if full else None
    out["reference"] = None if best is None else {"method": best["method"], "value": best["value"], "run": best["run"]}
    return out


def efficiency_table(summary: dict[str, Any], metric: str) -> str:
    """Markdown in the shape of HN-CLIP Table A9's R@1 column: one row per method and fraction."""
    lines = [f"| method | fraction | {metric} (best validation; mean of runs) | min–max | runs | subset ids sha256 |"]
    lines.append("|---|---|---|---|---|---|")
    for method, rows in summary["methods"].items():
        for r in rows:
            lines.append(
                f"| {method} | {100 * r['fraction']:.1f} % | {r['mean']:.2f} | {r['min']:.2f}–{r['max']:.2f} "
                f"| {r['runs']} | {', '.join(r['subsets'])} |"
            )
    ref = summary["reference"]
    note = f"Reference: the best full-data run, {ref['method']}, {ref['value']:.2f}." if ref else "No full-data run."
    return "\n".join(lines) + f"\n\n{note}\n"
