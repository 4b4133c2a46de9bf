"""One function per figure. Each writes `<out>.png` and the plotted numbers as `<out>.json`, and returns both paths.

| function                 | figure (HN-CLIP)  | input                                                     |
|--------------------------|-------------------|-----------------------------------------------------------|
| fig_caption_similarity   | Fig. 1            | {dataset: geometry.caption_geometry(...)}                 |
| fig_geometry_summary     | Fig. A6, Table A1 | same                                                      |
| fig_margin_heatmap       | Fig. A5           | {dataset: one batch of caption embeddings (B, D)}         |
| fig_gradient_dynamics    | Fig. 4            | dynamics.gradient_dynamics(records)                       |
| fig_convergence          | Fig. 5 / A9       | {run: dynamics.convergence(run_dir)}                      |
| fig_geometry_along       | -                 | {run: {"epoch", "pairwise", "hardest"}}, the init's values  |
| fig_training_curves      | -                 | {run: dynamics.training_curve(run_dir)}                   |
| fig_sample_efficiency    | Fig. 6            | sample_efficiency.summarise(points)                       |

matplotlib runs on the Agg backend (no display needed). Both files are written by `sharpclip.owned_files`' rule:
an existing `<out>.png` or `<out>.json` is replaced only when sharpclip wrote it (else one line naming it and `--out`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.patches import Rectangle
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

from sharpclip import owned_files
from sharpclip.analysis.geometry import hardness_buckets
from sharpclip.losses import margin_matrix
from sharpclip.losses.monitors import INFONCE_MONITOR

LOG_FLOOR = 1e-10  # zeros on log axes are drawn here (the paper clamps the same way)


def outputs(out: str | Path) -> list[Path]:
    """The files a figure function writes for `out`: `<out>.png` and `<out>.json` (a `.png` or `.json` ending of
    `out` is dropped first; any other dot is part of the name, as in a run folder `lr1e-4.seed0`)."""
    out = Path(out)
    stem = out.with_suffix("") if out.suffix in (".png", ".json") else out
    return [stem.with_name(stem.name + ".png"), stem.with_name(stem.name + ".json")]


def _save(fig: Any, numbers: dict[str, Any], out: str | Path, flag: str = "--out") -> tuple[Path, Path]:
    png, js = outputs(out)
    try:
        owned_files.check([png, js], flag)
        if fig.get_layout_engine() is None:
            fig.tight_layout()
        with owned_files.writing(png, flag) as tmp:
            fig.savefig(tmp, dpi=120, bbox_inches="tight")  # "tight": legends outside the axes stay in the picture
    finally:
        plt.close(fig)
    owned_files.write_text(js, json.dumps(numbers, indent=2, default=float) + "\n", flag)
    return png, js


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p")  # one per series: equal curves stay visible
LINESTYLES = ("-", "--", "-.", ":")


def _style(k: int) -> dict[str, Any]:
    """Marker and line style of the k-th series: markers always drawn (a one-point series is visible), hollow and a
    little smaller for each later series, so identical curves show as nested markers instead of hiding each other."""
    return {
        "marker": MARKERS[k % len(MARKERS)], "ls": LINESTYLES[k % len(LINESTYLES)], "ms": max(3.0, 9.0 - 1.2 * k),
        "mfc": "none", "mew": 1.2,
    }  # fmt: skip


def _hatch(k: int) -> dict[str, Any]:
    """Bar style k: a colour and a hatch, so side-by-side series differ without colour too."""
    return {"color": f"C{k}", "hatch": ("", "//", "..", "xx")[k % 4], "edgecolor": "white"}


def _legend_outside(ax: Any, fontsize: int = 7) -> None:
    """The legend to the right of the axes, never over the data."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=fontsize, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, frameon=False)


def _plain_log(ax: Any, axis: str = "y") -> None:
    """Log axis with plain labels (1e-05, 0.001, 1, 100) instead of mathtext powers; an axis spanning less than two
    decades (one labelled power of ten or none) also labels its 2s and 5s (20, 50, 200). Call after plotting."""
    target = ax.yaxis if axis == "y" else ax.xaxis
    target.set_major_locator(LogLocator(base=10.0, numticks=8))
    target.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    low, high = ax.get_ylim() if axis == "y" else ax.get_xlim()
    if low > 0 and high / low < 100:
        target.set_minor_locator(LogLocator(base=10.0, subs=(2.0, 5.0), numticks=8))
        target.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    else:
        target.set_minor_formatter(NullFormatter())


def _integer_ticks(ax: Any, epochs: Any = None) -> None:
    """An epoch axis: whole-number ticks from 0 (none below it), and room of EPOCH_ROOM epoch either side of the
    first and last epoch (`epochs`, else the plotted x data), so no marker is cut at the axis's edge."""
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    if epochs is None:
        epochs = [x for line in ax.get_lines() for x in np.asarray(line.get_xdata(), dtype=np.float64).ravel()]
    finite = [float(e) for e in epochs if np.isfinite(e)]
    first, last = min([0.0, *finite]), max([0.0, *finite])
    ax.set_xlim(first - EPOCH_ROOM, last + EPOCH_ROOM)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.0f}" if v >= 0 else ""))


EPOCH_ROOM = 0.5  # epochs of room beyond the first and last on an epoch axis


def fitted_range(values: Any, pad: float = 0.08, lo: float = -np.inf, hi: float = np.inf) -> tuple[float, float]:
    """(low, high) around the finite `values`, padded by `pad` of their span (a minimum span for equal values),
    clipped to [lo, hi]: an axis fitted to the data rather than to the quantity's whole range."""
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if not len(v):
        return (0.0, 1.0)
    a, b = float(v.min()), float(v.max())
    span = b - a if b > a else 0.05 * max(1.0, abs(b))  # equal values: a readable span around them
    return max(lo, a - pad * span), min(hi, b + pad * span)


def fig_caption_similarity(stats: dict[str, dict[str, Any]], out: str | Path) -> tuple[Path, Path]:
    """Fig. 1: distributions of (a) all pairwise caption similarities, (b) each caption's hardest companion, each on
    the bins geometry.fitted_histogram fitted to its data, drawn as densities (comparable across bin widths), the
    x-axis the range the data occupies."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, key, mean in ((axes[0], "pairwise", "mean_pairwise"), (axes[1], "hardest", "mean_hardest")):
        spans = []
        for k, (name, s) in enumerate(stats.items()):
            edges, counts = np.asarray(s[f"hist_bins_{key}"]), np.asarray(s[f"hist_{key}"], dtype=np.float64)
            density = counts / max(counts.sum(), 1) / np.diff(edges)
            ax.stairs(density, edges, label=name, color=f"C{k}", lw=1.4, ls=LINESTYLES[k % len(LINESTYLES)])
            ax.axvline(s[mean], ls=":", color=f"C{k}")
            spans += [edges[0], edges[-1], s[mean]]
        if spans:
            ax.set_xlim(*fitted_range(spans, pad=0.03, lo=-1.0, hi=1.0))
        ax.set_ylim(bottom=0)
        ax.xaxis.set_major_locator(MaxNLocator(5))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _plain(v, 4)))
    axes[0].set(title="(a) pairwise caption similarity", xlabel="cosine", ylabel="density")
    axes[1].set(title="(b) hardest companion (dotted: means)", xlabel="cosine")
    _legend_outside(axes[1])
    keys = ("mean_pairwise", "mean_hardest", "hist_bins_pairwise", "hist_pairwise", "hist_bins_hardest", "hist_hardest")
    return _save(fig, {n: {k: s[k] for k in keys} for n, s in stats.items()}, out)


def _plain(value: float, digits: int = 3) -> str:
    """`value` without an exponent (100, 0.0123, 0.99961): at most `digits` significant digits, trailing zeros
    dropped."""
    return np.format_float_positional(float(value), precision=digits, unique=False, fractional=False, trim="-")


def _value_dots(ax: Any, names: list[str], values: list[float], title: str) -> None:
    """A dot per dataset on a value axis fitted to the values, the axis's range written in its label: a narrow range
    (0.9962 vs 0.9990) drawn as bars from a non-zero base would look like a factor of 3."""
    y = np.arange(len(names))[::-1]
    ax.plot(values, y, "o", ms=7, color="C0")
    spread = max(values) - min(values) if values else 0.0
    digits = 3 if spread <= 0 else min(6, max(3, 1 - math.floor(math.log10(spread))))  # enough to tell them apart
    for v, row in zip(values, y, strict=True):
        ax.annotate(f"{v:.{digits}f}", (v, row), xytext=(0, 7), textcoords="offset points", ha="center", fontsize=7)
    low, high = fitted_range(values, pad=0.35, lo=-1.0, hi=1.0)
    ax.set_xlim(low, high)
    ax.set_ylim(-0.7, len(names) - 0.3)
    ax.set_yticks(y, names, fontsize=7)
    ax.xaxis.set_major_locator(MaxNLocator(4))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.{digits}f}"))
    ax.grid(axis="y", color="0.9", lw=0.8)
    ax.set(title=title, xlabel=f"cosine (axis {low:.{digits}f} … {high:.{digits}f}, not from 0)")


def fig_geometry_summary(stats: dict[str, dict[str, Any]], out: str | Path) -> tuple[Path, Path]:
    """Fig. A6: (A) mean pairwise similarity, (B) mean hardest companion, (C) negatives by hardness bucket."""
    names = list(stats)
    buckets = {n: hardness_buckets(s) for n, s in stats.items()}
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    _value_dots(axes[0], names, [stats[n]["mean_pairwise"] for n in names], "(A) mean pairwise similarity")
    _value_dots(axes[1], names, [stats[n]["mean_hardest"] for n in names], "(B) mean hardest companion")
    # the hard buckets only, side by side in %, on an axis fitted to them: the easy rest (< 0.8) is nearly all of
    # every batch and, stacked, would hide them against a bar at ~1
    hard = [label for label in next(iter(buckets.values())) if not label.startswith("<")]
    width = 0.8 / max(1, len(hard))
    x = np.arange(len(names))
    tops = []
    for k, label in enumerate(hard):
        share = 100.0 * np.asarray([buckets[n][label] for n in names])
        bars = axes[2].bar(x + (k - (len(hard) - 1) / 2) * width, share, width, label=f"cosine {label}", **_hatch(k))
        axes[2].bar_label(bars, labels=[_plain(v, 2) for v in share], fontsize=6, padding=1)
        tops += list(share)
    axes[2].set_xticks(x, names)
    axes[2].set(title="(C) hard in-batch negatives", ylabel="% of negatives", ylim=(0, 1.2 * max(tops, default=1) or 1))
    axes[2].yaxis.set_major_formatter(FuncFormatter(lambda v, _: _plain(v, 3)))
    axes[2].tick_params(axis="x", labelrotation=45, labelsize=7)
    _legend_outside(axes[2])
    numbers = {
        n: {
            "mean_pairwise": stats[n]["mean_pairwise"],
            "mean_hardest": stats[n]["mean_hardest"],
            "buckets": buckets[n],
            "scope": stats[n]["negatives_scope"],
        }
        for n in names
    }
    return _save(fig, numbers, out)


def fig_margin_heatmap(batches: dict[str, torch.Tensor], out: str | Path) -> tuple[Path, Path]:
    """Fig. A5: Ḡ (detached T Tᵀ, zero diagonal) of one batch per dataset, max off-diagonal entry annotated."""
    fig, axes = plt.subplots(1, len(batches), figsize=(3.6 * len(batches), 3.4), squeeze=False, layout="constrained")
    numbers = {}
    for ax, (name, text) in zip(axes[0], batches.items(), strict=True):
        g = margin_matrix(torch.nn.functional.normalize(text.float(), dim=-1))
        b = g.shape[0]
        off = g[~torch.eye(b, dtype=torch.bool)]
        i, j = divmod(int(torch.where(torch.eye(b, dtype=torch.bool), -2.0, g).argmax()), b)
        im = ax.imshow(g.numpy(), vmin=0.0, vmax=1.0, cmap="viridis")
        ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="white", linewidth=1.5))
        ax.text(0.03, 0.03, f"max {g[i, j]:.2f} (outlined)", transform=ax.transAxes, color="white", fontsize=7,
                ha="left", va="bottom", bbox={"facecolor": "black", "alpha": 0.5, "pad": 1.5, "lw": 0})  # fmt: skip
        ax.set(title=f"{name}: off-diag mean {off.mean():.2f}", xticks=[], yticks=[])
        numbers[name] = {"G_bar": g.tolist(), "offdiag_mean": float(off.mean()), "offdiag_max": float(g[i, j])}
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8)
    return _save(fig, numbers, out)


def _floor(values: list[Any]) -> np.ndarray:
    return np.maximum(np.asarray([np.nan if v is None else v for v in values], dtype=np.float64), LOG_FLOOR)


def fig_gradient_dynamics(dyn: dict[str, Any], out: str | Path) -> tuple[Path, Path]:
    """Fig. 4: losses, saturated share per epoch, gradient norms, their ratio per epoch (median, IQR), cosine."""
    s, per = dyn["series"], dyn["per_epoch"]
    epochs = [int(e) for e in per]
    fig, ax = plt.subplots(2, 3, figsize=(15, 6.8))
    threshold = dyn["saturation_threshold"]
    ax[0, 0].semilogy(s["step"], _floor(s["loss_infonce"]), label="L_CLIP", **_style(0))
    ax[0, 0].semilogy(s["step"], _floor(s["loss_hn"]), label="L_HN", **_style(1))
    ax[0, 0].axhline(threshold, ls=":", color="gray", label=f"{threshold:g}")
    ax[0, 0].set(title="(a) loss per measured batch", xlabel="step")
    _plain_log(ax[0, 0])
    _legend_outside(ax[0, 0])
    width = 0.4
    ax[0, 1].bar(
        np.asarray(epochs) - width / 2, [per[str(e)]["saturated_infonce"] for e in epochs], width, label="L_CLIP"
    )
    ax[0, 1].bar(np.asarray(epochs) + width / 2, [per[str(e)]["saturated_hn"] for e in epochs], width, label="L_HN")
    ax[0, 1].plot(epochs, [per[str(e)]["zero_grad_infonce"] for e in epochs], "kD--", ms=5, label="∇L_CLIP = 0")
    ax[0, 1].set(title=f"(a') share saturated (loss < {threshold:g})", xlabel="epoch", ylim=(0, 1.05))
    _integer_ticks(ax[0, 1], epochs)
    _legend_outside(ax[0, 1])
    ax[0, 2].semilogy(s["step"], _floor(s["grad_norm_infonce"]), label="‖∇L_CLIP‖", **_style(0))
    ax[0, 2].semilogy(s["step"], _floor(s["grad_norm_hn"]), label="‖∇L_HN‖", **_style(1))
    ax[0, 2].set(title="(b) gradient norms", xlabel="step")
    _plain_log(ax[0, 2])
    _legend_outside(ax[0, 2])
    ratio = [per[str(e)]["grad_ratio"] for e in epochs]
    med = _floor([r["median"] for r in ratio])
    lo, hi = _floor([r["q25"] for r in ratio]), _floor([r["q75"] for r in ratio])
    ax[1, 0].semilogy(epochs, med, "o-", ms=5)
    ax[1, 0].fill_between(epochs, lo, hi, alpha=0.3)
    ax[1, 0].set(title="(b') ‖∇L_HN‖ / ‖∇L_CLIP‖ (median, IQR; ∇L_CLIP ≠ 0)", xlabel="epoch")
    _plain_log(ax[1, 0])
    _integer_ticks(ax[1, 0], epochs)
    cos = np.asarray([np.nan if c is None else c for c in s["grad_cosine"]], dtype=np.float64)
    ax[1, 1].plot(s["step"], cos, "o", ms=3)
    ax[1, 1].axhline(0.0, color="gray", lw=0.5)
    mean = dyn["overall"]["cosine_mean"]
    ax[1, 1].set(
        title=f"(c) cos(∇L_CLIP, ∇L_HN), mean {mean if mean is not None else float('nan'):.2f}",
        xlabel="step",
        ylim=fitted_range(np.append(cos, 0.0), pad=0.15, lo=-1.0, hi=1.0),
    )
    ax[1, 2].axis("off")
    o = dyn["overall"]
    ax[1, 2].text(
        0,
        0.5,
        f"measurements {o['measurements']}\nsaturated L_CLIP {o['saturated_infonce']:.0%}\n"
        f"saturated L_HN {o['saturated_hn']:.0%}\n∇L_CLIP exactly 0: {o['zero_grad_infonce']:.0%}",
        va="center",
    )
    return _save(fig, dyn, out)


def fig_convergence(curves: dict[str, dict[str, list]], out: str | Path) -> tuple[Path, Path]:
    """R@1 (or any metric) per epoch, one line per run and metric key, on one plot."""
    fig, ax = plt.subplots(figsize=(8.5, 4.2))
    k = 0
    values_all: list[float] = []
    for run, c in curves.items():
        for key, values in c.items():
            if key != "epoch":
                ys = [np.nan if v is None else v for v in values]
                values_all += ys
                ax.plot(c["epoch"], ys, label=f"{run}: {key}", **_style(k))
                k += 1
    ax.set(xlabel="epoch", ylabel="R@1 (%)", title="convergence", ylim=fitted_range(values_all, pad=0.1))
    ax.ticklabel_format(axis="y", useOffset=False)
    _integer_ticks(ax)
    _legend_outside(ax)
    return _save(fig, curves, out)


def fig_sample_efficiency(summary: dict[str, Any], metric: str, out: str | Path) -> tuple[Path, Path]:
    """The metric against the training fraction (log axis, ticks at the fractions run), one line per method with
    its runs' min–max as error bars; the best full-data run dotted across (HN-CLIP Fig. 6)."""
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    values: list[float] = []
    fractions = sorted({100 * r["fraction"] for rows in summary["methods"].values() for r in rows})
    for k, (method, rows) in enumerate(summary["methods"].items()):
        x = [100 * r["fraction"] for r in rows]
        y = [r["mean"] for r in rows]
        spread = [[r["mean"] - r["min"] for r in rows], [r["max"] - r["mean"] for r in rows]]
        ax.errorbar(x, y, yerr=spread, label=method, capsize=3, **_style(k))
        values += [r["min"] for r in rows] + [r["max"] for r in rows]
    ref = summary["reference"]
    if ref is not None:
        ax.axhline(ref["value"], color="0.3", ls=":", lw=1.2, label=f"full-data best ({ref['method']})")
        values.append(ref["value"])
    ax.set_xscale("log")
    ax.set_xticks(fractions, [f"{f:g} %" for f in fractions])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set(xlabel="training data", ylabel=f"{metric} (%)", title="sample efficiency (identical, nested subsets)",
           ylim=fitted_range(values, pad=0.1))  # fmt: skip
    _legend_outside(ax)
    return _save(fig, summary, out)


def fig_geometry_along(
    curves: dict[str, dict[str, list]], start: dict[str, float] | None, out: str | Path
) -> tuple[Path, Path]:
    """The captions' mean pairwise and mean hardest-companion cosine at every validation, one line per run; the
    init's values (`start`: {"pairwise", "hardest"}) dashed. curves: {run: {"epoch": [...], "pairwise": [...],
    "hardest": [...]}} (the convergence figure's epochs)."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, key, title in ((axes[0], "pairwise", "(a) mean pairwise caption cosine"),
                           (axes[1], "hardest", "(b) mean hardest-companion cosine")):  # fmt: skip
        values = [v for c in curves.values() for v in c[key]]
        for k, (run, c) in enumerate(curves.items()):
            ax.plot(c["epoch"], c[key], label=run, **_style(k))
        if start is not None:
            ax.axhline(start[key], ls="--", color="0.4", lw=1, label="init")
            values.append(start[key])
        ax.set(title=title, xlabel="epoch", ylabel="cosine", ylim=fitted_range(values, pad=0.1, lo=-1.0, hi=1.0))
        ax.ticklabel_format(axis="y", useOffset=False)
        _integer_ticks(ax)
    _legend_outside(axes[1])
    return _save(fig, {"runs": curves, "init": start}, out)


def fig_training_curves(curves: dict[str, dict[str, list]], out: str | Path) -> tuple[Path, Path]:
    """Training loss and the InfoNCE monitor per step, one line per run (what any metrics.jsonl holds)."""
    fig, ax = plt.subplots(figsize=(8.5, 4.2))
    k = 0
    for run, c in curves.items():
        for key in ("loss", INFONCE_MONITOR):
            if any(v is not None for v in c.get(key, [])):
                ax.semilogy(c["step"], _floor(c[key]), label=f"{run}: {key}", **{**_style(k), "ms": 3})
                k += 1
    ax.axhline(1e-3, ls=":", color="gray", label="1e-3 (saturated)")
    ax.set(xlabel="step", ylabel="loss", title="training loss")
    _plain_log(ax)
    _legend_outside(ax)
    return _save(fig, curves, out)


def fig_wise_ft(curve: dict[str, Any], out: str | Path) -> tuple[Path, Path]:
    """WiSE-FT trade-off: the target metric against α, and each guard's change from the initial model against α.

    curve: analysis.wise_ft.sweep's output ({"target", "guards", "points": [{alpha, target, deltas}], "best_alpha"}).
    """
    points = curve["points"]
    alphas = [p["alpha"] for p in points]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    axes[0].plot(alphas, [p["target"] for p in points], marker="o", color="C0")
    if curve["best_alpha"] is not None:
        axes[0].axvline(curve["best_alpha"], ls=":", color="0.4", label=f"picked α = {curve['best_alpha']:g}")
        axes[0].legend(loc="best", frameon=False)
    axes[0].set(title=f"target: {curve['target']}", xlabel="α (0 = initialisation, 1 = fine-tuned)", ylabel="value")
    markers = "sD^vP*X"
    for i, guard in enumerate(curve["guards"]):
        (line,) = axes[1].plot(
            alphas, [p["deltas"][guard["metric"]] for p in points], marker=markers[i % 7], label=guard["metric"]
        )
        if guard["max_drop"] is not None:
            axes[1].axhline(-guard["max_drop"], ls="--", color=line.get_color(), lw=1)
    axes[1].axhline(0.0, color="0.7", lw=0.8)
    axes[1].set(title="guards: Δ from the initialisation (dashed: floor)", xlabel="α", ylabel="Δ points")
    if curve["guards"]:
        axes[1].legend(loc="best", frameon=False, fontsize=8)
    for ax in axes:
        ax.set_xticks(alphas if len(alphas) <= 11 else ax.get_xticks())
    return _save(fig, curve, out)
