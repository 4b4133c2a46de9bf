"""Training throughput with `infonce`, with `hn_clip` (the boost alone) and with `hn_clip` + `filip`, as JSON.

    python benchmarks/train_step.py [--repeats 7] [--batch 128] [--micro 32]

One optimiser step of the small CLIP (benchmarks/_small_model.py) on a batch of 128 under exact accumulation, the
objectives interleaved step by step on the same model and batch so machine noise hits all alike; medians reported.
`hn_over_infonce_step_time` is the boost's cost relative to an InfoNCE step. Target: ≤ 1.01 (the HN-CLIP paper
measured 4.7% for its implementation).

Whole steps take seconds here and vary by more than 1% between repeats on a shared machine, so the boost's share is
also measured directly: the extra time of the `hn_clip` loss (forward + backward on the step's global features,
many repeats) over the `infonce` loss, divided by the median InfoNCE step (`boost_share_of_step`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from _small_model import random_batch, small_clip
from sharpclip.config import LossConfig, TermConfig
from sharpclip.losses import hn_clip, infonce
from sharpclip.train.features import FeatureEncoder, build_objective
from sharpclip.train.optim import build_optimizer
from sharpclip.train.step import run_step

OBJECTIVES = {
    "infonce": {"clip": TermConfig("infonce")},
    "hn_clip": {"hn": TermConfig("hn_clip")},
    "hn_clip+filip": {"hn": TermConfig("hn_clip"), "tok": TermConfig("filip")},
}


def boost_seconds(model, batch, repeats: int = 200) -> float:
    """Median extra seconds of the hn_clip loss over infonce (forward + backward) on this batch's features."""
    with torch.no_grad():
        image = model.encode_image(batch.pixel_values).embedding
        text = model.encode_text(batch.input_ids, batch.attention_mask).embedding
    image, text = image.requires_grad_(), text.requires_grad_()

    def timed(loss_fn) -> float:
        start = time.perf_counter()
        loss_fn(image, text, model.logit_scale).backward()
        return time.perf_counter() - start

    extra = [timed(hn_clip) - timed(infonce) for _ in range(repeats)]
    return max(0.0, statistics.median(extra))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--micro", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    model = small_clip().train()
    batch = random_batch(args.batch)
    optimizer = build_optimizer(model, 1e-5, 0.1)
    runners = {}
    for name, terms in OBJECTIVES.items():
        objective = build_objective(LossConfig(terms=terms))
        runners[name] = (FeatureEncoder(model, objective.feature_keys), objective)

    def step(name: str) -> float:
        encoder, objective = runners[name]
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        run_step(encoder, objective, batch, args.micro)
        optimizer.step()
        return time.perf_counter() - start

    for name in runners:  # warm-up
        step(name)
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.repeats):
        for name in runners:
            times[name].append(step(name))
    med = {name: statistics.median(t) for name, t in times.items()}
    boost = boost_seconds(model, batch)
    print(
        json.dumps(
            {
                "samples_per_s": {name: round(args.batch / t, 2) for name, t in med.items()},
                "hn_over_infonce_step_time": round(med["hn_clip"] / med["infonce"], 4),
                "hn_filip_over_infonce_step_time": round(med["hn_clip+filip"] / med["infonce"], 4),
                "boost_share_of_step": round(boost / med["infonce"], 5),
                "median_step_s": {name: round(t, 3) for name, t in med.items()},
                "batch": args.batch,
                "micro_batch": args.micro,
                "repeats": args.repeats,
                "threads": torch.get_num_threads(),
                "target": {"hn_over_infonce_step_time": 1.01},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
