"""What `sharpclip search` pays before it answers, the current path beside the cached one, in one run.

    python benchmarks/search_overhead.py [--width 512] [--layers 6] [--members 60000] [--reads 50]

- **weights digest**: `weights_sha256` (sha256 of every tensor, what the index manifest names) of a CLIP built in
  code and saved as a safetensors file, against `cached_weights_sha256` on the second load of the same unchanged
  file (the digest read back from the cache, keyed by the file's path, size and mtime).
- **zip members**: `--reads` images read from a zip of `--members` small PNGs the old way (the archive's central
  directory parsed for each image, `zipfile.ZipFile` per read) against `eval.embed.load_image`, which reads through
  one archive kept open per process.

One JSON object on stdout: seconds per call of each path and their ratio.
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import time
import zipfile
from pathlib import Path

import torch
from PIL import Image
from safetensors.torch import save_file
from transformers import CLIPConfig, CLIPModel

from sharpclip.eval.embed import ImageRef, load_image
from sharpclip.eval.manifest import cached_weights_sha256, weights_sha256


def _seconds(fn, repeat: int = 1) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def digest_times(width: int, layers: int, tmp: Path) -> dict:
    text = {"hidden_size": width, "intermediate_size": 4 * width, "num_hidden_layers": layers,
            "num_attention_heads": width // 64}  # fmt: skip
    vision = {**text, "image_size": 224, "patch_size": 32}
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=width))
    weights = tmp / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights))
    params = sum(p.numel() for p in model.parameters())
    full = _seconds(lambda: weights_sha256(model))
    cached_weights_sha256(model, [weights], "bench", tmp / "cache")  # the first load: hashed and remembered
    cached = _seconds(lambda: cached_weights_sha256(model, [weights], "bench", tmp / "cache"), repeat=5)
    return {"parameters": params, "weights_sha256_s": round(full, 4), "cached_s": round(cached, 6),
            "ratio": round(full / cached, 1)}  # fmt: skip


def zip_times(members: int, reads: int, tmp: Path) -> dict:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(buf, format="PNG")
    archive = tmp / "images.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_STORED) as z:
        for i in range(members):
            z.writestr(f"images/{i:06d}.png", buf.getvalue())
    names = [f"images/{i * (members // reads):06d}.png" for i in range(reads)]

    def per_read() -> None:  # the path before: the central directory parsed for every image
        for name in names:
            with open(archive, "rb") as f, zipfile.ZipFile(f) as z:
                Image.open(io.BytesIO(z.read(name))).convert("RGB")

    def one_archive() -> None:
        for name in names:
            load_image(ImageRef(str(archive), member=name))

    before, after = _seconds(per_read) / reads, _seconds(one_archive) / reads
    return {"members": members, "reads": reads, "zipfile_per_read_s": round(before, 5),
            "one_open_archive_s": round(after, 6), "ratio": round(before / after, 1)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--members", type=int, default=60_000)
    ap.add_argument("--reads", type=int, default=50)
    args = ap.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        out = {"weights_digest": digest_times(args.width, args.layers, Path(tmp)),
               "zip_members": zip_times(args.members, args.reads, Path(tmp)),
               "torch_threads": torch.get_num_threads()}  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
