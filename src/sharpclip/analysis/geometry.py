"""Caption geometry: how near-duplicate a dataset's captions are under a text encoder (HN-CLIP Table A1, Fig. 1, A6).

For L2-normalised caption embeddings T (N, D) and G = T Tᵀ (cosine similarities), off the diagonal:

- mean pairwise similarity     mean_{i≠j} G_ij = (‖Σ_i t_i‖² − Σ_i ‖t_i‖²) / (N (N − 1))        (exact, O(N D))
- mean hardest companion       mean_i max_{j≠i} G_ij                                            (Fig. 1b)
- share of negatives ≥ 0.8 / ≥ 0.9: among off-diagonal pairs, either of the whole set (the default) or of
  in-batch pairs when `batch_size` is given (consecutive batches of a seeded permutation, as a shuffled loader makes)
- histograms of all pairwise similarities and of hardest-companion similarities, each on bins fitted to its data
  (`fitted_histogram`: the occupied range cut into Freedman–Diaconis-wide bins, 10 to 80 of them), so captions in a
  narrow cone (all between 0.99 and 1.0) still show their shape
- effective dimension          (Σ λ)² / Σ λ² of the eigenvalues λ of the centred captions' covariance (the
  participation ratio: k for captions spread evenly over k directions around their mean). At a given mean pairwise
  similarity it sets how near each caption's nearest companion is: the fewer directions the captions vary along,
  the nearer the hardest one

G is never materialised: rows are processed `chunk_size` at a time (memory O(chunk_size × N)). The same statistics
of Ḡ (the margin matrix) are what HN-CLIP adds to the logits: every pair ≥ 0.8 gets a margin of at least 0.8·γ.

The margin in logits (HN-CLIP eq. 2 adds s·γ·Ḡ_ij to negative j of row i; docs/method-notes.md derives these):

- spread  s·γ·(h̄ − p̄): how much more the hardest negative is boosted than an average one; only this part changes
  which negatives the softmax attends to (a shift shared by every negative of a row leaves a softmax over the
  negatives unchanged)
- uniform s·γ·p̄: the part every negative gets alike (it raises the loss of every row, as a fixed margin would)
- reach: a unit image vector v can give caption i a margin over caption j of at most max_v v·(t_i − t_j) =
  ‖t_i − t_j‖ = √(2 − 2·G_ij); the margin γ·G_ij eq. 2 asks is larger than that for G_ij above
  (√(1 + 2γ²) − 1) / γ² (0.899 at γ 0.5), so no image embedding meets it and that row's loss cannot vanish.
  `unreachable_share` is the share of captions whose hardest negative asks more than it can get
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

THRESHOLDS = (0.8, 0.9)
# HN-CLIP Fig. 1 / Table A1 (Long-CLIP-L, test captions): (mean pairwise, mean hardest-negative) cosine; and the
# paper's γ (eq. 2 default) and scale (CLIP's inverse temperature at its clamp, 100, which Long-CLIP keeps)
PAPER_FIG1 = {"DOCCI": (0.84, 0.93), "DCI": (0.85, 0.92), "Urban-1K": (0.88, 0.94)}
PAPER_GAMMA, PAPER_SCALE = 0.5, 100.0
HIST_BINS = 20_000  # the pass over all pairs counts into bins 1e-4 wide, re-binned to the data (fitted_histogram)
FITTED_BINS = (10, 80)  # the fewest and most bins a fitted histogram has
_Q = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)


def mean_pairwise_similarity(text: Tensor) -> float:
    """mean_{i≠j} tᵢ·tⱼ for text (N, D), N ≥ 2, exactly, without the N × N matrix."""
    t = text.double()
    n = t.shape[0]
    total = float(t.sum(0).pow(2).sum())
    diag = float(t.pow(2).sum())
    return (total - diag) / (n * (n - 1))


def effective_dimension(text: Tensor) -> float:
    """The participation ratio (Σ λ)² / Σ λ² of the covariance eigenvalues λ of text (N, D) about its mean; 0 when
    every row is the same."""
    t = text.double()
    centred = t - t.mean(0)
    eig = torch.linalg.eigvalsh(centred.t() @ centred / t.shape[0]).clamp(min=0.0)
    total = float(eig.sum())
    return total**2 / float(eig.pow(2).sum()) if total > 0 else 0.0


def _histogram(values: Tensor, bins: int) -> Tensor:
    return torch.histc(values.float().clamp(-1.0, 1.0), bins=bins, min=-1.0, max=1.0).long()


def fitted_histogram(counts: Tensor, edges: Tensor) -> tuple[list[float], list[int]]:
    """(edges, counts) of a fine histogram merged into bins fitted to its data: the occupied range, cut into as many
    equal bins as the Freedman–Diaconis width 2·IQR/n^(1/3) gives (within FITTED_BINS), each a whole number of fine
    bins. A histogram whose values share one fine bin keeps a few bins around it."""
    counts = counts.long()
    used = torch.nonzero(counts).flatten()
    if not len(used):
        return edges[[0, -1]].tolist(), [0]
    first, last = int(used[0]), int(used[-1]) + 1  # fine bins [first, last)
    fine = last - first
    cum = counts[first:last].cumsum(0).double()
    n = float(cum[-1])
    q25, q75 = (int(torch.searchsorted(cum, n * q)) for q in (0.25, 0.75))
    width = max(1, round(2 * max(q75 - q25, 1) / n ** (1 / 3)))  # in fine bins
    bins = min(max(math.ceil(fine / width), FITTED_BINS[0]), FITTED_BINS[1])
    step = max(1, math.ceil(fine / bins))
    k = max(bins, math.ceil(fine / step))  # coarse bins, the data's end aligned to a coarse edge
    start = max(0, min(first + step * math.ceil(fine / step), len(counts)) - step * k)
    stop = start + step * k
    padded = torch.cat([counts, counts.new_zeros(max(0, stop - len(counts)))])
    merged = padded[start:stop].reshape(k, step).sum(1)
    return (edges[0] + (edges[1] - edges[0]) * torch.arange(start, stop + 1, step)).tolist(), merged.tolist()


def _fine_edges(bins: int) -> Tensor:
    return torch.linspace(-1.0, 1.0, bins + 1, dtype=torch.float64)


def _whole_set_stats(text: Tensor, thresholds: Sequence[float], chunk_size: int, bins: int) -> dict[str, Any]:
    n = text.shape[0]
    hardest = torch.empty(n, dtype=torch.float64)
    above = torch.zeros(len(thresholds), dtype=torch.long)
    hist = torch.zeros(bins, dtype=torch.long)
    for start in range(0, n, chunk_size):
        g = text[start : start + chunk_size].float() @ text.float().t()
        rows = torch.arange(g.shape[0])
        g[rows, rows + start] = float("nan")  # the diagonal (each caption with itself) is not a negative
        off = g[~torch.isnan(g)]
        hardest[start : start + g.shape[0]] = torch.nan_to_num(g, nan=-2.0).max(1).values.double()
        above += torch.stack([(off >= th).sum() for th in thresholds])
        hist += _histogram(off, bins)
    pairs = n * (n - 1)
    return {"hardest": hardest, "share_above": (above.double() / pairs).tolist(), "pairs": pairs, "hist": hist}


def _in_batch_shares(text: Tensor, thresholds: Sequence[float], batch_size: int, seed: int) -> tuple[list[float], int]:
    order = torch.randperm(text.shape[0], generator=torch.Generator().manual_seed(seed))
    above = torch.zeros(len(thresholds), dtype=torch.long)
    pairs = 0
    for start in range(0, len(order) - batch_size + 1, batch_size):  # full batches only, as with drop_last
        b = text[order[start : start + batch_size]].float()
        g = b @ b.t()
        off = g[~torch.eye(batch_size, dtype=torch.bool)]
        above += torch.stack([(off >= th).sum() for th in thresholds])
        pairs += off.numel()
    if pairs == 0:
        raise ValueError(f"batch_size {batch_size} is larger than the {text.shape[0]} captions: no full batch")
    return (above.double() / pairs).tolist(), pairs


def caption_geometry(
    text: Tensor,
    thresholds: Sequence[float] = THRESHOLDS,
    batch_size: int | None = None,
    seed: int = 0,
    chunk_size: int = 1024,
    bins: int = HIST_BINS,
    gammas: Sequence[float] = (),
    scale: float | None = None,
) -> dict[str, Any]:
    """Statistics of one dataset's captions. text: (N, D) L2-normalised, N ≥ 2. JSON-ready dict (see module doc);
    with `scale`, also "margin": the boost in logits at each of `gammas` and at the paper's spread (margin_report)."""
    if text.ndim != 2 or text.shape[0] < 2:
        raise ValueError(f"caption_geometry needs (N, D) embeddings with N >= 2; got {tuple(text.shape)}")
    whole = _whole_set_stats(text, thresholds, chunk_size, bins)
    hardest = whole["hardest"]
    out: dict[str, Any] = {
        "captions": int(text.shape[0]),
        "mean_pairwise": mean_pairwise_similarity(text),
        "mean_hardest": float(hardest.mean()),
        "share_negatives_at_least": dict(zip(map(str, thresholds), whole["share_above"], strict=True)),
        "negatives_scope": "all off-diagonal pairs",
        **_histograms("pairwise", whole["hist"], bins),
        **_histograms("hardest", _histogram(hardest, bins), bins),
        "hardest_quantiles": dict(zip(("p10", "p50", "p90"), torch.quantile(hardest, _Q).tolist(), strict=True)),
        "effective_dim": effective_dimension(text),
    }
    if batch_size is not None:
        shares, pairs = _in_batch_shares(text, thresholds, batch_size, seed)
        out["share_negatives_at_least"] = dict(zip(map(str, thresholds), shares, strict=True))
        out["negatives_scope"] = f"in-batch pairs, batches of {batch_size} (seed {seed}), {pairs} pairs"
    if scale is not None:
        out["margin"] = margin_report(out, hardest, gammas, scale)
    return out


def _histograms(name: str, fine: Tensor, bins: int) -> dict[str, list]:
    edges, counts = fitted_histogram(fine, _fine_edges(bins))
    return {f"hist_bins_{name}": edges, f"hist_{name}": counts}


def hardness_buckets(stats: dict[str, Any]) -> dict[str, float]:
    """Composition of negatives by hardness (Fig. A6 C): shares below the lowest threshold, between, and above."""
    shares = sorted(((float(k), v) for k, v in stats["share_negatives_at_least"].items()), reverse=True)
    out, covered = {}, 0.0
    for i, (th, share) in enumerate(shares):
        label = f">= {th}" if i == 0 else f"[{th}, {shares[i - 1][0]})"
        out[label] = share - covered
        covered = share
    out[f"< {shares[-1][0]}"] = 1.0 - covered
    return out


def geometry_table(stats_by_dataset: dict[str, dict[str, Any]]) -> str:
    """Markdown in the shape of HN-CLIP Table A1's similarity columns (plus the ≥ threshold shares)."""
    keys = list(next(iter(stats_by_dataset.values()))["share_negatives_at_least"])
    head = "| dataset | captions | pairwise sim | hardest sim | " + " | ".join(f"≥ {k}" for k in keys) + " |"
    lines = [head, "|---" * (4 + len(keys)) + "|"]
    for name, s in stats_by_dataset.items():
        shares = " | ".join(f"{100 * s['share_negatives_at_least'][k]:.1f}%" for k in keys)
        lines.append(f"| {name} | {s['captions']} | {s['mean_pairwise']:.3f} | {s['mean_hardest']:.3f} | {shares} |")
    return "\n".join(lines) + "\n"


def margin_logits(pairwise: float, hardest: float, gamma: float, scale: float) -> dict[str, float]:
    """The boost in logits: {"spread": s·γ·(h̄ − p̄), "uniform": s·γ·p̄} for mean pairwise p̄ and mean hardest h̄."""
    return {"spread": scale * gamma * (hardest - pairwise), "uniform": scale * gamma * pairwise}


def paper_spread() -> float:
    """The mean over HN-CLIP Fig. 1's three test sets of s·γ·(h̄ − p̄) at the paper's γ and s: 3.67 logits."""
    spreads = [margin_logits(p, h, PAPER_GAMMA, PAPER_SCALE)["spread"] for p, h in PAPER_FIG1.values()]
    return sum(spreads) / len(spreads)


def gamma_for_spread(spread: float, pairwise: float, hardest: float, scale: float) -> float:
    """The γ at which s·γ·(h̄ − p̄) equals `spread` logits; ValueError when h̄ ≤ p̄ (no spread at any γ)."""
    if hardest <= pairwise:
        raise ValueError(f"mean hardest {hardest:.4f} is not above mean pairwise {pairwise:.4f}: no γ gives a spread")
    return spread / (scale * (hardest - pairwise))


def reach(similarity: Tensor | float) -> Tensor | float:
    """√(2 − 2G): the largest margin any unit image vector can give a caption over one at cosine G."""
    if isinstance(similarity, Tensor):
        return (2.0 - 2.0 * similarity.clamp(max=1.0)).sqrt()
    return math.sqrt(max(0.0, 2.0 - 2.0 * similarity))


def unreachable_share(hardest: Tensor, gamma: float) -> float:
    """Share of captions whose hardest negative (hardest: (N,) cosines) asks a margin γ·G above √(2 − 2G)."""
    h = hardest.double()
    return float((gamma * h > reach(h)).double().mean())


def margin_report(
    stats: dict[str, Any], hardest: Tensor, gammas: Sequence[float], scale: float, spread: float | None = None
) -> dict[str, Any]:
    """The margin in the paper's units for each γ of `gammas` (and, with `spread`, the γ that gives `spread` logits
    here): {"scale", "paper_spread", "gamma_for_paper_spread", "per_gamma": {γ: {"spread", "uniform",
    "unreachable_share"}}}. stats: caption_geometry's output; hardest: (N,) each caption's hardest cosine."""
    p, h = stats["mean_pairwise"], stats["mean_hardest"]
    out: dict[str, Any] = {"scale": scale, "paper_spread": paper_spread() if spread is None else spread}
    out["gamma_for_paper_spread"] = gamma_for_spread(out["paper_spread"], p, h, scale) if h > p else None
    wanted = [*gammas] + ([out["gamma_for_paper_spread"]] if out["gamma_for_paper_spread"] else [])
    out["per_gamma"] = {
        f"{g:.4g}": {**margin_logits(p, h, g, scale), "unreachable_share": unreachable_share(hardest, g)}
        for g in wanted
    }
    return out


def margin_table(reports: dict[str, dict[str, Any]], stats: dict[str, dict[str, Any]]) -> str:
    """Markdown: the paper's Fig. 1 rows at γ 0.5, s 100 (reach at the mean hardest) beside each dataset's rows."""
    head = "| captions | γ | s | spread s·γ·(h̄ − p̄) | uniform s·γ·p̄ | hardest asks γ·h̄ / reach √(2 − 2h̄) | "
    lines = [head + "hardest negatives out of reach |", "|---|---|---|---|---|---|---|"]
    for name, (p, h) in PAPER_FIG1.items():
        m = margin_logits(p, h, PAPER_GAMMA, PAPER_SCALE)
        lines.append(
            f"| HN-CLIP Fig. 1: {name} | {PAPER_GAMMA:g} | {PAPER_SCALE:g} | {m['spread']:.1f} | {m['uniform']:.1f} "
            f"| {PAPER_GAMMA * h:.2f} / {reach(h):.2f} | – |"
        )
    for name, rep in reports.items():
        h = stats[name]["mean_hardest"]
        for g, m in rep["per_gamma"].items():
            lines.append(
                f"| {name} | {g} | {rep['scale']:.4g} | {m['spread']:.1f} | {m['uniform']:.1f} "
                f"| {float(g) * h:.3f} / {reach(h):.3f} | {100 * m['unreachable_share']:.1f}% |"
            )
    return "\n".join(lines) + "\n"
