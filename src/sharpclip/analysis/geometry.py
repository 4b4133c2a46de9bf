"""Caption geometry: how near-duplicate a dataset's captions are under a text encoder (HN-CLIP Table A1, Fig. 1, A6).

For L2-normalised caption embeddings T (N, D) and G = T Tᵀ (cosine similarities), off the diagonal:

- mean pairwise similarity     mean_{i≠j} G_ij = (‖Σ_i t_i‖² − Σ_i ‖t_i‖²) / (N (N − 1))        (exact, O(N D))
- mean hardest companion       mean_i max_{j≠i} G_ij                                            (Fig. 1b)
- share of negatives ≥ 0.8 / ≥ 0.9: among off-diagonal pairs, either of the whole set (the default) or of
  in-batch pairs when `batch_size` is given (consecutive batches of a seeded permutation, as a shuffled loader makes)
- histograms of all pairwise similarities and of hardest-companion similarities (fixed bins on [-1, 1])
- effective dimension          (Σ λ)² / Σ λ² of the eigenvalues λ of the centred captions' covariance (the
  participation ratio: k for captions spread evenly over k directions around their mean). At a given mean pairwise
  similarity it sets how near each caption's nearest companion is: the fewer directions the captions vary along,
  the nearer the hardest one

G is never materialised: rows are processed `chunk_size` at a time (memory O(chunk_size × N)). The same statistics
of Ḡ (the margin matrix) are what HN-CLIP adds to the logits: every pair ≥ 0.8 gets a margin of at least 0.8·γ.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

THRESHOLDS = (0.8, 0.9)
HIST_BINS = 200
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
) -> dict[str, Any]:
    """Statistics of one dataset's captions. text: (N, D) L2-normalised, N ≥ 2. JSON-ready dict (see module doc)."""
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
        "hist_bins": torch.linspace(-1.0, 1.0, bins + 1).tolist(),
        "hist_pairwise": whole["hist"].tolist(),
        "hist_hardest": _histogram(hardest, bins).tolist(),
        "hardest_quantiles": dict(zip(("p10", "p50", "p90"), torch.quantile(hardest, _Q).tolist(), strict=True)),
        "effective_dim": effective_dimension(text),
    }
    if batch_size is not None:
        shares, pairs = _in_batch_shares(text, thresholds, batch_size, seed)
        out["share_negatives_at_least"] = dict(zip(map(str, thresholds), shares, strict=True))
        out["negatives_scope"] = f"in-batch pairs, batches of {batch_size} (seed {seed}), {pairs} pairs"
    return out


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
