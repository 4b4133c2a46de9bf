"""Data speed: SynthDense generation and loading, and the loader on realistic photos against a bare PIL loop.

    python benchmarks/data_throughput.py [--out DIR] [--samples 4096] [--batch-size 128] [--photos 128]
    python benchmarks/data_throughput.py --photos-only                 (only the photo part)

Prints one JSON object.

SynthDense: generation time of ~10,000 images at 64 px, and loader samples/s with 0, 1, 2 workers (PNG decode + CLIP
preprocessing + batched tokenisation into a `Batch`; worker start-up excluded: the first batch is a warm-up).

Photos: `--photos` 1500×1000 JPEGs made in code (smooth gradients, shapes and sensor-like noise, quality 90: what a
camera photo costs to decode), loaded to 224 and 336 px with 0, 1, 2 workers, JPEG draft decoding on and off. The
baseline is a bare loop in one process: PIL open, (draft,) RGB, resize, centre crop, normalise with numpy, timed right
before each loader run so that the pair shares the machine's load. Each loader runs one warm-up epoch (worker
start-up) and one timed epoch with its workers kept (as training runs them).
`per_worker_over_bare` = loader img/s / (max(workers, 1) × bare img/s); target ≥ 0.95.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np
import torch
from PIL import Image, ImageDraw

from sharpclip.config import DataConfig, SynthDenseConfig
from sharpclip.data import build_loader
from sharpclip.data.images import request_draft
from sharpclip.data.synthdense.corpus import generate
from sharpclip.data.synthdense.edits import MMVP_PATTERNS
from sharpclip.data.transforms import CLIP_MEAN, CLIP_STD, ClipImageTransform, Preprocessing, TextTokenizer
from sharpclip.models.tokenizer import build_word_tokenizer, synthdense_tokenizer

PHOTO_SIZE = (1500, 1000)
PHOTO_WORDS = ["a", "photo", "of", "red", "green", "blue", "circle", "square", "on", "the", "left", "right"]

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
    cfg = DataConfig(root=root, synthdense=CORPUS, num_workers=workers, jpeg_draft=False)
    preprocessing = Preprocessing(ClipImageTransform(64), TextTokenizer(synthdense_tokenizer(), 160))
    loader = build_loader(cfg, "train", preprocessing, batch_size=batch_size)
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


def make_photos(root: str, n: int) -> None:
    """`n` photo-like JPEGs and a generic-format train.jsonl naming them."""
    rng = np.random.default_rng(0)
    w, h = PHOTO_SIZE
    x, y = np.meshgrid(np.linspace(0, 1, w, dtype=np.float32), np.linspace(0, 1, h, dtype=np.float32))
    os.makedirs(os.path.join(root, "img"), exist_ok=True)
    with open(os.path.join(root, "train.jsonl"), "w") as f:
        for i in range(n):
            c = rng.uniform(0.2, 1.0, 3).astype(np.float32)
            base = np.stack([x * c[0], y * c[1], (1 - x) * c[2]], -1) * 220
            base += rng.normal(0, 10, (h, w, 3)).astype(np.float32)  # sensor noise: what makes photos costly to code
            image = Image.fromarray(base.clip(0, 255).astype(np.uint8))
            draw = ImageDraw.Draw(image)
            for _ in range(6):
                x0, y0 = int(rng.integers(0, w - 200)), int(rng.integers(0, h - 200))
                box = (x0, y0, x0 + int(rng.integers(50, 200)), y0 + int(rng.integers(50, 200)))
                draw.ellipse(box, fill=tuple(int(v) for v in rng.integers(0, 255, 3)))
            image.save(os.path.join(root, "img", f"{i:05d}.jpg"), quality=90)
            caption = " ".join(rng.choice(PHOTO_WORDS, 12))
            f.write(json.dumps({"id": str(i), "image": f"img/{i:05d}.jpg", "caption": caption}) + "\n")


def bare_loop(root: str, size: int, draft: bool) -> float:
    """img/s of PIL open + (draft) + RGB + resize + centre crop + numpy normalise, in this process."""
    files = sorted(os.listdir(os.path.join(root, "img")))
    mean = np.asarray(CLIP_MEAN, dtype=np.float32)[:, None, None]
    std = np.asarray(CLIP_STD, dtype=np.float32)[:, None, None]
    start = time.perf_counter()
    for name in files:
        with Image.open(os.path.join(root, "img", name)) as im:
            if draft:
                request_draft(im, size)
            im = im.convert("RGB")
        w, h = im.size
        scale = size / min(w, h)
        im = im.resize((max(size, int(w * scale)), max(size, int(h * scale))), Image.BICUBIC)
        left, top = (im.size[0] - size) // 2, (im.size[1] - size) // 2
        pixels = np.asarray(im.crop((left, top, left + size, top + size)), dtype=np.float32).transpose(2, 0, 1)
        torch.from_numpy((pixels / 255.0 - mean) / std)
    return len(files) / (time.perf_counter() - start)


def photo_loader(root: str, size: int, workers: int, draft: bool, batch_size: int) -> float:
    """img/s of the training loader over one epoch, after a warm-up epoch, workers kept between them."""
    cfg = DataConfig(format="generic", root=root, num_workers=workers, jpeg_draft=draft, shuffle=False,
                     group_batches=False)  # fmt: skip
    preprocessing = Preprocessing(ClipImageTransform(size), TextTokenizer(build_word_tokenizer(PHOTO_WORDS), 77))
    loader = build_loader(cfg, "train", preprocessing, batch_size=batch_size)
    for epoch in range(2):
        loader.set_epoch(epoch)
        start, seen = time.perf_counter(), 0
        for batch in loader:
            seen += len(batch)
    rate = seen / (time.perf_counter() - start)
    del loader
    return rate


def time_photos(n: int, batch_size: int) -> dict:
    root = tempfile.mkdtemp(prefix="photo-bench-")
    try:
        start = time.perf_counter()
        make_photos(root, n)
        out: dict = {"photos": n, "photo_size": list(PHOTO_SIZE), "made_in_s": round(time.perf_counter() - start, 1)}
        runs = []
        for size in (224, 336):
            for draft in (False, True):
                for workers in (0, 1, 2):  # the bare loop right before each loader: the pair sees the same machine
                    bare = bare_loop(root, size, draft)
                    rate = photo_loader(root, size, workers, draft, batch_size)
                    runs.append({"size": size, "draft": draft, "workers": workers, "img_per_s": round(rate, 1),
                                 "bare_loop_img_per_s": round(bare, 1),
                                 "per_worker_over_bare": round(rate / (max(workers, 1) * bare), 3)})  # fmt: skip
        out["runs"] = runs
        out["draft_speedup"] = {
            f"{size}px/{w}_workers": round(_rate(runs, size, True, w) / _rate(runs, size, False, w), 2)
            for size in (224, 336)
            for w in (0, 1, 2)
        }
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _rate(runs: list[dict], size: int, draft: bool, workers: int) -> float:
    return next(r["img_per_s"] for r in runs if (r["size"], r["draft"], r["workers"]) == (size, draft, workers))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="where to generate (default: a temporary folder, removed afterwards)")
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--photos", type=int, default=128, help="1500×1000 JPEGs for the photo part (0: skip it)")
    parser.add_argument("--photos-only", action="store_true", help="skip the SynthDense part")
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    result: dict = {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if not args.photos_only:
        root = args.out or tempfile.mkdtemp(prefix="synthdense-bench-")
        try:
            result["generation"] = time_generation(root)
            result["loader"] = [time_loader(root, w, args.samples, args.batch_size) for w in (0, 1, 2)]
        finally:
            if not args.out:
                shutil.rmtree(root, ignore_errors=True)
    if args.photos:
        result["photos"] = time_photos(args.photos, batch_size=32)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
