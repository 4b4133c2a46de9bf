"""Per-micro-batch training (HN-CLIP's 16 × 8) encoded one micro-batch a pass or several a pass, as JSON.

    python benchmarks/encode_passes.py [--repeats 5] [--batch 128] [--micro 16] [--model small|demo]

Under `train.accumulation: per_micro_batch` every micro-batch is its own contrastive matrix; `train.encode_batch_size`
only sets how many rows go through the towers in one forward pass (the gradients are the same: tested in
tests/train/test_train_accumulate.py). This times one optimiser step (InfoNCE) at each pass size, interleaved on the
same model and batch so machine noise hits all alike, and reports medians and each size's speed-up over one
micro-batch a pass. `--model demo` is the demo's tiny CLIP (width 64, 2 layers, 48 px, 152 tokens), `small` the
benchmarks' 4 + 4 layers of width 256 (benchmarks/_small_model.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from _small_model import random_batch, small_clip
from sharpclip.config import LossConfig, TermConfig, TinyConfig
from sharpclip.data.schema import Batch
from sharpclip.models.tiny import tiny_model
from sharpclip.models.tokenizer import vocabulary
from sharpclip.train.features import FeatureEncoder, build_objective
from sharpclip.train.optim import build_optimizer
from sharpclip.train.step import run_step


def demo_model_and_batch(rows: int):
    """The demo's fine-tuning model shape with captions of 90-139 tokens (SynthDense's dense captions)."""
    size = TinyConfig(width=64, layers=2, image_size=48, patch_size=8, context_length=152)
    model = tiny_model("clip", vocabulary(), size=size)
    g = torch.Generator().manual_seed(0)
    vocab, eos = len(model.tokenizer), model.end_of_text_id()
    lengths = torch.randint(90, 140, (rows,), generator=g)
    width = int(lengths.max()) + 1
    positions = torch.arange(width)[None, :]
    ids = torch.randint(1, vocab - 2, (rows, width), generator=g).masked_fill(positions >= lengths[:, None], eos)
    pixels = torch.randn(rows, 3, 48, 48, generator=g)
    mask = (positions <= lengths[:, None]).long()
    batch = Batch([f"row-{i}" for i in range(rows)], pixels, ids, mask, groups=torch.arange(rows))
    return model, batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--micro", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", choices=("small", "demo"), default="demo")
    args = parser.parse_args()
    if args.model == "demo":
        model, batch = demo_model_and_batch(args.batch)
    else:
        model, batch = small_clip(), random_batch(args.batch)
    model.train()
    optimizer = build_optimizer(model, 1e-5, 0.1)
    objective = build_objective(LossConfig(terms={"clip": TermConfig("infonce")}))
    encoder = FeatureEncoder(model, objective.feature_keys)
    sizes = [s for s in (args.micro, 2 * args.micro, 4 * args.micro, args.batch) if args.batch % s == 0]
    sizes = list(dict.fromkeys(sizes))

    def step(size: int) -> float:
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        run_step(encoder, objective, batch, args.micro, "per_micro_batch", encode_batch_size=size)
        optimizer.step()
        return time.perf_counter() - start

    for size in sizes:  # warm-up
        step(size)
    times: dict[int, list[float]] = {size: [] for size in sizes}
    for _ in range(args.repeats):
        for size in sizes:
            times[size].append(step(size))
    med = {size: statistics.median(t) for size, t in times.items()}
    base = med[args.micro]
    print(
        json.dumps(
            {
                "speedup_over_one_micro_batch_a_pass": {str(s): round(base / t, 3) for s, t in med.items()},
                "median_step_s": {str(s): round(t, 4) for s, t in med.items()},
                "model": args.model,
                "batch": args.batch,
                "micro_batch": args.micro,
                "repeats": args.repeats,
                "threads": torch.get_num_threads(),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
