"""Figures a paper can print, checked on the drawn matplotlib objects: bars start at zero and narrow ranges are dot
plots with the range on the axis; no tick or bar label in exponent notation ('1e+02'); every text inside the figure
(the heat map's note inside its axes); histogram bins fitted to the data (a narrow cone of captions still has many
bins); epoch axes from 0 with room for whole markers; the feature map's crop outlined on the full image."""

from __future__ import annotations

import json

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from matplotlib.patches import Rectangle
from matplotlib.text import Text

from sharpclip.analysis import plots
from sharpclip.analysis.dynamics import gradient_dynamics
from sharpclip.analysis.feature_map import FeatureMap, crop_box, plot_feature_maps
from sharpclip.analysis.geometry import caption_geometry


@pytest.fixture
def figures(monkeypatch):
    """The figures the plot functions made, kept open (plt.close is held back) so their artists can be read."""
    kept: list = []
    close = plt.close
    monkeypatch.setattr(plots.plt, "close", lambda fig=None: kept.append(fig))
    yield kept
    for fig in kept:
        if fig is not None:
            close(fig)


def _cone(n: int, spread: float, seed: int) -> torch.Tensor:
    """n captions in a narrow cone: every pairwise cosine between about 0.99 and 1.0 when spread is small."""
    g = torch.Generator().manual_seed(seed)
    base = torch.nn.functional.normalize(torch.randn(1, 32, generator=g), dim=1)
    return torch.nn.functional.normalize(base + spread * torch.randn(n, 32, generator=g), dim=1)


def _stats() -> dict:
    return {"demo": caption_geometry(_cone(60, 0.02, 0), scale=100.0, gammas=(0.5,)),
            "mine": caption_geometry(_cone(60, 0.03, 1), scale=100.0, gammas=(0.5,))}  # fmt: skip


def _texts(fig) -> list[Text]:
    fig.canvas.draw()
    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]


def _inside(inner, outer, slack: float = 1.0) -> bool:
    return (inner.x0 >= outer.x0 - slack and inner.y0 >= outer.y0 - slack and inner.x1 <= outer.x1 + slack
            and inner.y1 <= outer.y1 + slack)  # fmt: skip


def _tick_labels(fig) -> set[int]:
    return {id(t) for ax in fig.axes for axis in (ax.xaxis, ax.yaxis) for minor in (False, True)
            for t in axis.get_ticklabels(minor=minor)}  # fmt: skip


def _check_printable(fig) -> None:
    """No exponent in any label; every title, note, legend and axis label inside the figure as saved (the tight
    bounding box savefig keeps: nothing cut; tick labels are matplotlib's own layout)."""
    texts = _texts(fig)
    renderer = fig.canvas.get_renderer()
    assert not [t.get_text() for t in texts if "e+" in t.get_text()]
    saved = fig.get_tightbbox(renderer).transformed(fig.dpi_scale_trans)  # what bbox_inches="tight" keeps, in px
    ticks = _tick_labels(fig)
    for t in texts:
        if id(t) not in ticks:
            assert _inside(t.get_window_extent(renderer), saved, slack=2.0), t.get_text()


def test_geometry_summary_draws_narrow_means_as_dots_and_zero_based_bars(tmp_path, figures) -> None:
    plots.fig_geometry_summary(_stats(), tmp_path / "geometry")
    fig = figures[-1]
    a, b, c = fig.axes[:3]
    for ax in (a, b):  # the means differ in the third decimal: dots on an axis fitted to them, its range said
        assert not [p for p in ax.patches if isinstance(p, Rectangle)]
        assert "not from 0" in ax.get_xlabel() and ax.get_xlim()[0] > 0.9
    assert c.patches and c.get_ylim()[0] == 0  # the shares of hard negatives: bars from zero
    _check_printable(fig)


def test_hard_negative_shares_of_100_percent_are_not_written_1e02(tmp_path, figures) -> None:
    stats = {"same": caption_geometry(_cone(20, 0.0001, 2))}  # every negative above 0.9: 100 %
    plots.fig_geometry_summary(stats, tmp_path / "geometry")
    labels = [t.get_text() for t in _texts(figures[-1])]
    assert "100" in labels and not [t for t in labels if "e+" in t]


def test_histograms_of_a_narrow_cone_have_bins_fitted_to_it(tmp_path, figures) -> None:
    stats = _stats()
    for s in stats.values():
        for key in ("pairwise", "hardest"):
            edges, counts = np.asarray(s[f"hist_bins_{key}"]), np.asarray(s[f"hist_{key}"])
            assert len(counts) >= 10 and edges[-1] - edges[0] < 0.05  # the old fixed bins: one or two 0.01 bins
            assert (counts > 0).sum() >= 4 and counts.sum() == (60 * 59 if key == "pairwise" else 60)
    plots.fig_caption_similarity(stats, tmp_path / "similarity")
    fig = figures[-1]
    for ax in fig.axes[:2]:
        assert ax.get_xlim()[0] > 0.9 and ax.get_ylim()[0] == 0
    _check_printable(fig)


def test_margin_heatmap_note_stays_inside_its_axes(tmp_path, figures) -> None:
    text = _cone(8, 0.02, 3)
    text[7] = text[0]  # the maximum off the diagonal sits in the last column, at the right edge
    plots.fig_margin_heatmap({"demo": text}, tmp_path / "heat")
    fig = figures[-1]
    renderer = (fig.canvas.draw(), fig.canvas.get_renderer())[1]
    note = next(t for t in _texts(fig) if t.get_text().startswith("max"))
    assert _inside(note.get_window_extent(renderer), fig.axes[0].get_window_extent(renderer))
    _check_printable(fig)


def _epoch_axis_ok(ax, last: int) -> None:
    low, high = ax.get_xlim()
    assert -0.6 <= low < 0 and high > last + 0.3  # room for whole markers at the first and last epoch
    ticks = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    assert ticks[0] == "0" and all(t.isdigit() for t in ticks)


def test_epoch_axes_start_at_zero_with_whole_markers(tmp_path, figures) -> None:
    plots.fig_convergence({"hn": {"epoch": [0, 1], "docci/t2i/R@1": [40.0, 45.0]}}, tmp_path / "conv")
    _epoch_axis_ok(figures[-1].axes[0], 1)
    _check_printable(figures[-1])
    rows = [{"step": k, "epoch": k // 2, "loss_infonce": 0.1, "loss_hn": 0.2, "grad_norm_infonce": 1.0,
             "grad_norm_hn": 2.0, "grad_cosine": 0.3} for k in range(6)]  # fmt: skip
    plots.fig_gradient_dynamics(gradient_dynamics(rows), tmp_path / "dyn")
    fig = figures[-1]
    _epoch_axis_ok(fig.axes[1], 2)  # (a') share saturated per epoch
    _epoch_axis_ok(fig.axes[3], 2)  # (b') the ratio per epoch
    _check_printable(fig)
    along = {"hn": {"epoch": [0, 1, 2], "pairwise": [0.8, 0.7, 0.6], "hardest": [0.95, 0.9, 0.85]}}
    plots.fig_geometry_along(along, {"pairwise": 0.8, "hardest": 0.95}, tmp_path / "along")
    _epoch_axis_ok(figures[-1].axes[0], 2)


def test_feature_map_outlines_the_crop_the_model_saw(tmp_path, figures, monkeypatch) -> None:
    # a 96 × 72 image, shorter side to 32 (42 × 32), the centre 32 × 32 kept: x 5 … 37 of 42, i.e. 11.43 … 84.57
    assert crop_box((96, 72), (42, 32), (32, 32)) == pytest.approx((5 * 96 / 42, 0.0, 32 * 96 / 42, 72.0))
    assert crop_box((50, 50), (32, 32), (32, 32)) == (0.0, 0.0, 50.0, 50.0)  # square: the whole image
    from PIL import Image

    monkeypatch.setattr("sharpclip.analysis.feature_map.plt.close", lambda fig=None: figures.append(fig))
    image = Image.new("RGB", (96, 72), (200, 40, 40))
    fm = FeatureMap(
        "hn", np.zeros((32, 32, 3), dtype=np.uint8), torch.rand(4, 4), crop_box((96, 72), (42, 32), (32, 32))
    )
    plot_feature_maps(image, [fm], "a red square", tmp_path)
    fig = figures[-1]
    (outline,) = [p for p in fig.axes[0].patches if isinstance(p, Rectangle)]
    assert (outline.get_width(), outline.get_height()) == pytest.approx((32 * 96 / 42, 72.0))
    assert "crop the model saw" in fig.axes[0].get_title()
    _check_printable(fig)
    numbers = json.loads(json.dumps({"crop_xywh": [round(v, 2) for v in fm.crop]}))
    assert numbers["crop_xywh"][2] == pytest.approx(73.14, abs=0.01)
