"""Validation inside a distributed run, without repeating it on every rank.

Each rank embeds every world-th image and caption (eval.embed.ShardedEmbedder) and the shards are gathered to
rank 0, so the embedding costs 1/W of a single-rank one on each rank, and no rank idles at a collective while
another embeds (which a rank-0-only validation would make every other rank do, against the process group's
timeout). Rank 0 alone scores the gathered embeddings (the others never build S) and its result, a small dict,
reaches every rank in one object broadcast (`from_rank0`), so every rank takes the same best-checkpoint and guard
decision; an error rank 0 meets while scoring (non-finite embeddings) is raised on every rank, so all stop together.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

from sharpclip.eval.embed import Embedder, ShardedEmbedder
from sharpclip.train import distributed

T = TypeVar("T")


def gather_rows(rows: Tensor) -> list[Tensor]:
    """Every rank's `rows` (CPU tensors of any row count), in rank order, on rank 0; [] on the other ranks; [rows]
    on one process."""
    if distributed.world_size() == 1:
        return [rows]
    return [torch.as_tensor(t) for t in distributed.to_rank0(rows.detach().cpu())]


def shard(embedder: Embedder) -> Embedder:
    """`embedder` sharded over the ranks, the embeddings gathered to rank 0 (the embedder itself on one process)."""
    world = distributed.world_size()
    return embedder if world == 1 else ShardedEmbedder(embedder, distributed.rank(), world, gather_rows)


def scores_here() -> bool:
    """Whether this rank scores the gathered embeddings: rank 0 (the only process when not distributed)."""
    return distributed.rank() == 0


def _kind(err: Exception) -> type[Exception]:
    """What another rank raises for rank 0's `err`: ValueError or RuntimeError as it is one (what the trainer tells a
    diverged update by), else RuntimeError: a built-in type, which unpickles on every rank."""
    return ValueError if isinstance(err, ValueError) else RuntimeError


def from_rank0(evaluate: Callable[[], T]) -> T:
    """`evaluate()` on every rank, and rank 0's result on every rank (one object broadcast of trusted, in-process
    data). `evaluate` embeds this rank's share through `shard` on every rank and scores on rank 0 only
    (`scores_here`); what the other ranks return is dropped. An exception rank 0 raises is raised on every rank."""
    if distributed.world_size() == 1:
        return evaluate()
    if not scores_here():
        evaluate()
        result, error = distributed.from_rank0(None)
        if error is not None:
            kind, message = error
            raise kind(message)
        return result
    try:
        result = evaluate()
    except Exception as err:
        distributed.from_rank0((None, (_kind(err), f"rank 0: {err}")))
        raise
    return distributed.from_rank0((result, None))[0]


def shared(evaluate: Callable[[T], dict[str, float]]) -> Callable[[T], dict[str, float]]:
    """`evaluate(model)` run as `from_rank0` runs it: rank 0's metrics on every rank."""
    return lambda model: from_rank0(lambda: evaluate(model))
