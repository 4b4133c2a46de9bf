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

One figure is one recipe: the runs' whole resolved configs (config.yaml) must agree except for the seed and the
subset's size (`VARIES`: the x axis and the spread), the method (`METHOD`: one line each) and where a run wrote,
how it was watched and its memory or speed knobs (`BOOKKEEPING`); paths compare as places (config.as_place: a
trailing `/` aside). Runs that differ in anything else (the data, the model, the learning rate, the epochs, ...) are
refused, naming the keys and a run on each side: averaged or drawn against one reference they would be one curve
made of different experiments. Two methods with one label but different settings are refused the same way.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from sharpclip.analysis.dynamics import flatten, read_jsonl
from sharpclip.config import Config, as_place, is_path_key, load_config
from sharpclip.data.subset import read_subset_record
from sharpclip.train.resume import flatten as flat_config
from sharpclip.train.run import RESOLVED_CONFIG, SUBSET_RECORD

VARIES = ("train.seed", "data.train_fraction", "data.train_count", "data.subset_seed")  # seeds and subset size
METHOD = ("loss", "model.adapter")  # the objective and the adapter: one line per method
BOOKKEEPING = (
    "train.output_dir", "train.progress", "train.tensorboard", "train.wandb", "train.wandb_project",
    "train.wandb_name", "train.checkpoint_every", "train.keep_last", "train.dist_timeout_min", "data.num_workers",
    "data.prefetch_factor", "eval.output_dir", "eval.progress", "eval.num_workers", "train.diagnostics_every",
    "data.preload", "eval.batch_size", "eval.chunk_size", "train.encode_batch_size", "train.compile",
    "train.grad_checkpointing",
)  # where a run wrote, how it was watched, and memory or speed knobs: no effect on its numbers  # fmt: skip


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def _run_config(run: Path) -> Config:
    if not (run / RESOLVED_CONFIG).is_file():
        raise ValueError(f"{run}: not a run directory (no {RESOLVED_CONFIG})")
    return load_config(run / RESOLVED_CONFIG, saved=True)


def _differences(configs: dict[str, dict[str, Any]]) -> str:
    """'key (value in run A, value in run B), ...' for the keys whose values differ between the runs' configs."""
    runs = list(configs)
    every = {k for c in configs.values() for k in c}
    keys = sorted(k for k in every if len({repr(c.get(k)) for c in configs.values()}) > 1)
    parts = []
    for key in keys[:4]:
        first = runs[0]
        other = next(r for r in runs if configs[r].get(key) != configs[first].get(key))
        parts.append(f"{key} ({configs[first].get(key)!r} in {first}, {configs[other].get(key)!r} in {other})")
    more = f" and {len(keys) - 4} more" if len(keys) > 4 else ""
    return ", ".join(parts) + more


def check_one_recipe(runs: list[str | Path]) -> None:
    """ValueError naming the differing keys unless the runs differ only in VARIES, METHOD and BOOKKEEPING keys, and
    runs with one method label share their method's settings (see the module doc)."""
    settings: dict[str, dict[str, Any]] = {}
    methods: dict[str, dict[str, dict[str, Any]]] = {}
    for run in map(Path, runs):
        cfg = _run_config(run)
        flat = {k: as_place(v) if is_path_key(k) else v for k, v in flat_config(cfg).items()
                if not _under(k, VARIES + BOOKKEEPING)}  # fmt: skip
        settings[str(run)] = {k: v for k, v in flat.items() if not _under(k, METHOD)}
        methods.setdefault(method_label(cfg), {})[str(run)] = {k: v for k, v in flat.items() if _under(k, METHOD)}
    if len({repr(sorted(s.items())) for s in settings.values()}) > 1:
        raise ValueError(f"these runs differ in more than the seed, the subset size and the method: "
                         f"{_differences(settings)}; one sample-efficiency figure is runs of one recipe")  # fmt: skip
    for label, by_run in methods.items():
        if len({repr(sorted(m.items())) for m in by_run.values()}) > 1:
            raise ValueError(f"runs of method {label!r} differ in {_differences(by_run)}; one line is one method's "
                             "runs: give runs of one setting of it")  # fmt: skip


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
    cfg = _run_config(run)
    subset_file = run / SUBSET_RECORD
    subset = read_subset_record(subset_file) if subset_file.exists() else None
    value, keys = best_value(run, metric)
    point = {"run": str(run), "method": method_label(cfg), "value": value, "keys": keys}
    if subset:
        point.update(fraction=subset.selected / subset.total, selected=subset.selected)
        point.update(total=subset.total, ids_sha256=subset.ids_sha256)
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
