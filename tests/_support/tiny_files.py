"""A tiny generic-format dataset on disk (PNG files + JSON Lines) and a `Config` that trains the tiny CLIP on it.

For tests of `run_train` and the CLI that need real files, run directories and checkpoints, in about a second.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

from _support.tiny_run import caption
from sharpclip.config import Config, load_config


def write_image_folder(folder: Path, n: int = 4) -> Path:
    """An image-folder dataset: `n` coloured 32-px JPEGs `NNNNN.jpg`, each beside its caption `NNNNN.txt`."""
    folder.mkdir(parents=True)
    for i in range(n):
        Image.new("RGB", (32, 32), (60 * i, 80, 120)).save(folder / f"{i:05d}.jpg")
        (folder / f"{i:05d}.txt").write_text(f"square {i}")
    return folder


def write_generic(root: Path, n: int = 8, splits: tuple[str, ...] = ("train", "test")) -> Path:
    """`root/<split>.jsonl` of `n` rows each, with `n` small random PNGs per split under `root/images/`
    (`<split>-<i>.png`: splits share no image, as training refuses a validation split that overlaps it)."""
    images = root / "images"
    images.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for split in splits:
        for i in range(n):
            Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(images / f"{split}-{i}.png")
        rows = [{"id": f"{split}-{i}", "image": f"images/{split}-{i}.png", "caption": caption(i)} for i in range(n)]
        (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def write_captions(root: Path, captions: list[str], split: str = "test") -> Path:
    """`root/<split>.jsonl` with one 4 × 4 black PNG per caption (`<i>.png`): a suite whose captions are the test's
    subject and whose pixels do not matter."""
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, text in enumerate(captions):
        Image.new("RGB", (4, 4)).save(root / f"{i}.png")
        rows.append({"id": str(i), "image": f"{i}.png", "caption": text})
    (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def tiny_config(root: Path, out: Path, *overrides: str) -> Config:
    """Tiny CLIP on the generic data at `root`, 2 steps of batch 4, a checkpoint every step, into `out`; batches are
    decoded in the test process (data.num_workers=0: worker start-up would cost more than these runs)."""
    base = [
        "model.name=tiny-clip", "data.format=generic", f"data.root={root}", "data.num_workers=0",
        f"train.output_dir={out}", "train.batch_size=4", "train.micro_batch_size=4", "train.max_steps=2",
        "train.epochs=1", "train.lr=1e-3", "train.checkpoint_every=1", "train.keep_last=5", "train.progress=false",
    ]  # fmt: skip
    return load_config(None, [*base, *overrides])
