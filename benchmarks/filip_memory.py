"""Peak memory and time of the chunked `filip` loss (forward + backward) at the paper's scale, as JSON.

    python benchmarks/filip_memory.py [--batch 128] [--words 248] [--patches 256] [--dim 768] [--chunk 8]

The full (B_img, B_txt, P, L) similarity tensor of 128 × 128 × 256 × 248 floats would take 4.2 GB on its own; the
loss builds it `--chunk` images at a time. The peak is measured as in accumulation_memory.py: the kernel's peak-RSS
counter is reset after the inputs exist, and the step's memory is the new peak minus the RSS before it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sharpclip.losses import filip


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status (this benchmark needs Linux)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--words", type=int, default=248)
    parser.add_argument("--patches", type=int, default=256)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--chunk", type=int, default=8)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    image = F.normalize(torch.randn(args.batch, args.patches, args.dim, generator=g), dim=-1).requires_grad_()
    text = F.normalize(torch.randn(args.batch, args.words, args.dim, generator=g), dim=-1).requires_grad_()
    lengths = torch.randint(args.words // 4, args.words + 1, (args.batch, 1), generator=g)
    mask = torch.arange(args.words)[None, :] < lengths
    scale = torch.tensor(4.6, requires_grad=True)
    Path("/proc/self/clear_refs").write_text("5")
    before = _status("VmRSS")
    start = time.perf_counter()
    filip(image, text, scale, None, mask, chunk_size=args.chunk).backward()
    seconds = time.perf_counter() - start
    full = args.batch * args.batch * args.patches * args.words * 4
    print(
        json.dumps(
            {
                "peak_extra_gib": round((_status("VmHWM") - before) / 2**30, 3),
                "full_similarity_tensor_gib": round(full / 2**30, 3),
                "seconds": round(seconds, 2),
                **vars(args),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
