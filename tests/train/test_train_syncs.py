"""Host reads per optimiser step: on a GPU every `.item()`, `float(t)` or `.tolist()` waits for the queued kernels,
so the step may read values back only at its end. A `TorchDispatchMode` sees every `aten._local_scalar_dense`
(what `.item()`, `float()`, `bool()` and `int()` of a tensor dispatch to) and `Tensor.tolist` is patched; each read
is attributed to the innermost sharpclip, transformers or torch.optim frame, and the set of call sites must be the
allow-list: the trainer's two end-of-step reads, plus AdamW's step counters, which live on the CPU (host-only).
"""

from __future__ import annotations

import collections
import traceback
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from _support.tiny_run import ToyLoader, toy_model, train_config
from sharpclip.config import LossConfig, TermConfig
from sharpclip.train.features import build_objective
from sharpclip.train.trainer import Trainer

# (file, function) of the reads a step may make: terms, monitor and grad norm together; max |w| and logit scale
ALLOWED = {("step.py", "read"), ("trainer.py", "_check_weights")}  # StepResult.read, called by _train_step
OPTIMISER = "torch/optim/"  # AdamW's `step` counters are CPU tensors unless capturable/fused: no device sync
OBJECTIVES = {
    "hn_clip+filip": {"hn": TermConfig("hn_clip"), "tok": TermConfig("filip", weight=0.5)},
    "hn_clip, frozen reference": {"hn": TermConfig("hn_clip", inputs={"reference_text": "text_frozen"})},
}


def _site() -> tuple[str, str]:
    for frame in reversed(traceback.extract_stack()[:-2]):
        name = frame.filename.replace("\\", "/")
        if OPTIMISER in name:
            return (OPTIMISER, "")
        if "/sharpclip/" in name or "/transformers/" in name:
            return (f"{Path(name).name}:{frame.lineno}" if "/transformers/" in name else Path(name).name, frame.name)
    return ("?", "")


class HostReads(TorchDispatchMode):
    """Counts host reads by call site while active (dispatched scalar reads and `Tensor.tolist`)."""

    def __init__(self):
        super().__init__()
        self.sites: collections.Counter = collections.Counter()
        self._tolist = torch.Tensor.tolist

    def __enter__(self):
        counter, original = self, self._tolist

        def tolist(t):
            counter.sites[_site()] += 1
            return original(t)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.sites[_site()] += 1
        return func(*args, **(kwargs or {}))


def _trainer(tmp_path, terms, **overrides) -> Trainer:
    model = toy_model()
    cfg = train_config(str(tmp_path / "run"), max_steps=3, **overrides)
    objective = build_objective(LossConfig(terms=terms))
    loader = ToyLoader(model.tokenizer, batch_size=cfg.batch_size)
    return Trainer(model, objective, loader, cfg, tmp_path / "run", write_model=lambda d: None)


@pytest.mark.parametrize(
    ("objective", "accumulation"),
    [("hn_clip+filip", "exact"), ("hn_clip+filip", "per_micro_batch"), ("hn_clip, frozen reference", "exact")],
)
def test_a_step_reads_the_device_only_at_its_end(tmp_path, objective, accumulation):
    trainer = _trainer(tmp_path, OBJECTIVES[objective], accumulation=accumulation)
    batches = iter(trainer.loader)
    trainer.model.train()
    trainer._train_step(next(batches))  # the first step builds optimiser state (its own one-off reads)
    with HostReads() as reads:
        record = trainer._train_step(next(batches))
    assert record is not None and record["loss"] > 0
    sites = {site: n for site, n in reads.sites.items() if site[0] != OPTIMISER}
    assert sites == dict.fromkeys(ALLOWED, 1), sites


def test_the_counter_sees_a_mid_step_read(tmp_path, monkeypatch):
    """The detector itself: a `float()` between forward and backward (as the monitor once did) is attributed to the
    sharpclip frame that called it."""
    from sharpclip.losses import objective as objective_module

    diagnose = objective_module.Objective.diagnose
    monkeypatch.setattr(objective_module.Objective, "diagnose",
                        lambda self, f: {k: torch.tensor(float(v)) for k, v in diagnose(self, f).items()})  # fmt: skip
    trainer = _trainer(tmp_path, OBJECTIVES["hn_clip+filip"])
    batches = iter(trainer.loader)
    trainer._train_step(next(batches))
    with HostReads() as reads:
        trainer._train_step(next(batches))
    assert reads.sites[("step.py", "_evaluated")] == 2  # the monitor's two values, read where it is evaluated


@pytest.mark.gpu
def test_a_cuda_step_synchronises_only_at_its_end(tmp_path):
    """Under `torch.cuda.set_sync_debug_mode("warn")` a step on the GPU warns exactly for its two reads."""
    import warnings

    trainer = _trainer(tmp_path, OBJECTIVES["hn_clip+filip"], device="cuda")
    batches = [b.pin() if hasattr(b, "pin") else b for b in trainer.loader]
    trainer._train_step(batches[0])
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer._train_step(batches[1])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= len(ALLOWED), [str(w.message) for w in syncs]
