"""Data speed on SynthDense: generation time of ~10,000 images at 64 px, and loader samples/s with 0, 1, 2 workers.

    python benchmarks/data_throughput.py [--out DIR] [--samples 4096] [--batch-size 128]

Prints one JSON object. Loader throughput covers PNG decode + CLIP preprocessing + batched tokenisation into a
`Batch`; worker start-up is excluded (the first batch is a warm-up), so it is the steady-state rate.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import torch

from sharpclip.config import DataConfig, SynthDenseConfig
from sharpclip.data import build_loader
from sharpclip.data.synthetic import MMVP_PATTERNS, generate

# 6,000 train + 100×6 test + 2,000 pretrain + 600×2 edit + 17×6×2 MMVP = 10,004 images
CORPUS = SynthDenseConfig(
    train_families=6000, test_families=100, pretrain_scenes=2000, edits=600, mmvp_pairs=17, resolution=64, workers=2
)


def images_in(cfg: SynthDenseConfig) -> int:
    return (
        cfg.train_families * cfg.train_family_size
        + cfg.test_families * cfg.test_family_size
        + cfg.pretrain_scenes
        + 2 * cfg.edits
        + 2 * cfg.mmvp_pairs * len(MMVP_PATTERNS)
    )


def time_generation(root: str) -> dict:
    start = time.perf_counter()
    generate(root, CORPUS)
    seconds = time.perf_counter() - start
    return {
        "images": images_in(CORPUS),
        "resolution": CORPUS.resolution,
        "processes": CORPUS.workers,
        "seconds": round(seconds, 2),
        "images_per_s": round(images_in(CORPUS) / seconds),
    }


def time_loader(root: str, workers: int, samples: int, batch_size: int) -> dict:
    cfg = DataConfig(root=root, synthdense=CORPUS, image_size=64, context_length=160, num_workers=workers)
    loader = build_loader(cfg, "train", batch_size=batch_size)
    it = iter(loader)
    next(it)  # warm-up: worker start-up and first batch
    seen, start = 0, time.perf_counter()
    for batch in it:
        seen += len(batch)
        if seen >= samples:
            break
    seconds = time.perf_counter() - start
    del it
    return {"workers": workers, "samples": seen, "seconds": round(seconds, 2), "samples_per_s": round(seen / seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="where to generate (default: a temporary folder, removed afterwards)")
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    root = args.out or tempfile.mkdtemp(prefix="synthdense-bench-")
    try:
        result = {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "generation": time_generation(root)}
        result["loader"] = [time_loader(root, w, args.samples, args.batch_size) for w in (0, 1, 2)]
    finally:
        if not args.out:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
