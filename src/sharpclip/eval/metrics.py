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

Memory: the full N × N matrix is never built. S is computed `chunk_size` caption rows at a time, so the working set
is O(chunk_size × N) floats; every K is exact because ranks are counted, not cut off at a top-k.

Scoring runs on the device given (the evaluation device), in float32, both directions from one pass over S
(`retrieval_ranks`). First each image's best positive caption and its score, from a block of each chunk's rows
against only the images its positives name (`_probe`: c/N of the pass for one caption per image). Then each block
of S counts its rows, text→image, against each row's best positive (which lies in the block), and its columns,
image→text, against those scores: per direction one `>=` comparison and one sum, and one `==` comparison and sum
that find the rare ties. The blocks also read every positive's own score; an image whose probed best score differs
from them (a BLAS kernel that rounded the narrower block otherwise) is ranked again on its own, so every rank is
exact under the tie policy. Measured with `python benchmarks/retrieval_eval.py --sizes 20000` (N = 20,000,
D = 768, chunk 1024, 2 CPU cores shared and busy, load 2.6–3.9): 11.7 s, against 18.2 s for each direction on its
own (S computed twice, `query_ranks`) and 126.1 s for the full-matrix argsort (10.8× and 6.9×), the same ranks,
0.21 GB extra peak RSS. Counts are sums of 0/1 floats (exact below 2**24), which the CPU sums faster than booleans.
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


def _tie_ranks(scores: Tensor, best: Tensor, first: Tensor, axis: int, offset: int, buf: Tensor) -> Tensor:
    """Each query's count in this block under the tie policy: #(> best) + #(== best at a lower gallery index).

    scores: (c, n) block; the queries run along `1 - axis` (axis 1: rows are queries, 0: columns are), their
    galleries along `axis`, whose first entry is gallery index `offset`. best, first: per query, its best positive's
    score and gallery index (which may lie outside this block). buf: (c, n) float32 scratch. Returns int64.
    Counts are sums of 0/1 floats, exact below 2**24 items and faster than summing booleans on the CPU: every entry
    >= best, then the entries equal to it; only queries where another entry ties with the best positive look at
    where those entries lie.
    """
    thr = best[:, None] if axis == 1 else best[None, :]
    counts = torch.ge(scores, thr, out=buf).sum(axis)
    local = first - offset
    inside = ((local >= 0) & (local < scores.shape[axis])).to(counts.dtype)  # the best positive: not counted
    counts -= inside
    tied = torch.nonzero(torch.eq(scores, thr, out=buf).sum(axis) > inside).flatten()
    if tied.numel():  # another entry equals the best score: the ones after the best positive do not count
        where = torch.arange(scores.shape[axis], device=scores.device) + offset
        if axis == 1:
            later = (buf[tied] > 0) & (where[None, :] > first[tied, None])
        else:
            later = (buf[:, tied] > 0) & (where[:, None] > first[None, tied])
        counts[tied] -= later.sum(axis).to(counts.dtype)
    return counts.long()


def _chunks(positives: Tensor, n_query: int, chunk_size: int) -> tuple[Tensor, Tensor, list[int]]:
    """Positive pairs sorted by query (stable) and, per chunk of `chunk_size` queries, where its pairs start."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    order = torch.argsort(positives[:, 0], stable=True)
    q_sorted, g_sorted = positives[order, 0], positives[order, 1]
    edges = torch.arange(0, n_query + chunk_size, chunk_size, device=positives.device)
    return q_sorted, g_sorted, torch.searchsorted(q_sorted.contiguous(), edges).tolist()


def query_ranks(query: Tensor, gallery: Tensor, positives: Tensor, chunk_size: int = 1024) -> Tensor:
    """0-based rank of each query's best positive under the tie policy, without materialising Q × G.

    query: (Q, D), gallery: (G, D), L2-normalised (any float dtype; scored in fp32).
    positives: (E, 2) int pairs (query index, gallery index); every query needs at least one.
    Returns (Q,) int64. Working memory O(chunk_size × G).
    """
    query, gallery = query.float(), gallery.float()
    positives = positives.long().to(query.device)
    q_sorted, g_sorted, bounds = _chunks(positives, query.shape[0], chunk_size)
    ranks = torch.empty(query.shape[0], dtype=torch.long, device=query.device)
    buf = torch.empty(min(chunk_size, query.shape[0]), gallery.shape[0], device=query.device)
    for c, start in enumerate(range(0, query.shape[0], chunk_size)):
        stop = min(start + chunk_size, query.shape[0])
        lo, hi = bounds[c], bounds[c + 1]
        scores = query[start:stop] @ gallery.t()
        best, first = _best_positive(scores, q_sorted[lo:hi] - start, g_sorted[lo:hi], stop - start)
        ranks[start:stop] = _tie_ranks(scores, best, first, 1, 0, buf[: stop - start])
    return ranks


MIN_PROBE_COLUMNS = 256  # narrower blocks take other BLAS kernels, whose rounding differs from the full block's


def _best_per_gallery(values: Tensor, q: Tensor, g: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Per gallery item g: the highest of its positives' scores `values` (E,) and, among equal ones, the lowest
    query index (the image→text best positive, from the text→image pairs q, g)."""
    best = torch.full((n,), float("-inf"), dtype=values.dtype, device=values.device)
    best = best.scatter_reduce(0, g, values, reduce="amax")
    at_best = values == best[g]
    first = torch.full((n,), 2**62, dtype=torch.long, device=values.device)
    return best, first.scatter_reduce(0, g[at_best], q[at_best], reduce="amin")


def _probe(text: Tensor, image: Tensor, q: Tensor, g: Tensor, start: int, stop: int) -> Tensor:
    """The scores S[q, g] of the pairs (q in [start, stop)) from a block of the same rows and only the columns these
    pairs name (padded to MIN_PROBE_COLUMNS), so that they round as the full block's entries do: on the CPU, a
    10-column block rounded most entries otherwise, blocks of 205 columns and more none (an exception is caught by
    `_one_pass` all the same)."""
    cols = torch.unique(g)
    pad = min(MIN_PROBE_COLUMNS, image.shape[0]) - cols.numel()
    padded = torch.cat([cols, torch.arange(max(pad, 0), device=cols.device)])
    block = text[start:stop] @ image[padded].t()
    return block[q - start, torch.searchsorted(cols, g)]


def _rank_again(text: Tensor, image: Tensor, q: Tensor, g: Tensor, redo: Tensor, chunk_size: int) -> Tensor:
    """Image→text ranks of the images `redo` (sorted), each against the captions on its own (`query_ranks`)."""
    keep = torch.isin(g, redo)
    return query_ranks(image[redo], text, torch.stack([torch.searchsorted(redo, g[keep]), q[keep]], 1), chunk_size)


def _one_pass(text: Tensor, image: Tensor, positives: Tensor, chunk_size: int) -> Ranks:
    """Both directions from one pass over S = text @ imageᵀ, in blocks of `chunk_size` text rows (see the module
    docstring). text: (T, D), image: (I, D); positives: (E, 2) (text, image) pairs, checked by the caller.

    Each image's best positive caption and its score come first, from the positives' scores (`_probe`); each block
    then counts its rows (text→image, against the block's own best positives) and its columns (image→text, against
    those scores), and reads every positive's score from itself. An image whose probed best score or caption
    differs from the blocks' (a kernel that rounded otherwise) is ranked again (`_rank_again`): every rank is exact.
    """
    text, image = text.float(), image.float()
    positives = positives.long().to(text.device)
    q, g, bounds = _chunks(positives, text.shape[0], chunk_size)
    n_text, n_image = text.shape[0], image.shape[0]
    spans = [(start, min(start + chunk_size, n_text), bounds[c], bounds[c + 1])
             for c, start in enumerate(range(0, n_text, chunk_size))]  # fmt: skip
    probed = torch.cat([_probe(text, image, q[lo:hi], g[lo:hi], start, stop) for start, stop, lo, hi in spans])
    best_i, first_i = _best_per_gallery(probed, q, g, n_image)
    t2i = torch.empty(n_text, dtype=torch.long, device=text.device)
    i2t = torch.zeros(n_image, dtype=torch.long, device=text.device)
    seen = torch.empty_like(probed)
    buf = torch.empty(min(chunk_size, n_text), n_image, device=text.device)
    for start, stop, lo, hi in spans:
        block = text[start:stop] @ image.t()
        seen[lo:hi] = block[q[lo:hi] - start, g[lo:hi]]
        best, first = _best_positive(block, q[lo:hi] - start, g[lo:hi], stop - start)
        t2i[start:stop] = _tie_ranks(block, best, first, 1, 0, buf[: stop - start])
        i2t += _tie_ranks(block, best_i, first_i, 0, start, buf[: stop - start])
    seen_best, seen_first = _best_per_gallery(seen, q, g, n_image)
    redo = torch.nonzero((seen_best != best_i) | (seen_first != first_i)).flatten()
    if redo.numel():
        i2t[redo] = _rank_again(text, image, q, g, redo, chunk_size)
    return Ranks(t2i=t2i, i2t=i2t)


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
        ranks = _one_pass(text, image, on_device, chunk_size)
    return Ranks(t2i=ranks.t2i.cpu(), i2t=ranks.i2t.cpu())


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
