"""Where a run's numbers go: JSONL files in the run directory, a progress bar, and optional TensorBoard / W&B.

`metrics.jsonl` gets one record per optimiser step (every loss term, lr, logit scale, throughput, samples seen) and
one per evaluation; `diagnostics.jsonl` gets the gradient-dynamics records. Lines are flushed as written, so a
crashed run keeps everything up to its last step. Only rank 0 writes.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

log = logging.getLogger("sharpclip.train")


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them readable
    return value


class JsonlWriter:
    def __init__(self, path: Path, enabled: bool = True):
        self.path, self.enabled = path, enabled
        self._file = path.open("a") if enabled else None

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class RunLogger:
    """metrics.jsonl + diagnostics.jsonl + the optional sinks, for rank 0; silent elsewhere."""

    def __init__(self, run_dir: Path, enabled: bool = True, tensorboard: bool = False, wandb: bool = False):
        self.metrics = JsonlWriter(run_dir / "metrics.jsonl", enabled)
        self.diagnostics = JsonlWriter(run_dir / "diagnostics.jsonl", enabled)
        self._tb = self._wandb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise ImportError("train.tensorboard needs the extra: pip install 'sharpclip[tensorboard]'") from err
            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        if enabled and wandb:
            try:
                import wandb as wandb_module
            except ImportError as err:
                raise ImportError("train.wandb needs the extra: pip install 'sharpclip[wandb]'") from err
            self._wandb = wandb_module.init(project="sharpclip", dir=str(run_dir), name=run_dir.name)

    def step(self, record: dict[str, Any]) -> None:
        self.metrics.write(record)
        self._sinks(record, int(record.get("step", 0)))

    def diagnose(self, record: dict[str, Any]) -> None:
        self.diagnostics.write(record)
        self._sinks({f"diag/{k}": v for k, v in record.items() if k != "step"}, int(record["step"]))

    def _sinks(self, record: dict[str, Any], step: int) -> None:
        numbers = {k: v for k, v in record.items() if isinstance(v, int | float) and k != "step"}
        if self._tb is not None:
            for key, value in numbers.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)

    def close(self) -> None:
        self.metrics.close()
        self.diagnostics.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def progress(total: int, initial: int, enabled: bool) -> tqdm:
    """A progress bar over optimiser steps with ETA; the postfix shows the current loss."""
    return tqdm(total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True)
