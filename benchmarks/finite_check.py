"""The cost of the trainer's after-update check that every weight is finite, relative to one training step, as JSON.

    python benchmarks/finite_check.py [--repeats 50] [--batch 32]

`train.trainer.largest_weight` (max |w| over the trainable parameters by aminmax, one device sync) is timed
many times on the small CLIP (benchmarks/_small_model.py, 4 + 4 layers of width 256) and divided by the median time
of a whole optimiser step on a batch of `--batch` (InfoNCE, exact accumulation). Target: `check_share_of_step` ≤ 0.01.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from _small_model import random_batch, small_clip
from sharpclip.config import LossConfig, TermConfig
from sharpclip.train.features import FeatureEncoder, build_objective
from sharpclip.train.optim import build_optimizer
from sharpclip.train.step import run_step
from sharpclip.train.trainer import largest_weight


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    model = small_clip().train()
    params = [p for p in model.parameters() if p.requires_grad]
    batch = random_batch(args.batch)
    optimizer = build_optimizer(model, 1e-5, 0.1)
    objective = build_objective(LossConfig(terms={"clip": TermConfig("infonce")}))
    encoder = FeatureEncoder(model, objective.feature_keys)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        run_step(encoder, objective, batch, args.batch)
        optimizer.step()

    step()  # warm-up
    step_s = _median_seconds(step, max(3, args.repeats // 10))
    check_s = _median_seconds(lambda: largest_weight(params), args.repeats)
    print(
        json.dumps(
            {
                "check_share_of_step": round(check_s / step_s, 5),
                "check_ms": round(1000 * check_s, 3),
                "step_ms": round(1000 * step_s, 1),
                "parameters": sum(p.numel() for p in params),
                "batch": args.batch,
                "threads": torch.get_num_threads(),
                "target": {"check_share_of_step": 0.01},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
