"""Validation inside a distributed run, without repeating it on every rank.

Each rank embeds every world-th image and caption (eval.embed.ShardedEmbedder) and the shards are gathered to
rank 0, so the embedding costs 1/W of a single-rank one on each rank, and no rank idles at a collective while
another embeds (which a rank-0-only validation would make every other rank do, against the process group's
timeout). Rank 0 alone scores the gathered embeddings (the others never build S) and its result, a small dict,
reaches every rank in one object broadcast (`from_rank0`), so every rank takes the same best-checkpoint and guard
decision; an error rank 0 meets while scoring (non-finite embeddings) is raised on every rank, so all stop together.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

from sharpclip.eval.embed import Embedder, ShardedEmbedder
from sharpclip.train.parallel import ParallelContext

T = TypeVar("T")


def _context(ctx: ParallelContext | None) -> ParallelContext:
    """The run's parallel context (None: this process in the default process group)."""
    return ctx if ctx is not None else ParallelContext.from_process_group()


def gather_rows(rows: Tensor, ctx: ParallelContext | None = None) -> list[Tensor]:
    """Every rank's `rows` (CPU tensors of any row count), in rank order, on rank 0; [] on the other ranks; [rows]
    on one process."""
    ctx = _context(ctx)
    if not ctx.several:
        return [rows]
    return [torch.as_tensor(t) for t in ctx.to_rank0(rows.detach().cpu())]


def shard(embedder: Embedder, ctx: ParallelContext | None = None) -> Embedder:
    """`embedder` sharded over the ranks, the embeddings gathered to rank 0 (the embedder itself on one process)."""
    ctx = _context(ctx)
    if not ctx.several:
        return embedder
    return ShardedEmbedder(embedder, ctx.rank, ctx.world, functools.partial(gather_rows, ctx=ctx))


def scores_here(ctx: ParallelContext | None = None) -> bool:
    """Whether this rank scores the gathered embeddings: rank 0 (the only process when not distributed)."""
    return _context(ctx).is_main


def _kind(err: Exception) -> type[Exception]:
    """What another rank raises for rank 0's `err`: ValueError or RuntimeError as it is one (what the trainer tells a
    diverged update by), else RuntimeError: a built-in type, which unpickles on every rank."""
    return ValueError if isinstance(err, ValueError) else RuntimeError


def from_rank0(evaluate: Callable[[], T], ctx: ParallelContext | None = None) -> T:
    """`evaluate()` on every rank, and rank 0's result on every rank (one object broadcast of trusted, in-process
    data). `evaluate` embeds this rank's share through `shard` on every rank and scores on rank 0 only
    (`scores_here`); what the other ranks return is dropped. An exception rank 0 raises is raised on every rank."""
    ctx = _context(ctx)
    if not ctx.several:
        return evaluate()
    if not ctx.is_main:
        evaluate()
        result, error = ctx.from_rank0(None)
        if error is not None:
            kind, message = error
            raise kind(message)
        return result
    try:
        result = evaluate()
    except Exception as err:
        ctx.from_rank0((None, (_kind(err), f"rank 0: {err}")))
        raise
    return ctx.from_rank0((result, None))[0]


def shared(
    evaluate: Callable[[T], dict[str, float]], ctx: ParallelContext | None = None
) -> Callable[[T], dict[str, float]]:
    """`evaluate(model)` run as `from_rank0` runs it: rank 0's metrics on every rank."""
    return lambda model: from_rank0(lambda: evaluate(model), ctx)
