"""The engine against the reducer it replaced, on 2 gloo ranks: step time and bytes held per rank.

    python benchmarks/engine_speed.py [--steps 8] [--out engine_speed.json]

Launches itself under torchrun on 2 CPU processes. Each rank holds the small CLIP of `_small_model` (4 + 4 layers of
width 256) three times, trained side by side from the same weights: under the old reducer (`_old_reducer.GradSync`,
bucketed all-reduces from Python hooks), under FSDP2 with `train.layout: replicate`, and under FSDP2 with
`train.layout: shard`. One step = `run_step` (HN-CLIP, per_micro_batch, 32 rows a rank in 2 passes of 16, so the
first pass runs with gradient sync off), gradient clipping and AdamW. The three alternate step by step (so load on
the machine hits all three alike); the first 2 steps of each are warm-up. Printed (and written to --out): the median
step time of each, FSDP2's over the reducer's, the three final losses (equal), and per rank the bytes of the
parameters, gradients, AdamW state and reducer buckets each holds after a step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist

from _old_reducer import GradSync
from _small_model import random_batch, small_clip
from sharpclip.config import LossConfig, TermConfig
from sharpclip.train import distributed
from sharpclip.train.engine import local
from sharpclip.train.features import FeatureEncoder, build_objective
from sharpclip.train.optim import build_optimizer
from sharpclip.train.parallel import ParallelContext
from sharpclip.train.step import run_step

ROWS, MICRO, WARMUP = 32, 16, 2


class ReducerContext(ParallelContext):
    """The step's context with the old reducer in the engine's place (per_micro_batch only, as it ran then)."""

    def __init__(self, sync: GradSync, **kwargs):
        super().__init__(**kwargs)
        self.sync = sync

    def accumulating(self):
        return self.sync.no_sync()

    def finish_step(self) -> None:
        self.sync.finish()


class Setup:
    """One of the compared set-ups: a model, its context, optimiser and the clipping it uses."""

    def __init__(self, name: str, rank: int, world: int):
        self.name, self.model = name, small_clip()
        self.objective = build_objective(LossConfig(terms={"hn": TermConfig("hn_clip")}))
        self.encoder = FeatureEncoder(self.model, self.objective.feature_keys)
        if name == "reducer":
            params = [p for p in self.model.parameters() if p.requires_grad]
            self.sync = GradSync(params)
            self.ctx = ReducerContext(self.sync, rank=rank, world=world)
        else:
            self.sync = None
            self.ctx = ParallelContext(rank=rank, world=world, local_world=world, layout=name.split(":")[1])
            self.ctx.shard(self.model, torch.device("cpu"))
        self.optimizer = build_optimizer(self.model, 1e-4, 0.1)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.times: list[float] = []
        self.loss = 0.0

    def step(self, batch) -> None:
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        if self.sync is not None:
            self.sync.start()
        result = run_step(self.encoder, self.objective, batch, MICRO, "per_micro_batch", ctx=self.ctx)
        if self.ctx.engine is not None:
            norm = self.ctx.engine.clip_grad_norm(self.params, 1.0)
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.loss = result.read(grad_norm=norm).terms["loss"]
        self.optimizer.step()
        self.times.append(time.perf_counter() - start)

    def bytes_held(self) -> dict[str, int]:
        size = lambda ts: sum(local(t).numel() * local(t).element_size() for t in ts)  # noqa: E731
        state = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        buckets = [b.flat for b in self.sync.buckets] if self.sync is not None else []
        return {"parameters": size(self.params), "gradients": size([p.grad for p in self.params if p.grad is not None]),
                "optimizer_state": size(state), "reducer_buckets": size(buckets)}  # fmt: skip


def worker(steps: int, out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    paths = [Setup(name, rank, world) for name in ("reducer", "fsdp2:replicate", "fsdp2:shard")]
    batches = [random_batch(ROWS * world, seed=k) for k in range(steps)]
    for batch in batches:
        mine = type(batch)(**{k: (v[rank * ROWS : (rank + 1) * ROWS] if torch.is_tensor(v) else v)
                              for k, v in vars(batch).items()})  # fmt: skip
        mine.ids = batch.ids[rank * ROWS : (rank + 1) * ROWS]
        for path in paths:
            path.step(mine)
    held = [p.bytes_held() for p in paths]
    every = [None] * world
    dist.all_gather_object(every, held)
    if rank == 0:
        median = {p.name: statistics.median(p.times[WARMUP:]) for p in paths}
        report = {
            "benchmark": "engine_speed", "world": world, "backend": "gloo",
            "model": "small_clip (4 + 4 layers, width 256)",
            "rows_per_rank": ROWS, "micro_batch": MICRO, "accumulation": "per_micro_batch", "steps": steps,
            "median_step_s": {k: round(v, 4) for k, v in median.items()},
            "fsdp2_replicate_over_reducer": round(median["fsdp2:replicate"] / median["reducer"], 3),
            "fsdp2_shard_over_reducer": round(median["fsdp2:shard"] / median["reducer"], 3),
            "final_loss": {p.name: p.loss for p in paths},
            "bytes_per_rank": {p.name: [h[i] for h in every] for i, p in enumerate(paths)},
        }  # fmt: skip
        text = json.dumps(report, indent=1)
        print(text)
        if out:
            Path(out).write_text(text + "\n")
    distributed.shutdown()  # collects garbage first (gloo's threads, train.distributed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.steps, args.out)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
           "--worker", "--steps", str(args.steps), "--out", args.out]  # fmt: skip
    raise SystemExit(subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode)


if __name__ == "__main__":
    main()
