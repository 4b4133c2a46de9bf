"""The model card and provenance of an export (`sharpclip export`): README.md through huggingface_hub's card API.

The card's YAML header is what the Hugging Face Hub reads (`ModelCardData`): library_name (transformers, the folder's
format), pipeline_tag (zero-shot-image-classification, or image-feature-extraction for a vision tower), base_model and
datasets (Hub ids only: the user gives them, `--base-model` / `--dataset`; a local path is recorded in the text
instead), license (as the user sets it, `--license`; none unless given), tags, and model-index from the eval reports
of the exported checkpoint (`RUN/eval/step-N/eval_report.json`, as `sharpclip eval --model RUN` writes them). The
text holds the training run, step, objective, the settings that differ from sharpclip's defaults (as overrides that
rebuild the config), the config digest, the eval table and the eval manifest's data digests. Nothing is uploaded:
docs/models.md shows `hf upload` for the folder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sharpclip.analysis.sample_efficiency import method_label
from sharpclip.analysis.study_table import recipe_digest
from sharpclip.config import Config, load_config, to_yaml
from sharpclip.eval.table import headline, tables
from sharpclip.train.resume import CHECKPOINT_RUN_CONFIG, RESOLVED_CONFIG, changes

TASKS = {"retrieval": "image-text-retrieval", "zeroshot": "zero-shot-image-classification"}


@dataclass
class CardOptions:
    """What only the user can say: the license and the Hub ids of the base model and the data."""

    license: str = ""
    base_model: str = ""
    datasets: list[str] = field(default_factory=list)


def _json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def provenance(source: Path) -> dict[str, Any]:
    """{training_run, checkpoint, step, model, objective, recipe_sha256, settings, config, reports, manifest} of the
    checkpoint `source` (RUN/checkpoints/step-N); {"source": ...} alone for a folder of no training run."""
    run = source.parent.parent
    if source.parent.name != "checkpoints" or not (run / RESOLVED_CONFIG).is_file():
        return {"source": str(source)}
    own = source / CHECKPOINT_RUN_CONFIG
    cfg: Config = load_config(own if own.is_file() else run / RESOLVED_CONFIG, saved=True)
    diff = changes(load_config(), cfg)
    settings = [f"{k}={json.dumps(new) if not isinstance(new, str) else new}" for k, (_, new) in diff.items()]
    reports = run / "eval" / source.name
    return {
        "training_run": str(run), "checkpoint": str(source), "step": int(source.name.removeprefix("step-")),
        "model": cfg.model.name, "data": cfg.data.root or cfg.data.format, "objective": method_label(cfg),
        "seed": cfg.train.seed, "recipe_sha256": recipe_digest(cfg), "settings": settings, "config": to_yaml(cfg),
        "eval": _json(reports / "eval_report.json"), "manifest": _json(reports / "eval_manifest.json"),
    }  # fmt: skip


def _eval_results(report: dict[str, Any] | None) -> list[Any]:
    from huggingface_hub import EvalResult  # the card's library: imported by the export only

    out = []
    for suite, metrics in (report or {}).items():
        task = TASKS.get(str(metrics.get("task")), str(metrics.get("task") or "evaluation"))
        for metric, value in headline(suite, metrics).items():
            out.append(EvalResult(task_type=task, dataset_type=suite, dataset_name=suite,
                                  metric_type=metric.removeprefix(f"{suite} "), metric_value=value))  # fmt: skip
    return out


def _body(name: str, record: dict[str, Any], vision_only: bool) -> str:
    holds = "the vision tower alone" if vision_only else "both towers, tokenizer and image processor"
    lines = [f"# {name}", "", f"Exported by `sharpclip export`: a transformers folder ({holds})."]
    if "training_run" not in record:
        return "\n".join([*lines, "", f"Exported from `{record['source']}` (no sharpclip training run).", ""])
    lines += ["", "## Training", "", "| | |", "|---|---|"]
    lines += [f"| {k} | `{record[k]}` |" for k in ("training_run", "checkpoint", "step", "model", "data",
                                                   "objective", "seed", "recipe_sha256")]  # fmt: skip
    lines += ["", "Settings that differ from sharpclip's defaults (`sharpclip config` with these rebuilds the config):",
              "", "```", *record["settings"], "```", "", "<details><summary>The resolved config</summary>", "",
              "```yaml", record["config"].rstrip(), "```", "", "</details>"]  # fmt: skip
    lines += ["", "## Evaluation", ""]
    if not record["eval"]:
        lines.append(f"Not evaluated at this step: `sharpclip eval --model {record['training_run']}` writes it.")
    else:
        lines.append(tables([(f"step {record['step']}", record["eval"])])["eval_table.md"])
        datasets = (record["manifest"] or {}).get("datasets") or {}
        lines += ["Data read by the evaluation (eval_manifest.json):", "", "| suite | file | sha256 |", "|---|---|---|"]
        lines += [f"| {suite} | `{Path(f['path']).name}` | `{f['sha256']}` |" for suite, d in datasets.items()
                  for f in (d.get("files") or []) if isinstance(f, dict) and "sha256" in f]  # fmt: skip
    return "\n".join(lines) + "\n"


def _losses(objective: str) -> list[str]:
    """The loss names of an objective label (`lora: hn_clip γ=0.5 + filip` → hn_clip, filip)."""
    return [t.split()[0] for t in objective.split(": ")[-1].split(" + ") if t]


def model_card(source: Path, name: str, options: CardOptions, vision_only: bool = False) -> tuple[str, dict]:
    """(README.md text, provenance record for sharpclip_export.json) of exporting `source` as folder `name`."""
    from huggingface_hub import ModelCard, ModelCardData

    record = provenance(source)
    data = ModelCardData(
        library_name="transformers",
        pipeline_tag="image-feature-extraction" if vision_only else "zero-shot-image-classification",
        license=options.license or None, base_model=options.base_model or None, datasets=options.datasets or None,
        tags=["sharpclip", "clip", *_losses(record.get("objective", ""))],
        model_name=name, eval_results=_eval_results(record.get("eval")) or None,
    )  # fmt: skip
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n{_body(name, record, vision_only)}")
    kept = {k: v for k, v in record.items() if k not in ("config", "manifest")}
    return str(card), {**kept, **{k: v for k, v in vars(options).items() if v}}
