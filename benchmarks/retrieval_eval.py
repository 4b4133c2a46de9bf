"""Speed and peak memory of chunked exact retrieval metrics vs the naive full-matrix argsort (GOAL/TULIP scripts).

    python benchmarks/retrieval_eval.py [--sizes 5100 20000 50000] [--dim 768] [--chunk 1024]

Every variant computes text→image and image→text ranks of the ground truth for N random unit-vector pairs (D = 768,
caption i ↔ image i) and one JSON object is printed: `one_pass` is the scorer (eval.metrics.retrieval_ranks, both
directions from one pass over S), `two_pass` scores each direction on its own (eval.metrics.query_ranks twice, S
computed twice), `naive` argsorts the full matrix; the ratios are of one run. Each measurement runs in its own
subprocess; its peak memory is `resource.getrusage(RUSAGE_SELF).ru_maxrss` after the run minus the same value just
before it (after torch is imported and the embeddings exist), i.e. the extra resident memory the metric needed at
its peak. The naive variant is skipped where its estimated footprint (S, its transpose's argsort and the int64
index matrices) exceeds the memory available on this machine. The ranks of the variants are compared where they ran.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

from sharpclip.eval.metrics import pairs_from_caption_index, query_ranks, retrieval_ranks


def _embeddings(n: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    text = torch.nn.functional.normalize(torch.randn(n, dim, generator=g), dim=1)
    image = torch.nn.functional.normalize(torch.randn(n, dim, generator=g), dim=1)
    return text, image


def _naive(text: torch.Tensor, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference scripts' way: full S, argsort descending per row, position of the ground truth."""
    sim = text @ image.t()
    gt = torch.arange(sim.shape[0])[:, None]
    t2i = torch.where(torch.argsort(sim, dim=1, descending=True) == gt)[1]
    i2t = torch.where(torch.argsort(sim.t(), dim=1, descending=True) == gt)[1]
    return t2i, i2t


def _worker(variant: str, n: int, dim: int, chunk: int) -> dict:
    text, image = _embeddings(n, dim)
    base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    positives = pairs_from_caption_index(range(n))
    if variant == "one_pass":
        ranks = retrieval_ranks(text, image, positives, chunk_size=chunk)
        t2i, i2t = ranks.t2i, ranks.i2t
    elif variant == "two_pass":
        t2i = query_ranks(text, image, positives, chunk)
        i2t = query_ranks(image, text, positives.flip(1), chunk)
    else:
        t2i, i2t = _naive(text, image)
    seconds = time.perf_counter() - start
    peak_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_kb) / 1024
    return {
        "seconds": round(seconds, 3),
        "peak_extra_mb": round(peak_mb, 1),
        "r1_t2i": round(100.0 * float((t2i < 1).double().mean()), 4),
        "rank_checksum": int(t2i.sum() + i2t.sum()),
    }


def _available_mb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return float("inf")


def _naive_estimate_mb(n: int) -> float:
    # S (fp32) + argsort indices (int64) + the == mask and sort workspace, for the larger of the two directions.
    return n * n * (4 + 8 + 1 + 8) / 2**20


def _run(variant: str, n: int, dim: int, chunk: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", variant, "--sizes", str(n), "--dim", str(dim), "--chunk", str(chunk)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[5100, 20000, 50000])
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--worker", choices=["one_pass", "two_pass", "naive"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.worker, args.sizes[0], args.dim, args.chunk)))
        return
    report = {
        "dim": args.dim,
        "chunk": args.chunk,
        "threads": torch.get_num_threads(),
        "memory_method": "subprocess ru_maxrss after the metric minus ru_maxrss just before it (extra peak RSS)",
        "results": [],
    }
    for n in args.sizes:
        row = {"n": n, "one_pass": _run("one_pass", n, args.dim, args.chunk)}
        row["two_pass"] = _run("two_pass", n, args.dim, args.chunk)
        if "seconds" in row["one_pass"] and "seconds" in row["two_pass"]:
            row["two_pass_over_one_pass"] = round(row["two_pass"]["seconds"] / row["one_pass"]["seconds"], 2)
            row["same_ranks_two_pass"] = row["two_pass"]["rank_checksum"] == row["one_pass"]["rank_checksum"]
        if _naive_estimate_mb(n) < 0.8 * _available_mb():
            row["naive"] = _run("naive", n, args.dim, args.chunk)
            for name in ("one_pass", "two_pass"):
                if "seconds" in row["naive"] and "seconds" in row[name]:
                    row[f"speedup_{name}"] = round(row["naive"]["seconds"] / row[name]["seconds"], 2)
                    row[f"same_ranks_naive_{name}"] = row["naive"]["rank_checksum"] == row[name]["rank_checksum"]
            if n == 20000 and "speedup_one_pass" in row:  # the targets: >= 10x the naive argsort, <= 2 GB peak
                row["meets_targets"] = row["speedup_one_pass"] >= 10 and row["one_pass"]["peak_extra_mb"] <= 2048
        else:
            row["naive"] = {"skipped": f"estimated {_naive_estimate_mb(n):.0f} MB > 80% of available memory"}
        report["results"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    main()
