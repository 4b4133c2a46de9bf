"""Where a run's numbers go: JSONL files in the run directory, a progress bar, and optional TensorBoard / W&B.

`metrics.jsonl` gets one record per optimiser step (every loss term, lr, logit scale, throughput, samples seen) and
one per evaluation; `diagnostics.jsonl` gets the gradient-dynamics records. Lines are flushed as written, so a
crashed run keeps everything up to its last step. Only rank 0 writes. In every record `epoch` is the index (from 0)
of the epoch the record belongs to; an evaluation after epoch e says `epoch: e`.

TensorBoard and W&B get the same numbers under grouped names: `eval/…` and `diag/…` as recorded, everything else
`train/…`; `train/epoch` once per step (step, epoch-end and evaluation records all carry the epoch). W&B gets the
resolved config (the run directory's config.yaml), `train.wandb_project` and `train.wandb_name` (default: the run
directory's name), and a run id kept in `<run>/wandb_id`, so a resumed run continues the same W&B run. The W&B run
starts at the first record, not when the logger is built: the trainer is built before `config.yaml` is written
(it holds the values the run really uses, after a resume's changes), and a fresh run must still get its config.
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from pathlib import Path
from typing import Any

import yaml
from tqdm import tqdm

from sharpclip.progress import bar as progress_bar

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

    def __init__(
        self,
        run_dir: Path,
        enabled: bool = True,
        tensorboard: bool = False,
        wandb: bool = False,
        wandb_project: str = "sharpclip",
        wandb_name: str = "",
    ):
        self.metrics = JsonlWriter(run_dir / "metrics.jsonl", enabled)
        self.diagnostics = JsonlWriter(run_dir / "diagnostics.jsonl", enabled)
        self._tb = self._wandb = self._wandb_init = None
        self._epoch_step = -1  # the last step whose train/epoch went to the sinks
        if enabled and tensorboard:
            try:  # optional extra, imported only when asked for
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise ImportError("train.tensorboard needs the extra: pip install 'sharpclip[tensorboard]'") from err
            self._tb_dir = str(run_dir / "tensorboard")
            self._tb = SummaryWriter(self._tb_dir)
        if enabled and wandb:
            try:  # optional extra, imported only when asked for
                import wandb as wandb_module
            except ImportError as err:
                raise ImportError("train.wandb needs the extra: pip install 'sharpclip[wandb]'") from err
            self._wandb_init = lambda: wandb_module.init(
                project=wandb_project, name=wandb_name or run_dir.name, dir=str(run_dir), config=_resolved(run_dir),
                id=_wandb_id(run_dir), resume="allow",
            )  # fmt: skip

    def resume_at(self, step: int) -> None:
        """A resume continues after `step`: TensorBoard drops the events logged after it (purge_step), so replayed
        steps are not shown twice (the JSONL logs are cut back by the trainer)."""
        if self._tb is not None:
            writer = type(self._tb)
            self._tb.close()
            self._tb = writer(self._tb_dir, purge_step=step + 1)

    def step(self, record: dict[str, Any]) -> None:
        self.metrics.write(record)
        self._sinks(record, int(record.get("step", 0)))

    def diagnose(self, record: dict[str, Any]) -> None:
        self.diagnostics.write(record)
        self._sinks({f"diag/{k}": v for k, v in record.items() if k != "step"}, int(record["step"]))

    def _sinks(self, record: dict[str, Any], step: int) -> None:
        numbers = {tag(k): v for k, v in record.items() if isinstance(v, int | float) and k != "step"}
        if "train/epoch" in numbers:  # once per step: later records of the same step repeat it
            if step == self._epoch_step:
                del numbers["train/epoch"]
            self._epoch_step = step
        if self._tb is not None:
            for key, value in numbers.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is None and self._wandb_init is not None:
            self._wandb, self._wandb_init = self._wandb_init(), None
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)

    def close(self) -> None:
        self.metrics.close()
        self.diagnostics.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def tag(key: str) -> str:
    """The grouped name of a record key in TensorBoard / W&B: eval/… and diag/… as they are, the rest train/…."""
    return key if key.startswith(("eval/", "diag/", "train/")) else f"train/{key}"


def _resolved(run_dir: Path) -> dict[str, Any]:
    """The run's resolved config (config.yaml, written by run_train) as a dict; {} when there is none."""
    path = run_dir / "config.yaml"
    return yaml.safe_load(path.read_text()) or {} if path.is_file() else {}


def _wandb_id(run_dir: Path) -> str:
    """The W&B run id of this run directory, created on first use (a resumed run logs into the same W&B run)."""
    path = run_dir / "wandb_id"
    if not path.is_file():
        path.write_text(uuid.uuid4().hex[:16] + "\n")
    return path.read_text().strip()


def progress(total: int, initial: int, enabled: bool) -> tqdm:
    """A progress bar over optimiser steps with ETA, on a terminal only (sharpclip.progress); the postfix shows the
    current loss."""
    return progress_bar(total=total, initial=initial, enabled=enabled, unit="step")
