"""Trains the tiny CLIP with validation and a guard every epoch (under torchrun) and records, per rank, how often
the retrieval scorer ran, each validation's metrics and each checkpoint's best decision.

python validation_worker.py DATA_ROOT RUN_DIR OUT_DIR      (writes OUT_DIR/rank<R>.json)

First rank 0 raises while "scoring" and every rank records what it raised (the error reaches them all).
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from _support.tiny_files import tiny_config
from sharpclip.eval import metrics
from sharpclip.train import distributed, validation
from sharpclip.train.run import run_train
from sharpclip.train.trainer import Trainer

record: dict = {"scored": 0, "metrics": [], "best": []}
scorer, evaluate, save = metrics.retrieval_ranks, Trainer._evaluate, Trainer.save


def counted_scorer(*args, **kwargs):
    record["scored"] += 1
    return scorer(*args, **kwargs)


def recorded_evaluate(self):
    out = evaluate(self)
    record["metrics"].append(out)
    return out


def recorded_save(self, best=False):
    record["best"].append(best)
    return save(self, best=best)


def fails() -> dict:
    if validation.scores_here():
        raise ValueError("text embeddings contain NaN or inf")
    return {}


def main(data: str, run_dir: str, out: str) -> None:
    distributed.init_from_env(torch.device("cpu"), timeout_min=0.5)  # run_train joins this group, then ends it
    rank = distributed.rank()
    try:
        validation.from_rank0(fails)
    except ValueError as err:
        record["raised"] = str(err)
    metrics.retrieval_ranks, Trainer._evaluate, Trainer.save = counted_scorer, recorded_evaluate, recorded_save
    guards = "train.guards=[{metric: retrieval/mean_R@1, max_drop: 100}, {metric: retrieval/t2i/R@5}]"
    every_epoch = ["train.device=cpu", "train.batch_size=8", "train.epochs=3", "train.max_steps=3",
                   "train.eval_every=1", "train.dist_timeout_min=0.5", "eval.recall_k=[1,5]"]  # fmt: skip
    cfg = tiny_config(Path(data), Path(run_dir), guards, *every_epoch)
    record["final_best"] = run_train(cfg).best
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(*sys.argv[1:4])
