"""torch.compile for the trainer: every transformer block compiled in place, Dynamo's recompile limit across torch
versions, and telling compile failures from the others.

The trainer compiles under `train.compile` (train.trainer), before the engine wraps the blocks; the loss and the
cached-gradient bookkeeping stay eager.
"""

from __future__ import annotations

from typing import Any

import torch

from sharpclip.models.base import DualEncoder
from sharpclip.train.engine import towers, transformer_blocks

COMPILE_RECOMPILE_LIMIT = 32  # Dynamo cache entries per frame; both towers run through one transformers frame
COMPILE_GRAPH_BUDGET = 8  # graphs over a run's shape mix: (vision, text) × (no-grad, grad) × (train, eval)


def compile_blocks(model: DualEncoder, backend: str = "inductor", fullgraph: bool = False) -> int:
    """`torch.compile` every transformer block of both towers in place (parameter names, hence checkpoints,
    unchanged), as torchtitan does; returns how many blocks were compiled.

    Blocks, not whole towers: under the engine (train.engine) each block is its own FSDP unit, so its
    gradients' reduce-scatter starts as soon as its backward has run, block by block, instead of once per tower when a
    whole tower's compiled backward returns; the blocks of a tower share one graph (same code, same shapes), which also
    shortens the cold compile. Embeddings, pooling, projections, the losses and the cached-gradient bookkeeping stay
    eager: they change shape with every batch layout and cost little. Compilation itself happens at the first step (see
    `Trainer._run_step`). Blocks are compiled for static shapes first (the width specialised), and a dimension that
    changes between calls (rows, tokens) turns dynamic at its first recompile (Dynamo's automatic dynamic shapes, as
    torchtitan compiles), so new caption widths, a short last micro-batch, `encode_batch_size` passes and evaluation
    batches reuse graphs (at most COMPILE_GRAPH_BUDGET over the trainer's shape mix per block frame, tested with
    backend="eager"); Dynamo's recompile limit is raised to COMPILE_RECOMPILE_LIMIT, as the blocks of both towers
    share one frame. `fullgraph` (train.compile_fullgraph): a graph break is an error instead of a silent split;
    either way the trainer logs the graphs and breaks (`compile_counts`).
    """
    import torch._dynamo  # torch imports Dynamo lazily

    raise_recompile_limit(torch._dynamo.config, COMPILE_RECOMPILE_LIMIT)
    blocks = [block for tower in towers(model) for block in transformer_blocks(tower)]
    for block in blocks:
        block.compile(backend=backend, fullgraph=fullgraph)
    return len(blocks)


def compile_counts() -> dict[str, int]:
    """Dynamo's graphs compiled so far in this process (each block frame's first compile and every recompile) and its
    graph breaks (0 is what the blocks should have)."""
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"]), "graph_breaks": sum(counters["graph_break"].values())}


def raise_recompile_limit(config: Any, at_least: int) -> str:
    """Raise Dynamo's per-frame recompile limit on `config` (torch._dynamo.config) to `at_least`; returns the name
    set. torch 2.7 renamed `cache_size_limit` to `recompile_limit` (the old name an alias since); older releases
    within the declared range have only `cache_size_limit`."""
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), at_least))
    return name


def is_compile_error(err: BaseException) -> bool:
    """Whether `err` (or an exception it was raised from) comes from Dynamo or Inductor."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if any(c.__module__.startswith(("torch._dynamo", "torch._inductor")) for c in type(err).__mro__):
            return True
        err = err.__cause__ or err.__context__
    return False


def dropout_rate(model: torch.nn.Module) -> float:
    """The largest dropout rate in `model`: `nn.Dropout` modules and transformers' float `dropout` attributes."""
    rates = [0.0]
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            rates.append(module.p)
        elif isinstance(getattr(module, "dropout", None), float):
            rates.append(module.dropout)
    return max(rates)
