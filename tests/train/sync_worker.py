"""Worker of the multi-rank host-read count, launched by torchrun on gloo: three trainer steps per case, through the
trainer's own loop pieces (`Trainer._steps`, which makes the step's agreement, then `Trainer._train_step`); the reads
and `torch.tensor(device=...)` copies inside each step after the first are counted by call site; rank 0 writes
every rank's counts (JSON).

python sync_worker.py OUT_FILE
"""

import json
import sys
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

from _support.host_reads import OBJECTIVES, HostReads, sync_trainer
from sharpclip.train import distributed

CASES = {"exact": "hn_clip+filip", "per_micro_batch": "hn_clip+filip"}


def widened(batches, rank: int):
    """The batches with their captions padded by 0, 8 or 16 more tokens, by step and rank: widths that change."""
    for k, batch in enumerate(batches):
        widths = (0, 8 * ((k + rank) % 3))
        ids, mask = (torch.nn.functional.pad(t, widths) for t in (batch.input_ids, batch.attention_mask))
        yield replace(batch, input_ids=ids, attention_mask=mask)


def count(out: Path, accumulation: str, objective: str) -> list[dict]:
    rank, world = distributed.rank(), distributed.world_size()
    trainer = sync_trainer(out, OBJECTIVES[objective], rank=rank, world=world, accumulation=accumulation, max_steps=4)
    trainer.model.train()
    steps = []
    for k, batch in enumerate(trainer._steps(widened(iter(trainer.loader), rank))):
        widths = [w["input_ids"] for w in trainer.ctx.agreement.widths]  # every rank's caption width this step
        with HostReads() as reads:
            trainer._train_step(batch)
        if k:  # the first step builds optimiser state and exchanges shapes (its own one-off reads)
            sites = {f"{f}:{fn}": n for (f, fn), n in reads.sites.items() if not f.startswith("torch/optim")}
            copies = {f"{f}:{fn}": n for (f, fn), n in reads.copies.items() if not f.startswith("torch/optim")}
            steps.append({"sites": sites, "copies": copies, "widths": widths})
    return steps


def main(out: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    results = {mode: count(out.parent / f"run-{mode}", mode, objective) for mode, objective in CASES.items()}
    every = distributed.all_ranks(results)
    if distributed.rank() == 0:
        out.write_text(json.dumps(every))
    distributed.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
