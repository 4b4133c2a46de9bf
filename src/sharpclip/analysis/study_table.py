"""The run settings of an eval report, for the long table of a study (eval.table's `eval_long.csv`).

A report `RUN/eval/step-N/eval_report.json` (or one whose eval manifest names the checkpoint `RUN/checkpoints/step-N`
as its model) belongs to the training run RUN at step N; its settings are read from the config that checkpoint was
trained with (its run_config.yaml, else RUN/config.yaml):

- objective: the terms with weight ≠ 0, each by its loss and γ (`hn_clip γ=0.5 + filip`; analysis.sample_efficiency's
  label, so the table and the sample-efficiency figure name a method alike), the adapter first;
- fraction (data.train_fraction), train_count (data.train_count, 0: by fraction), seed (train.seed), step;
- model (model.name: what the run fine-tuned), data (data.root, else data.format);
- recipe_sha256: the digest of the whole resolved config less the seed and the BOOKKEEPING keys (where a run wrote,
  how it was watched, memory or speed knobs), so that two runs with one digest differ in their seed alone.

A report of no training run (a published model evaluated as it is) has only its model, from the manifest.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from sharpclip.analysis.sample_efficiency import BOOKKEEPING, method_label
from sharpclip.config import Config, as_place, is_path_key, load_config
from sharpclip.train.resume import CHECKPOINT_RUN_CONFIG, RESOLVED_CONFIG
from sharpclip.train.resume import flatten as flat_config

SETTINGS = ("objective", "fraction", "train_count", "seed", "step", "model", "data", "recipe_sha256")
NOT_RECIPE = ("train.seed", *BOOKKEEPING)  # left out of recipe_sha256


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def recipe_digest(cfg: Config) -> str:
    """sha256 of the resolved config less NOT_RECIPE (paths compared as places), as canonical JSON."""
    flat = {k: as_place(v) if is_path_key(k) else v for k, v in flat_config(cfg).items() if not _under(k, NOT_RECIPE)}
    return hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()


def _checkpoint_of(report: Path) -> Path | None:
    """The checkpoint folder a report evaluated: RUN/eval/step-N/ → RUN/checkpoints/step-N, else the manifest's
    model when it is a checkpoint folder; None for anything else."""
    folder = report.parent
    if folder.parent.name == "eval" and folder.name.startswith("step-"):
        return folder.parent.parent / "checkpoints" / folder.name
    try:
        name = json.loads((folder / "eval_manifest.json").read_text(encoding="utf-8"))["model"]["name"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    path = Path(name) if isinstance(name, str) and name else None
    return path if path is not None and path.parent.name == "checkpoints" and path.name.startswith("step-") else None


def _manifest_model(report: Path) -> str:
    try:
        return str(json.loads((report.parent / "eval_manifest.json").read_text(encoding="utf-8"))["model"]["name"])
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def report_settings(report: str | Path) -> dict[str, Any]:
    """{setting: value} (SETTINGS, plus `training_run`) of the eval report file `report`; empty cells ("") for what
    is not known (module doc)."""
    report = Path(report)
    out: dict[str, Any] = dict.fromkeys(SETTINGS, "") | {"training_run": ""}
    checkpoint = _checkpoint_of(report)
    run = checkpoint.parent.parent if checkpoint is not None else None
    if run is None or not (run / RESOLVED_CONFIG).is_file():
        out["model"] = _manifest_model(report)
        return out
    source = checkpoint / CHECKPOINT_RUN_CONFIG
    cfg = load_config(source if source.is_file() else run / RESOLVED_CONFIG, saved=True)
    out.update(objective=method_label(cfg), fraction=cfg.data.train_fraction, train_count=cfg.data.train_count)
    out.update(seed=cfg.train.seed, step=int(checkpoint.name.removeprefix("step-")), model=cfg.model.name)
    out.update(data=cfg.data.root or cfg.data.format, recipe_sha256=recipe_digest(cfg), training_run=str(run))
    return out
