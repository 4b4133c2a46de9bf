"""Counting host reads: every `aten._local_scalar_dense` (what `.item()`, `float()`, `bool()` and `int()` of a
tensor dispatch to) and every `Tensor.tolist`, attributed to the innermost sharpclip, transformers or torch.optim
frame; and every `torch.tensor(..., device=...)` (a host-to-device copy that waits on a GPU)."""

from __future__ import annotations

import collections
import functools
import traceback
from pathlib import Path

import torch
import torch.optim
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

import sharpclip
from _support.tiny_run import ToyLoader, toy_model, train_config
from sharpclip.config import LossConfig, TermConfig
from sharpclip.train.features import build_objective
from sharpclip.train.trainer import Trainer

# (file, function) of the reads a step may make: terms, monitor and grad norm together; max |w| and logit scale
ALLOWED = {("step.py", "read"), ("trainer.py", "_check_weights")}  # StepResult.read, called by _train_step
OPTIMISER = "torch/optim/"  # AdamW's `step` counters are CPU tensors unless capturable/fused: no device sync
# Each frame is attributed by the package folder it lies in (resolved), never by a substring of its path: a clone
# named `sharpclip` with its venv inside puts torch's own files under a `/sharpclip/` folder too.
PACKAGES = {
    "sharpclip": Path(sharpclip.__file__).resolve().parent,
    "transformers": Path(transformers.__file__).resolve().parent,
    OPTIMISER: Path(torch.optim.__file__).resolve().parent,
}
OBJECTIVES = {
    "hn_clip+filip": {"hn": TermConfig("hn_clip"), "tok": TermConfig("filip", weight=0.5)},
    "hn_clip, frozen reference": {"hn": TermConfig("hn_clip", inputs={"reference_text": "text_frozen"})},
}


@functools.lru_cache(maxsize=4096)
def owner(filename: str) -> str | None:
    """The package of `PACKAGES` whose folder holds `filename` (after resolving links), or None."""
    path = Path(filename).resolve()
    for name, folder in PACKAGES.items():
        if path.is_relative_to(folder):
            return name
    return None


def site_of(filename: str, lineno: int | None, function: str) -> tuple[str, str] | None:
    """The call site a frame stands for, or None when the frame is not sharpclip's, transformers' or torch.optim's."""
    package = owner(filename)
    if package == OPTIMISER:
        return (OPTIMISER, "")
    if package == "transformers":
        return (f"{Path(filename).name}:{lineno}", function)
    if package == "sharpclip":
        return (Path(filename).name, function)
    return None


def _site() -> tuple[str, str]:
    for frame in reversed(traceback.extract_stack()[:-2]):
        site = site_of(frame.filename, frame.lineno, frame.name)
        if site is not None:
            return site
    return ("?", "")


class HostReads(TorchDispatchMode):
    """Counts host reads by call site while active (dispatched scalar reads and `Tensor.tolist`), and in
    `copies` the `torch.tensor(..., device=...)` calls."""

    def __init__(self):
        super().__init__()
        self.sites: collections.Counter = collections.Counter()
        self._tolist, self._tensor = torch.Tensor.tolist, torch.tensor
        self.copies: collections.Counter = collections.Counter()

    def __enter__(self):
        counter, original = self, self._tolist

        def tolist(t):
            counter.sites[_site()] += 1
            return original(t)

        def tensor(*args, **kwargs):
            if kwargs.get("device") is not None:
                counter.copies[_site()] += 1
            return counter._tensor(*args, **kwargs)

        torch.Tensor.tolist, torch.tensor = tolist, tensor
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist, torch.tensor = self._tolist, self._tensor
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.sites[_site()] += 1
        return func(*args, **(kwargs or {}))


def sync_trainer(out: Path, terms: dict, rank: int = 0, world: int = 1, **overrides) -> Trainer:
    """A trainer of the toy model over `ToyLoader` (this rank's rows of global batches of 16), 3 steps."""
    model = toy_model()
    cfg = train_config(str(out), **{"max_steps": 3, **overrides})
    objective = build_objective(LossConfig(terms=terms))
    loader = ToyLoader(model.tokenizer, batch_size=cfg.batch_size, rank=rank, world=world)
    return Trainer(model, objective, loader, cfg, out, write_model=lambda d: None)
