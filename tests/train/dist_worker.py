"""Worker for the 2-process test, launched by torchrun: each rank holds half the batch.

For each objective and each mode (plain gather, and cached accumulation over gathered micro-batches) it computes
the global loss, backpropagates, averages gradients over ranks as DDP does, and rank 0 writes loss and gradients.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from safetensors.torch import save_file

from _support.tiny_towers import TinyTowers, make_batch, objective, split_batch
from sharpclip.train import distributed
from sharpclip.train.accumulate import cached_gradient_step


def main(out: str, objectives: list[str], batch_size: int) -> None:
    distributed.init_from_env(torch.device("cpu"))
    rank, world = distributed.rank(), distributed.world_size()
    half = batch_size // world
    local = split_batch(make_batch(batch_size, seed=1), half)[rank]  # trimmed to this rank's longest caption
    results = {}
    for name in objectives:
        for mode in ("plain", "cached"):
            model, obj = TinyTowers(dropout=0.0), objective(name)

            def loss_fn(feats, model=model, obj=obj):
                return obj({**feats, **model.model_inputs()})

            if mode == "plain":
                loss = loss_fn(distributed.gather_features(model.encode(local)))["loss"]
                loss.backward()
            else:
                micro = split_batch(local, half // 2)
                loss = cached_gradient_step(model.encode, micro, loss_fn, gather=distributed.gather_features)["loss"]
            results[f"{name}/{mode}/loss"] = loss.detach().reshape(1)
            for pname, p in model.named_parameters():
                if p.grad is not None:
                    results[f"{name}/{mode}/{pname}"] = distributed.all_reduce_mean(p.grad).contiguous()
    if rank == 0:
        save_file(results, out)
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]))
