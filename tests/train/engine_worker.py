"""Worker of the engine's equality test, launched by torchrun on gloo: in one launch, 3 training steps of the tiny
CLIP through `Trainer.fit` for every accumulation mode and layout, and fused AdamW, each from the same initial
weights; rank 0 writes every case's losses per step (JSON) and its whole weights after the 3 steps (safetensors).

python engine_worker.py OUT_DIR
"""

import functools
import json
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from _support.tiny_dual import parallel_context
from _support.tiny_run import ToyLoader, toy_model, train_config
from sharpclip.config import LossConfig, TermConfig
from sharpclip.train import distributed
from sharpclip.train import trainer as trainer_module
from sharpclip.train.compile import compile_blocks, compile_counts
from sharpclip.train.features import FeatureEncoder, build_objective
from sharpclip.train.parallel import ParallelContext
from sharpclip.train.step import run_step
from sharpclip.train.trainer import Trainer

MODES = ("exact", "per_micro_batch")
LAYOUTS = ("replicate", "shard", "hybrid")
TERMS = {"hn": TermConfig("hn_clip"), "tok": TermConfig("filip", weight=0.5)}
STEPS = 3
CLIP = 0.01  # below every step's gradient norm: clipping scales every step (the global norm of sharded gradients)


def train(out: Path, mode: str, layout: str, rank: int = 0, world: int = 1, ctx=None, precision: str = "fp32",
          **overrides):  # fmt: skip
    """3 steps of `mode` on `ctx` (None: one process holding the rows of `world` ranks in rank order); returns the
    losses per step then the gradient norms (rank 0), and the whole weights (CPU, rank 0)."""
    model = toy_model()
    cfg = train_config(str(out), max_steps=STEPS, accumulation=mode, layout=layout, eval_every=0, precision=precision,
                       grad_clip=CLIP, **overrides)  # fmt: skip
    ranks = {"rank": rank, "world": world} if ctx is not None else {"deal": world}  # one process: the ranks' rows
    loader = ToyLoader(model.tokenizer, batch_size=cfg.batch_size, **ranks)
    objective = build_objective(LossConfig(terms=TERMS))
    trainer = Trainer(model, objective, loader, cfg, out, write_model=lambda d, state=None: None, ctx=ctx)
    assert bool(trainer.optimizer.defaults["fused"]) == ("cpu" in trainer_module.FUSED_ADAMW_DEVICES)
    trainer.fit()
    weights = trainer.engine.full_model_state() if trainer.engine is not None else model.state_dict()
    metrics = out / "metrics.jsonl"
    records = [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r] if rank == 0 else []
    losses = [r["loss"] for r in records] + [r["grad_norm"] for r in records]  # then the norms before clipping
    return losses, {k: v.detach().cpu().contiguous() for k, v in weights.items()}


def bf16_step(precision: str, rank: int = 0, world: int = 1, ctx=None):
    """One exact step's loss and whole gradients (CPU) at `precision` through the trainer's casting rules: the
    engine on `ctx`, or (None) one process holding the rows of `world` ranks in rank order."""
    model = toy_model()
    objective = build_objective(LossConfig(terms=TERMS))
    encoder = FeatureEncoder(model, objective.feature_keys, precision=precision)
    ctx = ctx if ctx is not None else ParallelContext.one_process()
    ctx.shard(model, torch.device("cpu"), precision)
    ranks = {"rank": rank, "world": world} if ctx.several else {"deal": world}
    batch = next(iter(ToyLoader(model.tokenizer, batch_size=16, **ranks)))
    loss = run_step(encoder, objective, batch, 4, ctx=ctx).read().terms["loss"]
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().cpu().float()
             for n, p in model.named_parameters() if p.grad is not None}  # fmt: skip
    return loss, grads


def main(out: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, tensors = {}, {}
    for mode in MODES:
        for layout in LAYOUTS:
            ctx = parallel_context(layout, local_world=2)  # hybrid: nodes of 2 processes
            case = f"{mode}/{layout}"
            losses[case], weights = train(out / case.replace("/", "-"), mode, layout, rank, world, ctx)
            tensors |= {f"{case}/{k}": v for k, v in weights.items()}
    # AdamW's fused kernel (the CUDA choice; torch's CPU kernel here) over the shards' DTensors and the plain,
    # 0-dimensional logit scale (an ignored parameter) in one parameter group
    trainer_module.FUSED_ADAMW_DEVICES = ("cuda", "cpu")
    case = "exact/shard, fused AdamW"
    losses[case], weights = train(out / "fused", "exact", "shard", rank, world, parallel_context("shard"))
    tensors |= {f"{case}/{k}": v for k, v in weights.items()}
    trainer_module.FUSED_ADAMW_DEVICES = ("cuda",)
    # blocks kept gathered for the step, gradients reduced after its last backward only (train.keep_gathered)
    for mode in MODES:
        case = f"{mode}/shard, kept gathered"
        losses[case], weights = train(out / f"kept-{mode}", mode, "shard", rank, world, parallel_context("shard"),
                                      keep_gathered=True)  # fmt: skip
        tensors |= {f"{case}/{k}": v for k, v in weights.items()}
    # bf16: FSDP2's mixed-precision policy (bf16 compute and all-gathers, fp32 reduction and master weights)
    losses["bf16"], _ = train(out / "bf16", "exact", "shard", rank, world, parallel_context("shard"), "bf16")
    # the gradient diagnostics of a sharded run (computed on a plain copy of the gathered weights)
    train(out / "diagnostics", "exact", "shard", rank, world, parallel_context("shard"), diagnostics_every=2)
    # the blocks compiled (Dynamo, eager backend) inside the engine's hooks: exact, and no graph break
    trainer_module.compile_blocks = functools.partial(compile_blocks, backend="eager")
    case = "exact/shard, compiled"
    losses[case], weights = train(out / "compiled", "exact", "shard", rank, world, parallel_context("shard"),
                                  compile=True)  # fmt: skip
    tensors |= {f"{case}/{k}": v for k, v in weights.items()}
    losses["compile graph breaks"] = [compile_counts()["graph_breaks"]]
    trainer_module.compile_blocks = compile_blocks
    # one bf16 step's gradients on W ranks (FSDP2's casting rules, replicated and sharded)
    for layout in ("replicate", "shard"):
        losses[f"bf16 step/{layout}"], grads = bf16_step("bf16", rank, world, parallel_context(layout))
        tensors |= {f"bf16 step/{layout}/{k}": v.contiguous() for k, v in grads.items()}
    if rank == 0:
        save_file(tensors, out / "weights.safetensors")
        (out / "losses.json").write_text(json.dumps(losses))
    distributed.shutdown()  # collects garbage first (gloo's threads, train.distributed)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
