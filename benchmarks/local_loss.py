"""Forward+backward cost of one process's share of a loss (local loss: its B/W query rows against all B columns)
over the whole B × B matrix, per loss and world size W, as one JSON object.

    python benchmarks/local_loss.py [--batch 512] [--filip-batch 64] [--worlds 2 4 8] [--repeats 7]

What each of W processes computes under exact accumulation (train.step): the loss with `rows` = its slice. Two
measures: matmul FLOPs of forward+backward (torch.utils.flop_counter, exact and independent of machine load), and
the ratio of median times, full matrix and share interleaved on the same inputs (float32, the CPU or `--device`).
Expected FLOP ratios: 2/W for infonce, hn_clip and FILIP (each process computes its images' rows and its
captions' rows: two (B/W) × B blocks, where the whole matrix computes one B × B block and reads it in both
directions; HN-CLIP's margin rows are fused into both), 1/W for sigmoid (image rows only).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from sharpclip.losses import filip, hn_clip, infonce, sigmoid


def _unit(*shape: int, device: str) -> torch.Tensor:
    return F.normalize(torch.randn(*shape, device=device), dim=-1).requires_grad_()


def _inputs(name: str, batch: int, dim: int, device: str) -> dict[str, torch.Tensor]:
    scale = torch.tensor(4.0, device=device, requires_grad=True)
    if name == "filip":
        return {"image_tokens": _unit(batch, 49, dim, device=device), "text_tokens": _unit(batch, 32, dim,
                device=device), "logit_scale": scale}  # fmt: skip
    return {"image": _unit(batch, dim, device=device), "text": _unit(batch, dim, device=device), "logit_scale": scale}


def _time(fn, inputs: dict, rows: slice | None, device: str) -> float:
    for value in inputs.values():
        value.grad = None
    start = time.perf_counter()
    fn(**inputs, rows=rows).backward()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _flops(fn, inputs: dict, rows: slice | None) -> int:
    counter = FlopCounterMode(display=False)
    with counter:
        fn(**inputs, rows=rows).backward()
    return counter.get_total_flops()


def measure(name: str, fn, batch: int, dim: int, world: int, repeats: int, device: str) -> dict[str, float]:
    inputs = _inputs(name, batch, dim, device)
    share = slice(0, batch // world)
    flops = {"full": _flops(fn, inputs, None), "share": _flops(fn, inputs, share)}
    times: dict[str, list[float]] = {"full": [], "share": []}
    for k in range(repeats + 2):  # the first two are warm-up
        for kind, rows in (("full", None), ("share", share)):
            elapsed = _time(fn, inputs, rows, device)
            if k >= 2:
                times[kind].append(elapsed)
    full, mine = statistics.median(times["full"]), statistics.median(times["share"])
    return {"flops_share_over_full": flops["share"] / flops["full"], "time_share_over_full": mine / full,
            "full_ms": 1e3 * full, "share_ms": 1e3 * mine, "one_over_w": 1 / world}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--filip-batch", type=int, default=64)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--filip-dim", type=int, default=128)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    losses = {"infonce": infonce, "hn_clip": hn_clip, "sigmoid": sigmoid, "filip": filip}
    out: dict = {"device": args.device, "threads": torch.get_num_threads(), "results": {}}
    for name, fn in losses.items():
        batch, dim = (args.filip_batch, args.filip_dim) if name == "filip" else (args.batch, args.dim)
        for world in args.worlds:
            key = f"{name}/B={batch}/W={world}"
            out["results"][key] = measure(name, fn, batch, dim, world, args.repeats, args.device)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
