"""Each figure function writes a non-empty PNG and its numbers as JSON; dynamics summaries from diagnostics.jsonl
and convergence tables from metrics.jsonl, on hand-made records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from _support.tiny_files import write_captions
from sharpclip.analysis.dynamics import comparison_table, convergence, gradient_dynamics, read_diagnostics
from sharpclip.analysis.geometry import caption_geometry
from sharpclip.analysis.plots import (
    fig_caption_similarity,
    fig_convergence,
    fig_geometry_along,
    fig_geometry_summary,
    fig_gradient_dynamics,
    fig_margin_heatmap,
)


def _check_png(png: Path, js: Path) -> dict:
    assert png.stat().st_size > 5_000
    with Image.open(png) as im:
        # Not a blank canvas: a plotted figure has many distinct colours.
        assert len(im.convert("RGB").getcolors(maxcolors=1 << 20)) > 20
    return json.loads(js.read_text())


def _diagnostics(path: Path) -> None:
    rows = []
    for k in range(12):
        epoch = k // 4
        clip = 10.0 ** (-2 - 2 * epoch)  # 1e-2, 1e-4, 1e-6: saturated from epoch 1 on
        zero = epoch == 2 and k % 2 == 0
        rows.append(
            {
                "step": 5 * k,
                "epoch": epoch,
                "loss_infonce": 0.0 if zero else clip,
                "loss_hn": 0.05,
                "grad_norm_infonce": 0.0 if zero else 1e-3,
                "grad_norm_hn": 0.1,
                "grad_cosine": float("nan") if zero else 0.5,  # as train/diagnostics.py writes it
                "grad_zero_infonce": float(zero),
                "gbar_mean": 0.8,
            }
        )
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_gradient_dynamics_summary_and_figure(tmp_path: Path) -> None:
    _diagnostics(tmp_path / "diagnostics.jsonl")
    dyn = gradient_dynamics(read_diagnostics(tmp_path / "diagnostics.jsonl"))
    e0, e2 = dyn["per_epoch"]["0"], dyn["per_epoch"]["2"]
    assert e0["saturated_infonce"] == 0.0 and dyn["per_epoch"]["1"]["saturated_infonce"] == 1.0
    assert e2["zero_grad_infonce"] == 0.5 and e0["saturated_hn"] == 0.0
    assert e0["grad_ratio"]["median"] == pytest.approx(100.0) and e2["cosine_mean"] == pytest.approx(0.5)
    assert dyn["overall"]["zero_grad_infonce"] == pytest.approx(2 / 12)
    numbers = _check_png(*fig_gradient_dynamics(dyn, tmp_path / "fig4"))
    assert numbers["per_epoch"]["1"]["saturated_infonce"] == 1.0


def test_diagnostics_missing_field_is_named(tmp_path: Path) -> None:
    (tmp_path / "diagnostics.jsonl").write_text(json.dumps({"step": 0, "epoch": 0, "loss_infonce": 1.0}) + "\n")
    with pytest.raises(ValueError, match=r"lacks.*loss_hn"):
        read_diagnostics(tmp_path / "diagnostics.jsonl")


def test_convergence_curves_table_and_figure(tmp_path: Path) -> None:
    runs = {}
    for name, base in (("infonce", 60.0), ("hn_clip", 65.0)):
        d = tmp_path / name
        d.mkdir()
        recs = [{"epoch": e, "docci": {"t2i": {"R@1": base + e}, "i2t": {"R@1": base + 2 * e}}} for e in range(3)]
        recs.insert(1, {"step": 10, "loss": 0.5})  # training records without an epoch are ignored
        (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
        runs[name] = convergence(d)
    assert runs["hn_clip"] == {
        "epoch": [0, 1, 2],
        "docci/i2t/R@1": [65.0, 67.0, 69.0],
        "docci/t2i/R@1": [65.0, 66.0, 67.0],
    }
    # The trainer logs its evaluate() numbers flat under "eval/" (e.g. eval/mean_R@1): a metric suffix selects them.
    assert convergence(tmp_path / "infonce", metric="t2i/R@1") == {
        "epoch": [0, 1, 2],
        "docci/t2i/R@1": [60.0, 61.0, 62.0],
    }
    table = comparison_table(runs)
    assert "| hn_clip | docci/t2i/R@1 | 67.00 | 67.00 | 2 |" in table
    numbers = _check_png(*fig_convergence(runs, tmp_path / "conv"))
    assert numbers["infonce"]["docci/t2i/R@1"] == [60.0, 61.0, 62.0]
    with pytest.raises(ValueError, match="no epoch records"):
        convergence(tmp_path / "infonce", metric="t2i/R@99")


def test_geometry_figures_and_heatmap(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    stats = {
        "near_dups": caption_geometry(torch.nn.functional.normalize(torch.randn(60, 8, generator=g) + 3, dim=1)),
        "spread": caption_geometry(torch.nn.functional.normalize(torch.randn(60, 8, generator=g), dim=1)),
    }
    n1 = _check_png(*fig_caption_similarity(stats, tmp_path / "fig1"))
    assert n1["near_dups"]["mean_pairwise"] > n1["spread"]["mean_pairwise"]
    na6 = _check_png(*fig_geometry_summary(stats, tmp_path / "figA6"))
    assert sum(na6["near_dups"]["buckets"].values()) == pytest.approx(1.0)
    batch = torch.nn.functional.normalize(torch.randn(8, 8, generator=g) + 2, dim=1)
    na5 = _check_png(*fig_margin_heatmap({"toy": batch}, tmp_path / "figA5"))
    gbar = torch.tensor(na5["toy"]["G_bar"])
    assert torch.all(gbar.diagonal() == 0) and na5["toy"]["offdiag_max"] == pytest.approx(float(gbar.max()))


def test_cli_analyze_runs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from sharpclip.cli import main

    run = tmp_path / "run_a"
    run.mkdir()
    _diagnostics(run / "diagnostics.jsonl")
    (run / "metrics.jsonl").write_text(json.dumps({"epoch": 0, "docci/t2i/R@1": 50.0}) + "\n")
    assert main(["analyze", str(run), "--out", str(tmp_path / "figs")]) == 0
    names = sorted(p.name for p in (tmp_path / "figs").iterdir())
    assert names == [
        ".sharpclip-files.json",  # sharpclip's record of what it wrote (owned_files)
        "convergence.json",
        "convergence.md",
        "convergence.png",
        "run_a_gradient_dynamics.json",
        "run_a_gradient_dynamics.png",
    ]
    assert main(["analyze", str(tmp_path / "nothing")]) == 2


class _WordEmbedder:
    """Captions -> bag of words over a fixed vocabulary (near-duplicate captions are near in this space)."""

    vocab = ("a", "red", "blue", "green", "square", "circle", "left", "right")

    def images(self, refs):
        raise AssertionError("caption geometry must not embed images")

    def texts(self, captions):
        v = torch.tensor([[float(c.split().count(w)) for w in self.vocab] for c in captions]) + 1e-3
        return torch.nn.functional.normalize(v, dim=1)


def test_analyze_geometry_over_a_dataset(tmp_path: Path) -> None:
    from sharpclip.analysis.run import analyze_geometry
    from sharpclip.config import EvalConfig

    caps = ["a red square left", "a red square right", "a blue circle left", "a green circle right"] * 3
    write_captions(tmp_path / "generic", caps)
    cfg = EvalConfig(suites=["generic"], data_root=str(tmp_path), progress=False)
    written = analyze_geometry(_WordEmbedder(), cfg, tmp_path / "geo", batch_size=4)
    assert {p.name for p in written} >= {
        "caption_similarity.png",
        "caption_geometry.png",
        "margin_heatmap.png",
        "caption_geometry.md",
    }
    stats = json.loads((tmp_path / "geo" / "caption_geometry_stats.json").read_text())["generic"]
    assert stats["mean_hardest"] == pytest.approx(1.0, abs=1e-4)  # every caption appears three times
    for p in written:
        assert p.stat().st_size > 0


def test_analyze_draws_what_a_run_has(tmp_path: Path) -> None:
    """A run with training steps only (no evaluation, an empty diagnostics file) still gets its training curve."""
    from sharpclip.analysis.run import analyze_runs

    run = tmp_path / "run_b"
    run.mkdir()
    steps = [{"step": k, "epoch": 0, "loss": 1.0 / (k + 1), "infonce_monitor": 10.0**-k} for k in range(1, 6)]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in steps) + "\n")
    (run / "diagnostics.jsonl").write_text("")
    written = analyze_runs([run], tmp_path / "figs")
    assert sorted(p.name for p in written) == ["training.json", "training.png"]
    numbers = _check_png(tmp_path / "figs" / "training.png", tmp_path / "figs" / "training.json")
    assert numbers["run_b"]["infonce_monitor"][-1] == pytest.approx(1e-5)


def test_fitted_range_hugs_the_data() -> None:
    from sharpclip.analysis.plots import fitted_range

    low, high = fitted_range([0.95, 0.99, 0.97], pad=0.1)
    assert low == pytest.approx(0.946) and high == pytest.approx(0.994)
    assert fitted_range([0.5, 0.9], pad=0.5, lo=0.0, hi=1.0) == (pytest.approx(0.3), 1.0)
    low, high = fitted_range([1.0, 1.0])  # equal values: a small span around them, not a zero-height axis
    assert low < 1.0 < high


def test_per_micro_batch_diagnostics_count_each_micro_batch() -> None:
    rows = [{"step": 0, "epoch": 0, "loss_infonce": 0.02, "loss_hn": 1.0, "grad_norm_infonce": 1.0, "grad_norm_hn": 2.0,
             "grad_zero_infonce": 0.0, "micro_loss_infonce": [0.0, 1e-4, 0.08, 0.0],
             "micro_grad_zero_infonce": [1.0, 0.0, 0.0, 1.0], "micro_loss_hn": [1.0] * 4}]  # fmt: skip
    e0 = gradient_dynamics(rows)["per_epoch"]["0"]
    assert e0["saturated_infonce"] == 0.75 and e0["zero_grad_infonce"] == 0.5 and e0["saturated_hn"] == 0.0


@pytest.mark.parametrize(("values", "labelled"), [((20.0, 60.0, 180.0), {"20", "50", "100"}), ((1e-4, 10.0), set())])
def test_a_log_axis_within_two_decades_labels_its_twos_and_fives(values, labelled) -> None:
    """One power of ten on the axis is not enough to read it: 20, 50, 200 are labelled too; a wide axis is not."""
    import matplotlib.pyplot as plt

    from sharpclip.analysis.plots import _plain_log

    fig, ax = plt.subplots()
    ax.semilogy(range(len(values)), values, "o")
    _plain_log(ax)
    fig.canvas.draw()
    low, high = ax.get_ylim()
    minor = {t.get_text() for t, v in zip(ax.yaxis.get_minorticklabels(), ax.yaxis.get_minorticklocs(), strict=True)
             if low <= v <= high and t.get_text()}  # fmt: skip
    major = {t.get_text() for t in ax.yaxis.get_majorticklabels() if t.get_text()}
    plt.close(fig)
    assert labelled <= minor | major
    if not labelled:
        assert not minor and "0.001" in major  # wide: the powers of ten alone, plainly written


def test_geometry_along_training_figure(tmp_path: Path) -> None:
    curves = {
        "InfoNCE": {"epoch": [0, 1, 2], "pairwise": [0.38, 0.33, 0.30], "hardest": [0.999, 0.998, 0.997]},
        "HN-CLIP": {"epoch": [0, 1, 2], "pairwise": [0.2, 0.05, 0.004], "hardest": [0.99, 0.97, 0.95]},
    }
    numbers = _check_png(*fig_geometry_along(curves, {"pairwise": 0.376, "hardest": 0.9995}, tmp_path / "along"))
    assert numbers["runs"]["HN-CLIP"]["pairwise"] == [0.2, 0.05, 0.004] and numbers["init"]["pairwise"] == 0.376
    assert _check_png(*fig_geometry_along(curves, None, tmp_path / "no_init"))["init"] is None
