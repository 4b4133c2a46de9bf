"""Retrieval metrics over embeddings: exact ranks, Recall@K, mean and median rank, in chunks (pure functions).

Protocol (CLIP_benchmark's convention, as the long-caption papers report it; docs/evaluation.md, Retrieval protocol):

- S = Q Gᵀ, cosine similarity of L2-normalised embeddings (the logit scale does not change rankings).
- Ground truth is many-to-many: a list of positive (text, image) pairs. A caption usually has one image and an image
  several captions (COCO/Flickr 5-caption), but any bipartite relation works.
- A query's rank is the 0-based position of its *best* positive in the gallery sorted by descending score.
  **Tie policy** (open_clip HEAD's deterministic tie-break): against a positive g of query q we count every gallery
  item j with S[q, j] > S[q, g], and every j < g with S[q, j] == S[q, g]. This is the position of g in a *stable*
  descending sort, so the best positive is the one with the highest score, the lowest index among equal scores.
  The same rule is applied text→image (queries = texts) and image→text (queries = images).
- A query hits at K when its rank < K ("a hit if any positive is in the top K"). Recall@K is the share of queries
  that hit, in percent. Mean and median rank are 1-based (rank + 1), as in open_clip and FineLIP.

Memory: the full N × N matrix is never built. Queries are processed `chunk_size` rows at a time, so the working set is
O(chunk_size × N_gallery) floats; every K is exact because ranks are counted, not cut off at a top-k.

Scoring runs on the device given (the evaluation device: a GPU scores 20k × 20k in well under a second), in float32,
one direction after the other. Counting both directions from one pass over S was tried (each image's best positive
from the positives' dot products, the entries within float rounding of it decided against S's own values): it gave
the same ranks but ran slower on the CPU (80.8 s against 39.6 s at N = 20,000, busy cores), because the comparisons
over S, not its products, dominate there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

TIE_POLICY = (
    "rank of a positive g for query q = #{j : S[q,j] > S[q,g]} + #{j < g : S[q,j] == S[q,g]} (stable descending sort, "
    "lower gallery index first); a query's rank is that of its best positive; same rule text->image and image->text"
)
METRIC_DEFINITIONS = {
    "R@K": "percent of queries whose best positive has 0-based rank < K (hit if any positive is in the top K)",
    "mean_rank": "mean over queries of (rank + 1)",
    "median_rank": "median over queries of (rank + 1); numpy median, the mean of the two middle values when even",
}
DEFAULT_KS = (1, 5, 10, 25, 50)


@dataclass(frozen=True)
class Ranks:
    """0-based rank of each query's best positive, both directions. t2i: (N_text,), i2t: (N_image,), int64."""

    t2i: Tensor
    i2t: Tensor


def pairs_from_caption_index(caption_to_image: Sequence[int] | Tensor) -> Tensor:
    """Positive pairs for the usual layout (each caption has one image). caption_to_image: (N_text,). Returns (E, 2)."""
    image = torch.as_tensor(caption_to_image, dtype=torch.long)
    return torch.stack([torch.arange(image.numel()), image], dim=1)


def _check_coverage(index: Tensor, n: int, what: str) -> None:
    covered = torch.zeros(n, dtype=torch.bool)
    covered[index] = True
    if not bool(covered.all()):
        missing = torch.nonzero(~covered).flatten()[:5].tolist()
        raise ValueError(
            f"retrieval ground truth: {what} {missing} (of {n}) have no positive; drop them from the evaluation set "
            "or add their pairs"
        )


def _check_inputs(text: Tensor, image: Tensor, positives: Tensor) -> None:
    if text.ndim != 2 or image.ndim != 2 or text.shape[1] != image.shape[1]:
        raise ValueError(
            f"embeddings must be (N, D) with equal D; got text {tuple(text.shape)}, image {tuple(image.shape)}"
        )
    for what, emb in (("text", text), ("image", image)):
        if not bool(torch.isfinite(emb).all()):  # NaN compares false everywhere and would rank every query first
            raise ValueError(f"{what} embeddings contain NaN or inf: check the model's outputs (fp16 overflow?)")
    if positives.ndim != 2 or positives.shape[1] != 2:
        raise ValueError(f"positives must be (E, 2) pairs of (text index, image index); got {tuple(positives.shape)}")
    if positives.numel() == 0:
        raise ValueError("positives is empty: nothing to evaluate")
    for col, n, what in ((0, text.shape[0], "text"), (1, image.shape[0], "image")):
        idx = positives[:, col]
        if int(idx.min()) < 0 or int(idx.max()) >= n:
            raise ValueError(f"positives column {col} ({what}) has an index outside [0, {n})")
        _check_coverage(idx, n, f"{what} indices")


def _best_positive(scores: Tensor, q_local: Tensor, g: Tensor, n_rows: int) -> tuple[Tensor, Tensor]:
    """Per row of `scores` (c, N): the highest positive score and, among equal ones, the lowest gallery index."""
    s = scores[q_local, g]
    best = torch.full((n_rows,), float("-inf"), dtype=scores.dtype, device=scores.device)
    best = best.scatter_reduce(0, q_local, s, reduce="amax")
    at_best = s == best[q_local]
    first = torch.full((n_rows,), scores.shape[1], dtype=torch.long, device=scores.device)
    first = first.scatter_reduce(0, q_local[at_best], g[at_best], reduce="amin")
    return best, first


def _chunk_ranks(scores: Tensor, best: Tensor, first: Tensor) -> Tensor:
    """Rank under the tie policy. scores: (c, N); best, first: (c,). Returns (c,) int64."""
    thr = best[:, None]
    higher = (scores > thr).sum(1)
    equal = (scores == thr).sum(1)
    rank = higher
    tied = torch.nonzero(equal > 1).flatten()  # rows where another item shares the best score: count lower indices
    if tied.numel():
        cols = torch.arange(scores.shape[1], device=scores.device)
        lower = ((scores[tied] == thr[tied]) & (cols[None, :] < first[tied, None])).sum(1)
        rank = rank.clone()
        rank[tied] += lower
    return rank


def query_ranks(query: Tensor, gallery: Tensor, positives: Tensor, chunk_size: int = 1024) -> Tensor:
    """0-based rank of each query's best positive under the tie policy, without materialising Q × G.

    query: (Q, D), gallery: (G, D), L2-normalised (any float dtype; scored in fp32).
    positives: (E, 2) int pairs (query index, gallery index); every query needs at least one.
    Returns (Q,) int64. Working memory O(chunk_size × G).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    query, gallery = query.float(), gallery.float()
    positives = positives.long().to(query.device)
    order = torch.argsort(positives[:, 0], stable=True)
    q_sorted, g_sorted = positives[order, 0], positives[order, 1]
    arange = torch.arange(0, query.shape[0] + chunk_size, chunk_size, device=query.device)
    bounds = torch.searchsorted(q_sorted.contiguous(), arange).tolist()
    ranks = torch.empty(query.shape[0], dtype=torch.long, device=query.device)
    for c, start in enumerate(range(0, query.shape[0], chunk_size)):
        stop = min(start + chunk_size, query.shape[0])
        lo, hi = bounds[c], bounds[c + 1]
        scores = query[start:stop] @ gallery.t()
        best, first = _best_positive(scores, q_sorted[lo:hi] - start, g_sorted[lo:hi], stop - start)
        ranks[start:stop] = _chunk_ranks(scores, best, first)
    return ranks


def retrieval_ranks(
    text: Tensor, image: Tensor, positives: Tensor, chunk_size: int = 1024, device: str | torch.device | None = None
) -> Ranks:
    """Ranks in both directions. text: (T, D), image: (I, D) L2-normalised; positives: (E, 2) (text, image) pairs.

    Text→image ranks images for each caption; image→text ranks captions for each image (several may be positive).
    Scored on `device` (default: the embeddings'), see the module docstring; ranks come back on the CPU.
    """
    positives = torch.as_tensor(positives, dtype=torch.long)
    _check_inputs(text, image, positives)
    device = torch.device(device) if device is not None else text.device
    text, image, on_device = text.to(device), image.to(device), positives.to(device)
    with torch.no_grad():
        t2i = query_ranks(text, image, on_device, chunk_size)
        i2t = query_ranks(image, text, on_device.flip(1), chunk_size)
    return Ranks(t2i=t2i.cpu(), i2t=i2t.cpu())


def recall_summary(ranks: Tensor, ks: Sequence[int] = DEFAULT_KS) -> dict[str, float]:
    """R@K (percent) for each K, mean and median 1-based rank. ranks: (Q,) 0-based."""
    if ranks.numel() == 0:
        raise ValueError("no queries to summarise")
    bad = [k for k in ks if int(k) < 1]
    if bad:
        raise ValueError(f"recall K values must be >= 1, got {bad}")
    out = {f"R@{k}": 100.0 * float((ranks < k).double().mean()) for k in ks}
    one_based = ranks.double().numpy() + 1.0
    out["mean_rank"] = float(one_based.mean())
    out["median_rank"] = float(np.median(one_based))
    return out


def retrieval_metrics(
    text: Tensor,
    image: Tensor,
    positives: Tensor,
    ks: Sequence[int] = DEFAULT_KS,
    chunk_size: int = 1024,
    device: str | torch.device | None = None,
) -> dict[str, dict[str, float]]:
    """{"t2i": {R@K..., mean_rank, median_rank}, "i2t": {...}} for embeddings and positive (text, image) pairs,
    scored on `device` (default: the embeddings')."""
    ranks = retrieval_ranks(text, image, positives, chunk_size, device)
    return {"t2i": recall_summary(ranks.t2i, ks), "i2t": recall_summary(ranks.i2t, ks)}
