"""torch.compile for the trainer: the towers compiled in place, Dynamo's recompile limit across torch versions,
and telling compile failures from the others.

The trainer compiles under `train.compile` (train.trainer); the loss and the cached-gradient bookkeeping stay eager.
"""

from __future__ import annotations

from typing import Any

import torch

from sharpclip.models.base import DualEncoder

COMPILE_RECOMPILE_LIMIT = 32  # Dynamo cache entries per frame; both towers run through one transformers frame
COMPILE_GRAPH_BUDGET = 8  # graphs over a run's shape mix: (vision, text) × (no-grad, grad) × (train, eval)


def compile_towers(model: DualEncoder, backend: str = "inductor") -> None:
    """`torch.compile` the vision and text towers in place (parameter names, hence checkpoints, unchanged).

    Only the towers: the losses and the cached-gradient bookkeeping around them change shape with every batch
    layout, and their cost is small. Compilation itself happens at the first step (see `Trainer._run_step`).
    The towers are compiled with dynamic shapes, so new caption widths, a short last micro-batch, a batch of one
    micro-batch, `encode_batch_size` passes and evaluation batches reuse the same graphs (at most
    COMPILE_GRAPH_BUDGET over the trainer's shape mix, tested with backend="eager"); Dynamo's per-frame recompile
    limit is raised to COMPILE_RECOMPILE_LIMIT, as the two towers share transformers' wrapper frame and its default
    of 8 would leave later variants running eagerly.
    """
    import torch._dynamo  # torch imports Dynamo lazily

    raise_recompile_limit(torch._dynamo.config, COMPILE_RECOMPILE_LIMIT)
    for tower in (model.vision_model, model.text_model):
        tower.compile(backend=backend, dynamic=True)


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
