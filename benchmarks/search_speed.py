"""Query time of the search index's exact top-k (analysis.index.top_k) against a plain full sort, on one CPU thread.

    taskset -c 0 python benchmarks/search_speed.py [--images 100000] [--dim 512] [--k 10] [--queries 30]

A gallery of N random unit vectors (float32, as an index stores them) and single-vector queries (what `sharpclip
search` answers). `top_k` scores the gallery in chunks (matrix product) and keeps each chunk's top k; `full_sort`
is the plain way: all N scores, `argsort` descending, the first k. Both run on one thread (torch.set_num_threads(1);
pin the process to one core with `taskset -c 0`), alternating, each query timed once after 3 warm-up queries; the
median and the 90th percentile of each are printed in milliseconds with their ratio, the time to read the index's
chunks back from safetensors files, and whether both gave the same hits. One JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from sharpclip.analysis.index import CHUNK_SIZE, _read_part, top_k


def full_sort(query: torch.Tensor, gallery: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All scores, one stable argsort, the first k."""
    scores = query @ gallery.T
    order = scores.argsort(dim=1, descending=True, stable=True)[:, :k]
    return scores.gather(1, order), order


def _time(fn, *args) -> tuple[float, tuple]:
    start = time.perf_counter()
    out = fn(*args)
    return (time.perf_counter() - start) * 1000, out


def _load_time(gallery: torch.Tensor) -> float:
    """Milliseconds to read the gallery back from index chunk files (analysis.index's layout)."""
    with tempfile.TemporaryDirectory() as tmp:
        for c, start in enumerate(range(0, gallery.shape[0], CHUNK_SIZE)):
            save_file(
                {"embedding": gallery[start : start + CHUNK_SIZE].contiguous()}, f"{tmp}/image-{c:05d}.safetensors"
            )
        ms, _ = _time(_read_part, Path(tmp), "image", gallery.shape[0], CHUNK_SIZE)
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--queries", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    gallery = torch.nn.functional.normalize(torch.randn(args.images, args.dim, generator=g), dim=1)
    queries = torch.nn.functional.normalize(torch.randn(args.queries + 3, args.dim, generator=g), dim=1)
    times: dict[str, list[float]] = {"top_k": [], "full_sort": []}
    same = True
    for n, q in enumerate(queries):
        a_ms, a = _time(top_k, q[None], gallery, args.k)
        b_ms, b = _time(full_sort, q[None], gallery, args.k)
        same &= torch.equal(a[1], b[1])
        if n >= 3:  # warm-up queries are not counted
            times["top_k"].append(a_ms)
            times["full_sort"].append(b_ms)
    med = {k: statistics.median(v) for k, v in times.items()}
    p90 = {k: sorted(v)[int(0.9 * (len(v) - 1))] for k, v in times.items()}
    print(json.dumps({
        "images": args.images, "dim": args.dim, "k": args.k, "queries": args.queries,
        "threads": torch.get_num_threads(),
        "cpus_allowed": len(os.sched_getaffinity(0)), "load_avg_1min": round(os.getloadavg()[0], 2),
        "top_k_ms_median": round(med["top_k"], 2), "top_k_ms_p90": round(p90["top_k"], 2),
        "full_sort_ms_median": round(med["full_sort"], 2), "full_sort_ms_p90": round(p90["full_sort"], 2),
        "full_sort_over_top_k": round(med["full_sort"] / med["top_k"], 2), "same_hits": bool(same),
        "index_read_ms": round(_load_time(gallery), 1),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
