"""What an evaluation produces: the `SuiteResult` of a run of suites, and the files written from it: the JSON
report, the markdown tables and the eval manifest (eval.manifest).

    manifest = suite_manifest(result, model, cfg.eval, name)
    write_report(result, manifest, out_dir, ks)          -> eval_report.json, eval_report.md, eval_manifest.json

The three files sit side by side in `out_dir`; the manifest records what produced the numbers (eval.manifest) and
the sha256 of the other two. A re-write never leaves a mix that looks complete: each file is written whole under a
temporary name, the old manifest is removed first, and the new one is renamed into place last, so a report set is
complete exactly when its manifest is there and names the hashes of the files beside it. The files are written by
`sharpclip.owned_files`' rule: one of those names in `out_dir` that sharpclip did not write is refused in one line
(`check_report_folder`, which `sharpclip eval` calls before it evaluates).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from sharpclip import owned_files
from sharpclip.config import EvalConfig
from sharpclip.eval import pair_data
from sharpclip.eval.manifest import build_manifest, model_record, preprocessing_record
from sharpclip.eval.scoring import load_prompts


@dataclass
class SuiteResult:
    """results: suite name -> metrics; datasets: suite name -> manifest record; embedder: what embedded them."""

    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    datasets: dict[str, dict[str, Any]] = field(default_factory=dict)
    embedder: Any = None


def _fmt(x: Any) -> str:
    return f"{x:.2f}" if isinstance(x, float) else str(x)


def markdown_report(results: dict[str, dict[str, Any]], ks: list[int]) -> str:
    """Retrieval rows (T→I and I→T R@K) in one table, every other suite's headline numbers in a second, then each
    suite's breakdowns (`breakdowns`): one table per group of metrics broken down by the same keys."""
    lines = []
    retrieval = {k: v for k, v in results.items() if v.get("task") == "retrieval"}
    if retrieval:
        cols = [f"T→I R@{k}" for k in ks] + [f"I→T R@{k}" for k in ks]
        lines += ["| suite | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        for name, r in retrieval.items():
            vals = [r["t2i"][f"R@{k}"] for k in ks] + [r["i2t"][f"R@{k}"] for k in ks]
            lines.append(f"| {name} | " + " | ".join(_fmt(v) for v in vals) + " |")
        lines.append("")
    others = {k: v for k, v in results.items() if v.get("task") != "retrieval"}
    if others:
        lines += ["| suite | metric | value |", "|---|---|---|"]
        for name, r in others.items():
            for key, value in r.items():
                if isinstance(value, float):
                    lines.append(f"| {name} | {key} | {_fmt(value)} |")
                elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):  # SPEC's subsets
                    lines.append(f"| {name} | {key} | {', '.join(value)} |")
        lines.append("")
        for name, r in others.items():
            for keys, columns in breakdowns(r):
                lines += [f"{name} in detail:", ""]
                lines += [f"| {name} | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
                lines += [f"| {k} | " + " | ".join(_fmt(r[c].get(k, "")) for c in columns) + " |" for k in keys]
                lines.append("")
    return "\n".join(lines)


def breakdowns(metrics: dict[str, Any]) -> list[tuple[list[str], list[str]]]:
    """(the keys, the metrics broken down by them) for each group of `metrics`' dict-valued entries that share their
    keys, e.g. SPEC's i2t, i2t_items, t2i and t2i_items by subset: one table each, a row per key."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for name, value in metrics.items():
        if isinstance(value, dict) and value:
            groups.setdefault(tuple(value), []).append(name)
    return [(list(keys), names) for keys, names in groups.items()]


REPORT_FILES = ("eval_report.json", "eval_report.md", "eval_manifest.json")


def check_report_folder(out_dir: str | Path, derived: Path | None = None) -> None:
    """Refuse (one line naming the file and --out) a report file in `out_dir` that sharpclip did not write, and, when
    sharpclip chose the folder below `derived` (a run's `eval/<checkpoint>`), a symbolic link among those folders."""
    out = Path(out_dir)
    if derived is not None:
        for folder in [out, *out.parents]:
            if folder == derived or derived not in folder.parents:
                break
            if folder.is_symlink():
                owned_files.folder(folder, "--out", derived=True)  # raises its one line
    owned_files.check([out / name for name in REPORT_FILES], "--out")


def write_report(result: SuiteResult, manifest: dict[str, Any], out_dir: str | Path, ks: list[int]) -> list[Path]:
    """eval_report.json (metrics), eval_report.md (tables) and eval_manifest.json, side by side in `out_dir`."""
    out = Path(out_dir)
    check_report_folder(out)
    paths = [out / name for name in REPORT_FILES]
    texts = [json.dumps(result.results, indent=2) + "\n", markdown_report(result.results, ks)]
    files = {p.name: hashlib.sha256(t.encode()).hexdigest() for p, t in zip(paths, texts, strict=False)}
    texts.append(json.dumps({**manifest, "report_sha256": files}, indent=2, default=str) + "\n")
    owned_files.remove(paths[2], "--out")  # from here until the manifest is written, the set is visibly incomplete
    for path, text in zip(paths, texts, strict=True):
        owned_files.write_text(path, text, "--out")
    return paths


def suite_manifest(result: SuiteResult, model: Any, cfg: EvalConfig, model_name: str = "") -> dict[str, Any]:
    """The eval manifest of a finished suite run (see eval/manifest.py)."""
    emb = result.embedder
    tok = getattr(emb, "tokenizer", None)
    text = {
        "tokenizer": type(getattr(tok, "tokenizer", tok)).__name__ if tok is not None else None,
        "cleaning": getattr(tok, "cleaning", None),
        "context_length": getattr(tok, "context_length", None),
        "captions_embedded": getattr(emb, "num_captions", None),
        "captions_truncated": getattr(emb, "num_truncated", None),
    }
    uses_prompts = any(r.get("task") == "zeroshot" for r in result.results.values())
    prompts = {
        "set": cfg.prompts,
        "templates": list(load_prompts(cfg.prompts)) if uses_prompts else None,
        "mmvp_prefix": pair_data.MMVP_PROMPT,
    }
    is_module = isinstance(model, torch.nn.Module)
    image = preprocessing_record(getattr(emb, "preprocess", None))
    if getattr(emb, "draft_size", None):  # recorded only when used: the pixels are not the full decode's
        image["jpeg_draft"] = f"JPEG decoded at the smallest DCT scale keeping both sides >= {emb.draft_size} px"
    settings = asdict(cfg)
    if getattr(emb, "device", None) is not None:
        settings["device"] = str(emb.device)  # the resolved device, not "auto"
        cuda = emb.device.type == "cuda"
        settings["tf32"] = bool(torch.backends.cuda.matmul.allow_tf32) if cuda else None  # matmul precision used
    if getattr(emb, "num_workers", None) is not None:
        settings["num_workers"] = emb.num_workers  # resolved from "auto"
    settings["precision"] = getattr(emb, "precision", "fp32")  # what the towers ran at (bf16: autocast)
    return build_manifest(
        model=model_record(model, model_name) if is_module else {"name": model_name, "class": type(model).__name__},
        image=image,
        text=text,
        prompts=prompts,
        datasets=result.datasets,
        settings=settings,
    )
