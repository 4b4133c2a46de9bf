"""Resuming on another number of ranks exactly where the run stopped, mid-epoch included.

Map-style data (data.sampling.GroupBatchSampler, also the caption loader of `distill`) pack each epoch's global
batches from the seed, the epoch and the global batch size alone, then deal each global batch to the ranks; the
loader's position, "global batches dealt", therefore means the same at every world size, and every rank of the
resumed run takes up rank 0's saved position and its share of the next global batch.

Streamed data (webdataset, data.stream) deal shards to ranks × workers reader slots, so a position is per slot: the
resumed run reads the rest of the saved epoch in the saved layout, each rank keeping its share of every global batch
(`StreamLoader.resume_epoch`, from every saved rank's state), and deals the next epoch to its own slots.

Either way the resumed run trains, at each step, the rows the uninterrupted run would have trained. What cannot
carry over is each rank's random streams (dropout; augmentation is seeded per sample): they restart from (seed,
rank, step), as at a clean boundary, and the loader workers' seeds follow (seed, epoch, rank) as always.
"""

from __future__ import annotations

from typing import Any

from sharpclip.config import TrainConfig
from sharpclip.train import checkpoint
from sharpclip.train.logging import log


def continue_mid_epoch(state: Any, cfg: TrainConfig, saved: list[dict], loader: Any, rank: int, world: int) -> None:
    """Take up the saved loader states `saved` (every saved rank's, in rank order) on this world size (`rank` of
    `world`) and reseed this rank's random streams (see the module docstring)."""
    resume_epoch = getattr(loader, "resume_epoch", None)
    if resume_epoch is not None:  # positions per reader slot
        resume_epoch(saved, len(saved))
    else:  # global batches dealt
        loader.load_state_dict(saved[0])
    done = int(saved[0].get("batches_done", 0))
    if rank == 0:
        log.warning(
            "resumed on %d ranks, saved on %d (per-rank batch %d, was %d): epoch %d continues after its %d global "
            "batches done, with the same global batch of %d; each rank's random streams restart from (seed, rank, "
            "step)", world, len(saved), cfg.batch_size // world, cfg.batch_size // len(saved), state.epoch, done,
            cfg.batch_size,
        )  # fmt: skip
    checkpoint.seed_rngs(cfg.seed + rank + 1_000_003 * state.step)
