"""CPU time per step of the engine against the plain model, at negligible compute: what the engine adds on the host.

    python benchmarks/engine_overhead.py [--steps 12] [--out engine_overhead.json]

A transformers CLIP with ViT-L/14's block and tensor count (24 vision + 12 text blocks, 16 parameter tensors each,
about 400 in all) at width 32, 16 px images in 8 px patches (5 tokens) and 16 text positions, so a step is Python,
dispatch, FSDP2's hooks and DTensor work, not arithmetic. The trainer's step (`run_step`, clipping, the host read of
the loss terms and the norm, AdamW (foreach), max |w|) on 16 rows a rank, two ways side by side, steps alternating:
the plain model (no engine: what one process ran before), and the model under the engine (`train.layout: replicate`,
FSDP2 on a (W, 1) mesh); one pass (per_micro_batch, one micro-batch of 16) and exact accumulation with 4
micro-batches of 4. Run under torchrun on 1 process (a one-rank gloo group) and on 2 gloo ranks, in one invocation.
Printed (and written to --out): per world size and mode the median CPU time a step (`time.process_time`, the first
3 steps of each dropped) of each, and the engine's extra CPU over the plain step as a ratio.
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

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import CLIPConfig, CLIPModel

from sharpclip.config import LossConfig, TermConfig
from sharpclip.data.schema import Batch
from sharpclip.models.hf import wrap
from sharpclip.train import distributed
from sharpclip.train.engine import Engine, max_abs
from sharpclip.train.features import FeatureEncoder, build_objective
from sharpclip.train.optim import build_optimizer
from sharpclip.train.parallel import ParallelContext
from sharpclip.train.step import run_step

ROWS, WARMUP, CONTEXT, VOCAB = 16, 3, 16, 100
MESH_NAMES = ("replicate", "shard")
MODES = {"one pass": ("per_micro_batch", 16), "exact, 4 micro-batches": ("exact", 4)}


def vit_l_shaped(seed: int = 0) -> torch.nn.Module:
    """ViT-L/14's blocks and tensors (24 + 12 layers) at width 32."""
    torch.manual_seed(seed)
    common = {"hidden_size": 32, "intermediate_size": 128, "num_attention_heads": 4}
    text = {**common, "num_hidden_layers": 12, "vocab_size": VOCAB, "max_position_embeddings": CONTEXT,
            "eos_token_id": VOCAB - 1, "bos_token_id": 0, "pad_token_id": VOCAB - 1}  # fmt: skip
    vision = {**common, "num_hidden_layers": 24, "image_size": 16, "patch_size": 8}
    return wrap(CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=32)))


def random_batch(rows: int, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB - 1, (rows, CONTEXT), generator=g)
    ids[:, -1] = VOCAB - 1
    return Batch(ids=[f"r{i}" for i in range(rows)], pixel_values=torch.randn(rows, 3, 16, 16, generator=g),
                 input_ids=ids, attention_mask=torch.ones_like(ids), groups=torch.arange(rows))  # fmt: skip


class Setup:
    """The plain model (`engine=False`: no collective, this rank alone) or the model under the engine."""

    def __init__(self, engine: bool, rank: int, world: int):
        self.model = vit_l_shaped()
        self.objective = build_objective(LossConfig(terms={"c": TermConfig("infonce")}))
        self.encoder = FeatureEncoder(self.model, self.objective.feature_keys)
        self.ctx = ParallelContext.one_process()  # plain: this rank alone
        if engine and world == 1:  # the engine on a one-rank mesh: the hooks and DTensors, no peer
            mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=MESH_NAMES)
            self.ctx = ParallelContext(engine=Engine(self.model, mesh))
        elif engine:
            self.ctx = ParallelContext(rank=rank, world=world, local_world=world, layout="replicate")
            self.ctx.shard(self.model, torch.device("cpu"))
        self.optimizer = build_optimizer(self.model, 1e-4, 0.1)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.times: list[float] = []

    def step(self, batch: Batch, accumulation: str, micro: int) -> None:
        start = time.process_time()
        self.optimizer.zero_grad(set_to_none=True)
        result = run_step(self.encoder, self.objective, batch, micro, accumulation, ctx=self.ctx)
        engine = self.ctx.engine
        if engine is not None:
            norm = engine.clip_grad_norm(self.params, 1.0)
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        result.read(grad_norm=norm)
        self.optimizer.step()
        largest = engine.weights_max_abs(self.params) if engine is not None else max_abs(self.params)
        float(largest)
        self.times.append(time.process_time() - start)


def worker(steps: int, out: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    report = {}
    for mode, (accumulation, micro) in MODES.items():
        plain, engine = Setup(False, rank, world), Setup(True, rank, world)
        for k in range(steps):
            batch = random_batch(ROWS, seed=k * world + rank)
            plain.step(batch, accumulation, micro)
            engine.step(batch, accumulation, micro)
        p, e = (statistics.median(s.times[WARMUP:]) for s in (plain, engine))
        report[mode] = {"plain_cpu_ms": round(1e3 * p, 1), "engine_cpu_ms": round(1e3 * e, 1),
                        "engine_extra_over_plain": round((e - p) / p, 3)}  # fmt: skip
    if rank == 0:
        out.write_text(json.dumps(report))
    distributed.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", type=Path, default=Path("engine_overhead.json"))
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.steps, args.worker)
        return
    report = {"benchmark": "engine_overhead", "model": "ViT-L/14's 24 + 12 blocks at width 32", "rows": ROWS,
              "layout": "replicate", "steps": args.steps, "warmup": WARMUP}  # fmt: skip
    for world in (1, 2):
        part = args.out.with_suffix(f".{world}.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
               __file__, "--steps", str(args.steps), "--worker", str(part)]  # fmt: skip
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        report[f"{world} process{'es' if world > 1 else ''}"] = json.loads(part.read_text())
        part.unlink()
    text = json.dumps(report, indent=1)
    print(text)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
