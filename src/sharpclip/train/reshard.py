"""Resuming on another number of ranks exactly where the run stopped, when the loader's position does not depend on
the world size (train.resume.change_world handles the rest).

The map-style loader's sampler (data.sampling.GroupBatchSampler) packs each epoch's global batches from the seed,
the epoch and the global batch size alone, then deals each global batch to the ranks; its position, "global batches
dealt", therefore means the same at every world size. A checkpoint written on S ranks is continued on W ranks from
rank 0's position: every rank takes its share of the next global batch, so the resumed run trains the rows the
uninterrupted run would have trained at each step, mid-epoch included. What cannot carry over is each rank's random
streams (dropout, augmentation in the main process): they restart from (seed, rank, step), as at a clean boundary,
and the loader workers' seeds follow (seed, epoch, rank) as always. A streamed loader (webdataset) assigns shards per
rank and worker, so its position does not carry over: it keeps `change_world`'s next clean boundary.
"""

from __future__ import annotations

from typing import Any

from sharpclip.config import TrainConfig
from sharpclip.data.sampling import GroupBatchSampler
from sharpclip.train import checkpoint
from sharpclip.train.logging import log


def global_position(loader: Any) -> bool:
    """Whether `loader`'s saved position counts global batches (the same at every world size)."""
    return isinstance(getattr(loader, "batch_sampler", None), GroupBatchSampler)


def continue_mid_epoch(
    state: Any, cfg: TrainConfig, ranks_saved: int, saved: dict, loader: Any, rank: int, world: int
) -> bool:
    """Take up rank 0's saved position `saved` on this world size (`rank` of `world`) when the loader allows it
    (see the module docstring) and reseed this rank's random streams; False (nothing done) when it does not."""
    if not global_position(loader):
        return False
    loader.load_state_dict(saved)
    done = int(saved.get("batches_done", 0))
    if rank == 0:
        log.warning(
            "resumed on %d ranks, saved on %d (per-rank batch %d, was %d): epoch %d continues after its %d global "
            "batches done, with the same global batch of %d; each rank's random streams restart from (seed, rank, "
            "step)", world, ranks_saved, cfg.batch_size // world, cfg.batch_size // ranks_saved, state.epoch, done,
            cfg.batch_size,
        )  # fmt: skip
    checkpoint.seed_rngs(cfg.seed + rank + 1_000_003 * state.step)
    return True
