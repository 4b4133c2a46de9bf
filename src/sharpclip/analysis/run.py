"""Entry points of `sharpclip analyze`: the figures of finished runs, and the captions of evaluation datasets.

analyze_runs([run_dir, ...], out_dir)        Fig. 4 per run with diagnostics; convergence and training curves
analyze_sample_efficiency([run_dir, ...], out_dir)  Fig. 6 / Table A9: R@1 against the training fraction per method
analyze_geometry(model, eval_cfg, out_dir)   Table A1 columns, Fig. 1, Fig. A6, Fig. A5 for eval_cfg.suites; the
                                             margin in logits at γ and the scale (analysis.geometry.margin_report)
analyze_near_duplicates(model, eval_cfg, out_dir)  near-duplicate caption pairs, words that differ marked (Fig.
                                             A1–A4)

Each is one `sharpclip analyze` subcommand (dynamics, sample-efficiency, geometry, near-duplicates; feature-map is
analysis.feature_map); suite `retrieval` reads the config's data section, as `eval` does.

Every file is written by `sharpclip.owned_files`' rule: the outputs' names are checked before the first is written,
and a file there that sharpclip did not write is refused in one line naming it and `--out`.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch

from sharpclip import owned_files
from sharpclip.analysis import dynamics, geometry, near_duplicates, plots, sample_efficiency
from sharpclip.eval.benchmarks import load_eval_set
from sharpclip.eval.evaluator import as_embedder
from sharpclip.eval.retrieval import RetrievalSet


def analyze_runs(run_dirs: list[str | Path], out_dir: str | Path, metric: str = "R@1") -> list[Path]:
    """Every figure the runs have data for; returns the files written. Fig. 4 needs diagnostics.jsonl with records,
    the convergence plot the validation records of metrics.jsonl (`eval/...` keys, written after each validated epoch),
    the training curves its step records."""
    out, written = Path(out_dir), []
    dyns: dict[str, dict[str, Any]] = {}
    curves: dict[str, dict[str, list]] = {}
    training: dict[str, dict[str, list]] = {}
    for run in map(Path, run_dirs):
        diag = run / "diagnostics.jsonl"
        if diag.is_file() and diag.read_text().strip():
            dyns[f"{run.name}_gradient_dynamics"] = dynamics.gradient_dynamics(dynamics.read_diagnostics(diag))
        with contextlib.suppress(FileNotFoundError, ValueError):  # a run that never validated has no curve
            curves[run.name] = dynamics.convergence(run, metric)
        with contextlib.suppress(FileNotFoundError, ValueError):  # a run without training steps has no curve
            training[run.name] = dynamics.training_curve(run)
    if not (dyns or curves or training):
        raise ValueError(f"nothing to analyze in {[str(r) for r in run_dirs]}: no diagnostics.jsonl or metrics.jsonl")
    stems = [*dyns, *["convergence"] * bool(curves), *["training"] * bool(training)]
    planned = [f for stem in stems for f in plots.outputs(out / stem)] + [out / "convergence.md"] * bool(curves)
    owned_files.check(planned, "--out")
    for stem, dyn in dyns.items():
        written += plots.fig_gradient_dynamics(dyn, out / stem)
    if curves:
        written += plots.fig_convergence(curves, out / "convergence")
        written.append(owned_files.write_text(out / "convergence.md", dynamics.comparison_table(curves), "--out"))
    if training:
        written += plots.fig_training_curves(training, out / "training")
    return written


def analyze_sample_efficiency(run_dirs: list[str | Path], out_dir: str | Path, metric: str = "mean_R@1") -> list[Path]:
    """sample_efficiency.png/.json and .md of the runs (analysis.sample_efficiency); returns the files written.
    Runs that are not of one recipe (differing in more than seed, subset size and method) are refused."""
    sample_efficiency.check_one_recipe(run_dirs)
    points = [sample_efficiency.run_point(run, metric) for run in run_dirs]
    summary = sample_efficiency.summarise(points)
    summary["points"] = points
    out = Path(out_dir)
    owned_files.check([*plots.outputs(out / "sample_efficiency"), out / "sample_efficiency.md"], "--out")
    written = [*plots.fig_sample_efficiency(summary, metric, out / "sample_efficiency")]
    table = sample_efficiency.efficiency_table(summary, metric)
    return [*written, owned_files.write_text(out / "sample_efficiency.md", table, "--out")]


def _captions(name: str, cfg: Any, data: Any = None) -> list[str]:
    es = load_eval_set(name, cfg, data)
    if not isinstance(es, RetrievalSet):
        raise ValueError(f"caption geometry needs a retrieval dataset; {name!r} is a {type(es).__name__}")
    return es.captions


def model_scale(model: Any) -> float | None:
    """s = exp(logit_scale) of a DualEncoder; None for an Embedder (no scale of its own)."""
    scale = getattr(model, "logit_scale", None)
    return float(scale.detach().exp()) if isinstance(scale, torch.Tensor) else None


def embedded_captions(model: Any, cfg: Any, data: Any = None) -> dict[str, tuple[list[str], torch.Tensor]]:
    """{suite: (captions, their text embeddings)} of each of `cfg.suites` (an EvalConfig; suite `retrieval` reads
    the `data` section, as `eval` does) under `model`'s text encoder (or an Embedder)."""
    embedder = as_embedder(model, cfg)
    out = {}
    for name in cfg.suites:
        captions = _captions(name, cfg, data)
        out[name] = (captions, embedder.texts(captions))
    return out


def analyze_geometry(
    model: Any,
    cfg: Any,
    out_dir: str | Path,
    batch_size: int = 128,
    seed: int = 0,
    gamma: float = geometry.PAPER_GAMMA,
    scale: float | None = None,
    data: Any = None,
) -> list[Path]:
    """Caption geometry of each of `cfg.suites` (an EvalConfig) under `model`'s text encoder (or an Embedder): the
    statistics (Table A1, Fig. 1, A5, A6) and the margin in logits at `gamma` and `scale` (default: the model's own
    s, else the paper's 100) beside the paper's."""
    out = Path(out_dir)
    owned_files.check(geometry_outputs(out), "--out")  # before anything is embedded or written
    scale = scale or model_scale(model) or geometry.PAPER_SCALE
    stats: dict[str, dict[str, Any]] = {}
    heat: dict[str, torch.Tensor] = {}
    for name, (_, text) in embedded_captions(model, cfg, data).items():
        stats[name] = geometry.caption_geometry(
            text, batch_size=min(batch_size, len(text)), seed=seed, gammas=(gamma,), scale=scale
        )
        pick = torch.randperm(len(text), generator=torch.Generator().manual_seed(seed))[:8]  # Fig. A5: B = 8
        heat[name] = text[pick]
    written = [*plots.fig_caption_similarity(stats, out / "caption_similarity")]
    written += plots.fig_geometry_summary(stats, out / "caption_geometry")
    written += plots.fig_margin_heatmap(heat, out / "margin_heatmap")
    margins = {name: s["margin"] for name, s in stats.items()}
    files = {
        "caption_geometry.md": geometry.geometry_table(stats) + "\n" + geometry.margin_table(margins, stats),
        "caption_geometry_stats.json": json.dumps(stats, indent=2) + "\n",
    }
    return [*written, *(owned_files.write_text(out / f, content, "--out") for f, content in files.items())]


def analyze_near_duplicates(model: Any, cfg: Any, out_dir: str | Path, pairs: int = 20, data: Any = None) -> list[Path]:
    """The `pairs` most similar and `pairs` typical near-duplicate caption pairs of each of `cfg.suites`, the words
    that differ marked (HN-CLIP Fig. A1–A4): near_duplicates.md, .html and .json."""
    out = Path(out_dir)
    owned_files.check([out / f for f in NEAR_DUPLICATE_FILES], "--out")
    sections = {name: near_duplicates.near_duplicate_sections(text, captions, pairs)
                for name, (captions, text) in embedded_captions(model, cfg, data).items()}  # fmt: skip
    files = {
        "near_duplicates.md": near_duplicates.pairs_markdown(sections),
        "near_duplicates.html": near_duplicates.pairs_html(sections),
        "near_duplicates.json": json.dumps(sections, indent=2, ensure_ascii=False) + "\n",
    }
    return [owned_files.write_text(out / f, content, "--out") for f, content in files.items()]


GEOMETRY_FILES = ("caption_geometry.md", "caption_geometry_stats.json")
NEAR_DUPLICATE_FILES = ("near_duplicates.md", "near_duplicates.html", "near_duplicates.json")
GEOMETRY_FIGURES = ("caption_similarity", "caption_geometry", "margin_heatmap")


def geometry_outputs(out: Path) -> list[Path]:
    """Every file `analyze_geometry` writes into `out`."""
    return [*(f for stem in GEOMETRY_FIGURES for f in plots.outputs(out / stem)), *(out / f for f in GEOMETRY_FILES)]
