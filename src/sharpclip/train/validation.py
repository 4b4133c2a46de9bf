"""Validation inside a distributed run, without repeating it on every rank.

Each rank embeds every world-th image and caption (eval.embed.ShardedEmbedder) and the shards are gathered, so the
validation costs 1/W of a single-rank one on each rank, and no rank idles at a collective while another embeds
(which a rank-0-only validation would make every other rank do, against the process group's timeout). Every rank
then scores the same gathered embeddings, cheap next to embedding them (one pass over S on the GPU), and so takes
the same best-checkpoint decision without another collective.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sharpclip.eval.embed import Embedder, ShardedEmbedder
from sharpclip.train import distributed


def gather_rows(rows: Tensor) -> list[Tensor]:
    """Every rank's `rows` (CPU tensors of any row count), in rank order; [rows] on one process."""
    if distributed.world_size() == 1:
        return [rows]
    return [torch.as_tensor(t) for t in distributed.all_ranks(rows.detach().cpu())]


def shard(embedder: Embedder) -> Embedder:
    """`embedder` sharded over the ranks (the embedder itself on one process)."""
    world = distributed.world_size()
    return embedder if world == 1 else ShardedEmbedder(embedder, distributed.rank(), world, gather_rows)
