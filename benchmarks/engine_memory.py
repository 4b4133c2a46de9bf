"""Bytes a rank holds under each layout, one pass and accumulating, beside the memory plan (gloo ranks, CPU).

    python benchmarks/engine_memory.py [--ranks 2] [--out engine_memory.json]

Launches itself under torchrun on `--ranks` CPU processes. Each rank builds the small CLIP of `_small_model`
(4 + 4 layers of width 256) under the engine once per case, fp32, and takes 2 steps (`run_step`, clipping, AdamW):
layouts replicate and shard, and shard with `train.keep_gathered`, each one pass a step (per_micro_batch, one
micro-batch of 16 rows a rank) and accumulating (exact, 4 micro-batches of 4). Bytes in use are glibc's
(`mallinfo2`: small blocks in use plus mmapped ones), sampled around every transformer block's forward and backward
and after every optimiser step, less what the process held before the case's model was built:

- `static`: after the second optimiser step (weights, gradients, AdamW's state: what stays between steps), beside
  the plan's parameters + gradients + optimiser (train.memory_plan.plan for the same model, layout and world);
- `peak`: the most sampled during the second step;
- ratios to the replicate case of the same mode, in one run.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist

from _small_model import random_batch, small_clip
from sharpclip.config import LossConfig, TermConfig
from sharpclip.train import distributed
from sharpclip.train.engine import towers, transformer_blocks
from sharpclip.train.features import FeatureEncoder, build_objective
from sharpclip.train.memory_plan import model_shape, plan
from sharpclip.train.optim import build_optimizer
from sharpclip.train.parallel import ParallelContext
from sharpclip.train.step import run_step

ROWS = 16
CASES = [("replicate", False), ("shard", False), ("shard", True)]  # (layout, keep_gathered)
MODES = {"one pass": ("per_micro_batch", 16), "accumulating": ("exact", 4)}  # accumulation, micro-batch


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip


LIBC = ctypes.CDLL("libc.so.6")
LIBC.mallinfo2.restype = MallInfo2


def in_use() -> int:
    """Bytes glibc's malloc has handed out and not taken back (every arena, plus mmapped blocks)."""
    info = LIBC.mallinfo2()
    return int(info.uordblks + info.hblkhd)


class Sampler:
    """The largest `in_use()` seen at the block hooks since `reset`."""

    def __init__(self, model: torch.nn.Module):
        self.peak = 0
        for tower in towers(model):
            for block in transformer_blocks(tower):
                block.register_forward_pre_hook(lambda *_: self.sample())
                block.register_forward_hook(self._after)

    def sample(self) -> None:
        self.peak = max(self.peak, in_use())

    def _after(self, module, args, out) -> None:
        self.sample()
        hidden = out[0] if isinstance(out, tuple) else out
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(lambda g: self.sample())


def case(layout: str, keep_gathered: bool, mode: str, rank: int, world: int) -> dict:
    accumulation, micro = MODES[mode]
    gc.collect()
    base = in_use()
    model = small_clip()
    objective = build_objective(LossConfig(terms={"c": TermConfig("infonce")}))
    encoder = FeatureEncoder(model, objective.feature_keys)
    ctx = ParallelContext(rank=rank, world=world, local_world=world, layout=layout)
    ctx.shard(model, torch.device("cpu"), "fp32", keep_gathered)
    optimizer = build_optimizer(model, 1e-4, 0.1)
    sampler = Sampler(model)
    params = [p for p in model.parameters() if p.requires_grad]
    batch = random_batch(ROWS, seed=rank)
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        sampler.peak = in_use()
        run_step(encoder, objective, batch, micro, accumulation, ctx=ctx)
        ctx.engine.clip_grad_norm(params, 1.0)
        optimizer.step()
        sampler.sample()
    gc.collect()
    static = in_use() - base
    shape = model_shape(small_clip())
    planned = plan(shape, "fp32", layout, world, world)
    result = {"static": static, "peak": sampler.peak - base,
              "plan_static": planned.parameters + planned.gradients + planned.optimizer}  # fmt: skip
    del model, encoder, optimizer, ctx, sampler, params
    gc.collect()
    return result


def worker(out: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    results = {}
    for mode in MODES:
        for layout, keep in CASES:
            name = f"{mode}/{layout}{', kept gathered' if keep else ''}"
            results[name] = case(layout, keep, mode, rank, world)
    every = distributed.all_ranks(results)
    if rank == 0:
        summary = {"ranks": world, "per_rank_max": {}, "ratios_to_replicate": {}}
        for name in results:
            summary["per_rank_max"][name] = {k: max(r[name][k] for r in every) for k in results[name]}
        for name, row in summary["per_rank_max"].items():
            mode = name.split("/")[0]
            ref = summary["per_rank_max"][f"{mode}/replicate"]
            summary["ratios_to_replicate"][name] = {k: round(row[k] / ref[k], 3) for k in ("static", "peak")}
            summary["ratios_to_replicate"][name]["plan_static"] = round(row["plan_static"] / ref["plan_static"], 3)
        out.write_text(json.dumps(summary, indent=1))
    distributed.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("engine_memory.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.out)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.ranks),
           __file__, "--worker", "--out", str(args.out)]  # fmt: skip
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    print(args.out.read_text())


if __name__ == "__main__":
    main()
