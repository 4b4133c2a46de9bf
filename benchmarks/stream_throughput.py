"""Streamed webdataset shards vs the indexed generic reader over the same JPEGs: loader samples/s, interleaved.

    python benchmarks/stream_throughput.py [--images 4096] [--shards 8] [--batch-size 128] [--workers 0 2]

Prints one JSON object. Both loaders decode the same 64 × 48 JPEGs, preprocess them to 32 px and tokenise their
captions into a `Batch`; the stream also reads the tar files and passes a shuffle buffer of 1,000. Rounds alternate
between the two so that a busy machine slows both alike; the ratio `stream_over_indexed` is what to read.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import tarfile
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image

from sharpclip.config import DataConfig
from sharpclip.data import build_loader
from sharpclip.data.transforms import ClipImageTransform, Preprocessing, TextTokenizer
from sharpclip.models.tokenizer import build_word_tokenizer

WORDS = ["a", "photo", "of", "shade", "number", *[str(d) for d in range(10)]]


def write_corpus(root: Path, images: int, shards: int) -> None:
    """The same pairs twice: `train.jsonl` + `img/` (generic) and `shards/train-N.tar` (webdataset)."""
    (root / "img").mkdir(parents=True)
    (root / "shards").mkdir()
    rows = []
    with contextlib.ExitStack() as stack:
        tars = [stack.enter_context(tarfile.open(root / "shards" / f"train-{s:05d}.tar", "w")) for s in range(shards)]
        for i in range(images):
            buf = io.BytesIO()
            Image.effect_noise((64, 48), 40 + i % 50).convert("RGB").save(buf, "JPEG")
            caption = f"a photo of shade number {' '.join(str(i))}"
            (root / "img" / f"{i}.jpg").write_bytes(buf.getvalue())
            rows.append(json.dumps({"image": f"img/{i}.jpg", "caption": caption}))
            for ext, data in (("jpg", buf.getvalue()), ("txt", caption.encode())):
                info = tarfile.TarInfo(f"{i:08d}.{ext}")
                info.size = len(data)
                tars[i % shards].addfile(info, io.BytesIO(data))
    (root / "train.jsonl").write_text("\n".join(rows) + "\n")


def rate(cfg: DataConfig, batch_size: int) -> tuple[int, float]:
    """(samples, seconds) for one epoch after the first batch (worker start-up excluded)."""
    preprocessing = Preprocessing(ClipImageTransform(32), TextTokenizer(build_word_tokenizer(WORDS), 16))
    loader = build_loader(cfg, "train", preprocessing, batch_size=batch_size, seed=0)
    it = iter(loader)
    next(it)
    seen, start = 0, time.perf_counter()
    for batch in it:
        seen += len(batch)
    return seen, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=4096)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    root = Path(tempfile.mkdtemp(prefix="stream-bench-"))
    try:
        write_corpus(root, args.images, args.shards)
        result: dict = {"cpus": os.cpu_count(), "images": args.images, "shards": args.shards, "runs": []}
        for workers in args.workers:
            common = {"num_workers": workers}  # 32 px, 16 tokens: rate()'s preprocessing
            indexed = DataConfig(format="generic", root=str(root), **common)
            stream = DataConfig(format="webdataset", root=str(root / "shards"), **common)
            totals = {"indexed": [0, 0.0], "stream": [0, 0.0]}
            for _ in range(args.rounds):
                for name, cfg in (("indexed", indexed), ("stream", stream)):
                    n, s = rate(cfg, args.batch_size)
                    totals[name][0] += n
                    totals[name][1] += s
            per_s = {k: n / s for k, (n, s) in totals.items()}
            result["runs"].append({
                "workers": workers,
                **{f"{k}_samples_per_s": round(v) for k, v in per_s.items()},
                "stream_over_indexed": round(per_s["stream"] / per_s["indexed"], 3),
            })  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
