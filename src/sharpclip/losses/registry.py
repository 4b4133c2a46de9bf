"""Registry of loss terms by name, with the inputs and hyperparameters read off each function's signature.

Convention for a registered loss: positional parameters are tensor inputs (features of the batch, or the model's
logit scale and bias), those defaulting to None are optional; keyword-only parameters are hyperparameters set from
config, annotated with their type (`gamma: float = 0.5`). `objective.py` binds inputs by name (remappable per term)
and checks hyperparameters against this record: their names, and their values against the annotations.

Local loss: a contrastive loss takes the optional input `rows` (a slice of its inputs' rows, or None). Given one,
it computes only those query rows, against every column, and returns their additive share of the loss over the
whole batch (the shares of disjoint slices covering the batch sum to the loss); None computes every row. The
losses stay pure: the trainer gathers the batch across processes and hands each its own slice (train.step).
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from torch import Tensor

LossFn = Callable[..., Tensor]
ROWS = "rows"  # the local-loss input: which query rows to compute (see above); optional even when remapped


@dataclass(frozen=True)
class LossSpec:
    name: str
    fn: LossFn
    inputs: tuple[str, ...]  # required tensor inputs
    optional_inputs: tuple[str, ...]  # tensor inputs that may be absent (None)
    params: dict[str, Any]  # hyperparameters and their defaults
    param_types: dict[str, Any]  # hyperparameters and their annotated types (float, int | None, ...)
    # a mean over rows of a per-row value (no row sees another): a micro-batch then splits over ranks exactly
    per_sample: bool = False

    @property
    def summary(self) -> str:
        doc = inspect.getdoc(self.fn) or ""
        return doc.splitlines()[0] if doc else ""


_REGISTRY: dict[str, LossSpec] = {}


def spec_of(name: str, fn: LossFn) -> LossSpec:
    """The record of `fn` under `name`, read off its signature (registered or not: diagnostic terms are not)."""
    inputs, optional, params = [], [], {}
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.KEYWORD_ONLY:
            params[p.name] = p.default
        elif p.default is p.empty:
            inputs.append(p.name)
        else:
            optional.append(p.name)
    hints = typing.get_type_hints(fn)
    types = {p: hints.get(p, Any) for p in params}
    return LossSpec(name, fn, tuple(inputs), tuple(optional), params, types)


def register(name: str, per_sample: bool = False) -> Callable[[LossFn], LossFn]:
    """Decorator: make `fn` available to configs as `loss: <name>`. per_sample: the loss is the mean of a value
    computed for each row alone (a distillation), not a matrix over the batch's rows (every contrastive loss)."""

    def deco(fn: LossFn) -> LossFn:
        if name in _REGISTRY:
            raise ValueError(f"loss {name!r} is already registered (by {_REGISTRY[name].fn.__module__})")
        _REGISTRY[name] = replace(spec_of(name, fn), per_sample=per_sample)
        return fn

    return deco


def get(name: str) -> LossSpec:
    if name not in _REGISTRY:
        raise KeyError(f"unknown loss {name!r}; registered: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def names() -> list[str]:
    return sorted(_REGISTRY)


def specs() -> list[LossSpec]:
    return [_REGISTRY[n] for n in names()]
