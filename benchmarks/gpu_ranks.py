"""The multi-GPU part of gpu_check.py: the same global batches through `Trainer` on W processes, one JSON line per
step from rank 0, so that runs at different world sizes can be compared.

    python benchmarks/gpu_ranks.py [--model l14] [--steps 10]                    (one process: the reference)
    torchrun --standalone --nproc_per_node 2 benchmarks/gpu_ranks.py [--model l14] [--steps 10]
    torchrun --standalone --nproc_per_node 2 benchmarks/gpu_ranks.py --dry-run    (2 gloo CPU processes, tiny CLIP)

Rank r of W holds rows r·B/W … (r+1)·B/W − 1 of every global batch of B = 128 rows (gpu_step.py's random batches,
captions padded to the batch's longest), so each world size trains the same global batches. Two phases, each from
the same seeded weights, exact accumulation in micro-batches of 32 rows, HN-CLIP + FILIP:

1. `check`: 2 steps at fp32 with TF32 off: each step's loss and gradient norm and, after step 1, a digest of the
   averaged gradient (per trainable tensor: its norm, and its dot product with a seeded standard-normal tensor of
   its shape), which gpu_check.py compares between world sizes;
2. `speed`: `--steps` steps at bf16 (TF32 on, eager towers) for each layout of `--layouts` (train.layout; on one
   process only `replicate`, the engine's absence): the median step time after the first, img/s in all and per
   GPU, peak memory, one row per layout.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from gpu_step import (
    ACCUMULATION,
    OBJECTIVES,
    PRECISION,
    MemoryLoader,
    build_on,
    dry_run_settings,
    emit,
    memory,
    random_batch,
)
from sharpclip import devices
from sharpclip.config import LossConfig, TrainConfig
from sharpclip.train import distributed
from sharpclip.train.features import build_objective
from sharpclip.train.parallel import ParallelContext
from sharpclip.train.step import split_rows
from sharpclip.train.trainer import Trainer

OBJECTIVE = "hn_clip+filip"  # the recipe's terms, and the most gathered features


def digest(params: list[torch.Tensor]) -> dict[str, list[float]]:
    """Per tensor of `params`, in order: the norm of its gradient and the gradient's dot product with a standard
    normal tensor drawn from seed = the tensor's index (one host read for all). Every rank calls it (a sharded
    gradient is gathered whole)."""
    norms, dots = [], []
    for i, p in enumerate(params):
        grad = p.grad if p.grad is not None else torch.zeros(p.shape, device=p.device)
        grad = (grad.full_tensor() if isinstance(grad, DTensor) else grad).float()  # sharded: gathered on every rank
        probe = torch.randn(p.shape, generator=torch.Generator(p.device).manual_seed(i), device=p.device)
        norms.append(grad.norm())
        dots.append((grad * probe).sum())
    values = torch.stack([torch.stack(norms), torch.stack(dots)]).double().cpu().tolist()
    return {"grad_norms": values[0], "grad_dots": values[1]}


def shards(batch_size: int, device: torch.device) -> list:
    """This rank's rows of 4 global batches (of 4 different caption widths)."""
    world, rank = distributed.world_size(), distributed.rank()
    out = []
    for k in range(4):
        mine = split_rows(random_batch(batch_size, True, seed=k, pin=False), batch_size // world)[rank]
        out.append(mine.pin_memory() if device.type == "cuda" else mine)
    return out


def phase(
    name: str,
    model_name: str,
    device: torch.device,
    batch_size: int,
    steps: int,
    precision: str,
    layout: str = "replicate",
) -> None:
    """`steps` trainer steps of one phase from the seeded weights under `layout`; rank 0 prints a row per step
    (and the summary)."""
    ctx = ParallelContext.from_process_group(layout)
    world, main = ctx.world, ctx.is_main
    torch.manual_seed(0)  # the same weights on every rank and at every world size
    model = build_on(device, model_name)
    objective = build_objective(LossConfig(terms=OBJECTIVES[OBJECTIVE]))
    batches = shards(batch_size, device)
    micro = ACCUMULATION["exact"] * batch_size // 128
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(output_dir=out, max_steps=steps, batch_size=batch_size, micro_batch_size=micro,
                          accumulation="exact", precision=precision, tf32=name == "speed", device=device.type,
                          progress=False, eval_every=0, checkpoint_every=0, warmup_steps=1)  # fmt: skip
        trainer = Trainer(model, objective, MemoryLoader(batches), cfg, Path(out), lambda d: None, ctx=ctx)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for k in range(steps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            record = trainer._train_step(batches[k % len(batches)]) or {}
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
            row = {"kind": f"{name}_step", "world": world, "layout": layout, "step": k + 1, "loss": record.get("loss"),
                   "grad_norm": record.get("grad_norm"), "step_s": round(times[-1], 4)}  # fmt: skip
            if name == "check" and k == 0:
                row |= digest([p for p in model.parameters() if p.requires_grad])  # averaged on every rank
            if main:
                emit(row)
        trainer.logger.close()
    if name == "speed" and main:
        seconds = statistics.median(times[1:] or times)
        emit({"kind": "speed", "world": world, "layout": layout, "model": model_name, "batch": batch_size,
              "precision": precision, "step_s": round(seconds, 4), "img_per_s": round(batch_size / seconds, 1),
              "img_per_s_per_gpu": round(batch_size / seconds / world, 1), **memory(device)})  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="l14", help="l14 | b16 (gpu_step.py's shapes)")
    parser.add_argument("--steps", type=int, default=10, help="steps of the speed phase")
    parser.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny CLIP, batch 16, fp32, 77 positions")
    parser.add_argument("--layouts", default="replicate,hybrid,shard", help="train.layout values of the speed phase")
    args = parser.parse_args()
    if args.dry_run:
        dry_run_settings()
        device, model_name, batch_size, speed_precision = torch.device("cpu"), "tiny", 16, PRECISION["name"]
    else:
        device, model_name, batch_size, speed_precision = (
            devices.resolve_device("auto", "device"),
            args.model,
            128,
            "bf16",
        )
    distributed.init_from_env(device)
    if distributed.rank() == 0:
        emit({"kind": "ranks", "world": distributed.world_size(), "backend": distributed.backend(),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"})  # fmt: skip
    phase("check", model_name, device, batch_size, 2, "fp32")
    layouts = args.layouts.split(",") if distributed.world_size() > 1 else ["replicate"]
    for layout in layouts:
        phase("speed", model_name, device, batch_size, args.steps, speed_precision, layout)
    distributed.shutdown()


if __name__ == "__main__":
    main()
