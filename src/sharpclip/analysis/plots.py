"""One function per figure. Each writes `<out>.png` and the plotted numbers as `<out>.json`, and returns both paths.

| function                 | figure (HN-CLIP)  | input                                                     |
|--------------------------|-------------------|-----------------------------------------------------------|
| fig_caption_similarity   | Fig. 1            | {dataset: geometry.caption_geometry(...)}                 |
| fig_geometry_summary     | Fig. A6, Table A1 | same                                                      |
| fig_margin_heatmap       | Fig. A5           | {dataset: one batch of caption embeddings (B, D)}         |
| fig_gradient_dynamics    | Fig. 4            | dynamics.gradient_dynamics(records)                       |
| fig_convergence          | Fig. 5 / A9       | {run: dynamics.convergence(run_dir)}                      |

matplotlib runs on the Agg backend (no display needed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch

from sharpclip.analysis.geometry import hardness_buckets
from sharpclip.losses import margin_matrix

LOG_FLOOR = 1e-10  # zeros on log axes are drawn here (the paper clamps the same way)


def _save(fig: Any, numbers: dict[str, Any], out: str | Path) -> tuple[Path, Path]:
    out = Path(out).with_suffix("")
    out.parent.mkdir(parents=True, exist_ok=True)
    png, js = out.with_suffix(".png"), out.with_suffix(".json")
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    js.write_text(json.dumps(numbers, indent=2, default=float) + "\n")
    return png, js


def fig_caption_similarity(stats: dict[str, dict[str, Any]], out: str | Path) -> tuple[Path, Path]:
    """Fig. 1: distributions of (a) all pairwise caption similarities, (b) each caption's hardest companion."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, s in stats.items():
        edges = np.asarray(s["hist_bins"])
        centres = (edges[:-1] + edges[1:]) / 2
        for ax, key, mean in ((axes[0], "hist_pairwise", "mean_pairwise"), (axes[1], "hist_hardest", "mean_hardest")):
            counts = np.asarray(s[key], dtype=np.float64)
            (line,) = ax.plot(centres, counts / max(counts.sum(), 1), label=name)
            ax.axvline(s[mean], ls=":", color=line.get_color())
    axes[0].set(title="(a) pairwise caption similarity", xlabel="cosine", ylabel="share")
    axes[1].set(title="(b) hardest companion", xlabel="cosine")
    axes[0].legend()
    numbers = {
        n: {k: s[k] for k in ("mean_pairwise", "mean_hardest", "hist_bins", "hist_pairwise", "hist_hardest")}
        for n, s in stats.items()
    }
    return _save(fig, numbers, out)


def fig_geometry_summary(stats: dict[str, dict[str, Any]], out: str | Path) -> tuple[Path, Path]:
    """Fig. A6: (A) mean pairwise similarity, (B) mean hardest companion, (C) negatives by hardness bucket."""
    names = list(stats)
    buckets = {n: hardness_buckets(s) for n, s in stats.items()}
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    axes[0].bar(names, [stats[n]["mean_pairwise"] for n in names])
    axes[1].bar(names, [stats[n]["mean_hardest"] for n in names])
    bottom = np.zeros(len(names))
    for label in next(iter(buckets.values())):
        share = np.asarray([buckets[n][label] for n in names])
        axes[2].bar(names, share, bottom=bottom, label=label)
        bottom += share
    axes[0].set(title="(A) mean pairwise similarity", ylim=(0, 1))
    axes[1].set(title="(B) mean hardest companion", ylim=(0, 1))
    axes[2].set(title="(C) in-batch negatives by hardness", ylim=(0, 1))
    axes[2].legend(fontsize=7)
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
        ax.annotate(f"max {g[i, j]:.2f}", (j, i), color="white", ha="center", va="center", fontsize=7)
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
    fig, ax = plt.subplots(2, 3, figsize=(13, 6.4))
    ax[0, 0].semilogy(s["step"], _floor(s["loss_infonce"]), label="L_CLIP")
    ax[0, 0].semilogy(s["step"], _floor(s["loss_hn"]), label="L_HN")
    ax[0, 0].axhline(dyn["saturation_threshold"], ls=":", color="gray")
    ax[0, 0].set(title="(a) loss per measured batch", xlabel="step")
    ax[0, 0].legend()
    width = 0.4
    ax[0, 1].bar(
        np.asarray(epochs) - width / 2, [per[str(e)]["saturated_infonce"] for e in epochs], width, label="L_CLIP"
    )
    ax[0, 1].bar(np.asarray(epochs) + width / 2, [per[str(e)]["saturated_hn"] for e in epochs], width, label="L_HN")
    ax[0, 1].plot(epochs, [per[str(e)]["zero_grad_infonce"] for e in epochs], "k.--", label="∇L_CLIP = 0")
    ax[0, 1].set(title=f"(a') share saturated (loss < {dyn['saturation_threshold']:g})", xlabel="epoch", ylim=(0, 1))
    ax[0, 1].legend(fontsize=7)
    ax[0, 2].semilogy(s["step"], _floor(s["grad_norm_infonce"]), label="‖∇L_CLIP‖")
    ax[0, 2].semilogy(s["step"], _floor(s["grad_norm_hn"]), label="‖∇L_HN‖")
    ax[0, 2].set(title="(b) gradient norms", xlabel="step")
    ax[0, 2].legend()
    ratio = [per[str(e)]["grad_ratio"] for e in epochs]
    med = _floor([r["median"] for r in ratio])
    lo, hi = _floor([r["q25"] for r in ratio]), _floor([r["q75"] for r in ratio])
    ax[1, 0].semilogy(epochs, med, "o-")
    ax[1, 0].fill_between(epochs, lo, hi, alpha=0.3)
    ax[1, 0].set(title="(b') ‖∇L_HN‖ / ‖∇L_CLIP‖ (median, IQR; ∇L_CLIP ≠ 0)", xlabel="epoch")
    cos = np.asarray([np.nan if c is None else c for c in s["grad_cosine"]], dtype=np.float64)
    ax[1, 1].plot(s["step"], cos, ".", ms=3)
    ax[1, 1].axhline(0.0, color="gray", lw=0.5)
    ax[1, 1].set(
        title=f"(c) cos(∇L_CLIP, ∇L_HN), mean {dyn['overall']['cosine_mean'] or float('nan'):.2f}",
        xlabel="step",
        ylim=(-1, 1),
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
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for run, c in curves.items():
        for key, values in c.items():
            if key != "epoch":
                ax.plot(c["epoch"], [np.nan if v is None else v for v in values], "o-", ms=3, label=f"{run}: {key}")
    ax.set(xlabel="epoch", ylabel="R@1 (%)", title="convergence")
    ax.legend(fontsize=7)
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
