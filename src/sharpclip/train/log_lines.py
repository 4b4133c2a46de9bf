"""The plain progress line a person reads in train.log, or in a cluster job's redirected `.out`: every
`train.log_every` optimiser steps, on rank 0.

    step 40/200 (epoch 1): loss 2.3456 [hn 2.2000, tok 0.2912], lr 1.00e-05, 812.3 samples/s, data wait 4%,
    ETA 0:12:34

Rates are over the steps since the previous line, by the wall clock (saves and validations in between included):
samples/s counts the global samples of those steps, the data-wait share is the time this rank waited for its
batches over that time, and the ETA is the steps left at that pace. The line is logged with `progress_line` set,
so a terminal showing the progress bar leaves it out (sharpclip.progress.TerminalOnly); train.log always has it.
"""

from __future__ import annotations

import time
from typing import Any

from sharpclip.train.logging import log

NOT_TERMS = frozenset({"step", "epoch", "loss", "lr", "logit_scale", "grad_norm", "samples_per_s", "data_wait_s",
                       "seen"})  # fmt: skip


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ProgressLines:
    """Writes the line every `every` steps (0: never) of a run of `total` steps that starts at `step`/`seen`."""

    def __init__(self, every: int, total: int, step: int = 0, seen: int = 0, enabled: bool = True):
        self.every, self.total, self.enabled = every, total, enabled and every > 0
        self._since, self._step, self._seen, self._wait = time.perf_counter(), step, seen, 0.0

    def step(self, record: dict[str, Any]) -> str | None:
        """Account one step's record (train.trainer); returns the line when one is due (and logs it)."""
        if not self.enabled:
            return None
        self._wait += float(record.get("data_wait_s", 0.0))
        if record["step"] % self.every and record["step"] != self.total:
            return None
        line = self.line(record, time.perf_counter() - self._since)
        self._since, self._step, self._seen, self._wait = time.perf_counter(), record["step"], record["seen"], 0.0
        log.info("%s", line, extra={"progress_line": True})
        return line

    def line(self, record: dict[str, Any], seconds: float) -> str:
        """The line for `record`, `seconds` after the previous one."""
        step, seconds = record["step"], max(seconds, 1e-9)
        terms = [f"{k} {v:.4f}" for k, v in record.items() if k not in NOT_TERMS and not k.endswith("_monitor")
                 and isinstance(v, int | float)]  # fmt: skip
        shown = f" [{', '.join(terms)}]" if terms else ""
        steps = max(step - self._step, 1)
        rate = (record["seen"] - self._seen) / seconds
        eta = (self.total - step) * seconds / steps
        return (f"step {step}/{self.total} (epoch {record['epoch']}): loss {record['loss']:.4f}{shown}, "
                f"lr {record['lr']:.2e}, {rate:.1f} samples/s, data wait {100 * min(self._wait / seconds, 1):.0f}%, "
                f"ETA {_duration(eta)}")  # fmt: skip
