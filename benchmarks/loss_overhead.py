"""Forward+backward time of `hn_clip` over `infonce`, loss only, D = 768, as one JSON object.

    python benchmarks/loss_overhead.py [--repeats 30] [--sizes 128 512 1024]

Both losses run interleaved on the same inputs and the ratio of medians is reported, so machine noise hits both
alike. `naive_over_infonce` times a straightforward implementation of eq. 2 (Ḡ as a separate detached product,
masked with (1 − I)) for comparison. Target: hn_over_infonce ≤ 1.33 at B = 1024 (one extra detached B×B×D
product would cost 4/3 of InfoNCE's three).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from sharpclip.losses import hn_clip, infonce


def naive_hn(image, text, logit_scale, gamma=0.5):
    g = (text @ text.t()).detach() * (1 - torch.eye(text.shape[0]))
    logits = logit_scale.exp() * (image @ text.t() + gamma * g)
    labels = torch.arange(text.shape[0])
    return 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels))


def _time(fn, image, text, scale) -> float:
    image.grad = text.grad = scale.grad = None
    start = time.perf_counter()
    fn(image, text, scale).backward()
    return time.perf_counter() - start


def measure(batch: int, dim: int, repeats: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(batch)
    image = F.normalize(torch.randn(batch, dim, generator=g), dim=-1).requires_grad_()
    text = F.normalize(torch.randn(batch, dim, generator=g), dim=-1).requires_grad_()
    scale = torch.tensor(4.0, requires_grad=True)
    fns = {"infonce": infonce, "hn_clip": hn_clip, "naive": naive_hn}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(3):  # warm-up
        for fn in fns.values():
            _time(fn, image, text, scale)
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(_time(fn, image, text, scale))
    med = {name: statistics.median(t) for name, t in times.items()}
    return {"infonce_ms": 1e3 * med["infonce"], "hn_ms": 1e3 * med["hn_clip"], "naive_ms": 1e3 * med["naive"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    rows = {str(b): measure(b, args.dim, args.repeats) for b in args.sizes}
    print(
        json.dumps(
            {
                "hn_over_infonce": {b: round(r["hn_ms"] / r["infonce_ms"], 3) for b, r in rows.items()},
                "naive_over_infonce": {b: round(r["naive_ms"] / r["infonce_ms"], 3) for b, r in rows.items()},
                "median_ms": {b: {k: round(v, 3) for k, v in r.items()} for b, r in rows.items()},
                "dim": args.dim,
                "repeats": args.repeats,
                "threads": torch.get_num_threads(),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
