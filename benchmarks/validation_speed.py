"""Validation's image path against the training loader's, on the same photos: img/s of each, as JSON.

    python benchmarks/validation_speed.py [--photos 256] [--size 224] [--batch-size 64] [--workers 2]

The photos are the 1500×1000 JPEGs of benchmarks/data_throughput.py (made in code). The training loader is
`data.build_loader` (generic format, `--workers` persistent workers, one warm-up epoch, then one timed epoch). The
validation is `eval.embed.ModelEmbedder.images` over the same files and preprocessing, with a model that only
averages the pixels (so the image path is what is timed), as the trainer runs it every validation: a fresh loader
with `--workers` workers (start-up included), and the in-process loop it replaced (`num_workers=0`). Both use the same
JPEG decoding (exact, then draft). Target: validation ≥ 0.9 × the training loader's img/s.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from data_throughput import PHOTO_WORDS, make_photos
from sharpclip.config import DataConfig
from sharpclip.data import build_loader
from sharpclip.data.transforms import ClipImageTransform, Preprocessing, TextTokenizer
from sharpclip.eval.embed import ModelEmbedder
from sharpclip.models.tokenizer import build_word_tokenizer


class PixelMean(torch.nn.Module):
    """A stand-in model: the per-channel pixel mean as a 3-d 'embedding' (no tower cost)."""

    def encode_image(self, pixel_values: torch.Tensor, tokens: bool = False) -> torch.Tensor:
        return pixel_values.mean((2, 3))

    def encode_text(self, input_ids, attention_mask=None, tokens: bool = False) -> torch.Tensor:
        return input_ids.float()[:, :3]


def training_rate(root: str, preprocessing: Preprocessing, workers: int, draft: bool, batch: int) -> float:
    cfg = DataConfig(format="generic", root=root, num_workers=workers, jpeg_draft=draft, shuffle=False,
                     group_batches=False)  # fmt: skip
    loader = build_loader(cfg, "train", preprocessing, batch_size=batch)
    for epoch in range(2):  # the first epoch starts the persistent workers
        loader.set_epoch(epoch)
        start, seen = time.perf_counter(), 0
        for b in loader:
            seen += len(b)
    rate = seen / (time.perf_counter() - start)
    del loader
    return rate


def validation_rate(files: list[str], preprocessing: Preprocessing, workers: int, draft: bool, batch: int) -> float:
    embedder = ModelEmbedder(PixelMean(), preprocessing.image, preprocessing.text, batch, "cpu", False, draft, workers)
    start = time.perf_counter()
    embedder.images(files)
    return len(files) / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--photos", type=int, default=256)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="validation-bench-")
    try:
        make_photos(root, args.photos)
        files = sorted(str(f) for f in Path(root, "img").iterdir())
        prep = Preprocessing(ClipImageTransform(args.size), TextTokenizer(build_word_tokenizer(PHOTO_WORDS), 77))
        runs = []
        for draft in (False, True):
            train = training_rate(root, prep, args.workers, draft, args.batch_size)
            before = validation_rate(files, prep, 0, draft, args.batch_size)
            after = validation_rate(files, prep, args.workers, draft, args.batch_size)
            runs.append({"jpeg_draft": draft, "training_loader_img_per_s": round(train, 1),
                         "validation_in_process_img_per_s": round(before, 1),
                         "validation_workers_img_per_s": round(after, 1),
                         "before_over_training": round(before / train, 3),
                         "after_over_training": round(after / train, 3)})  # fmt: skip
        report = {"photos": args.photos, "size": args.size, "batch_size": args.batch_size, "workers": args.workers,
                  "threads": torch.get_num_threads(), "runs": runs, "target_after_over_training": 0.9,
                  "meets_target": all(r["after_over_training"] >= 0.9 for r in runs)}  # fmt: skip
        print(json.dumps(report, indent=2))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
