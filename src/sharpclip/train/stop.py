"""Ending a run cleanly on a signal, and checkpoints by the clock: what the trainer asks the ranks before each step
beside its own flags (train.stop_signals, train.checkpoint_every_min).

A stop signal (SIGTERM or SIGUSR1 by default: what a cluster sends before a time limit or a preemption) on any rank
only sets a flag. The flag travels in the next step's agreement all-reduce (`parallel.ParallelContext.agree`, no
extra host read), so every rank learns it at the same step: each finishes that optimiser step, every rank takes part
in writing a checkpoint of it, and `fit` raises `Stopped`, which the command turns into exit status `STOPPED_EXIT`
(75, sysexits' EX_TEMPFAIL: "try again later") with one line naming the checkpoint. The run then continues with
`--resume` (or the same `--resume auto` command). A second SIGTERM while the first is being handled ends the process
at once with the signal's default action; checkpoints are written under a temporary name and renamed, so the last
complete one stays complete. A SIGTERM within `REPEAT_S` of the first counts as the same request: at a preemption
SLURM signals every task and `srun` forwards the signal it received as well.

Checkpoints by the clock: rank 0's clock alone decides (ranks' clocks need not agree), its "due" bit travels in the
same all-reduce, and every rank saves at that step, beside `train.checkpoint_every`'s step-based ones; any save
restarts the clock. `train.keep_last` prunes them like any other.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

from sharpclip.train.logging import log

clock = time.monotonic  # seconds, this host's own (tests replace it)

STOPPED_EXIT = 75  # `sharpclip train` stopped by a signal after writing a checkpoint: continue it with --resume
REPEAT_S = 2.0  # a SIGTERM this soon after the first is the same request delivered twice (slurmd and srun)


class Stopped(Exception):
    """The run stopped on a signal after checkpointing; the message names the checkpoint and how to continue."""


class RunControl:
    """The stop and clock-checkpoint requests of one rank, and what the ranks agreed on at the last step.

    with control.signals(): ...     stop signals set the flag while training runs (main thread only)
    flags.agree(batch, control.requests())   → control.agreed(flags.requests)
    control.save_now, control.stopping       act after the step; control.saved() after any checkpoint
    """

    def __init__(self, signals: list[str], every_min: float, is_main: bool):
        self.names, self.every_s, self.is_main = list(signals), 60.0 * every_min, is_main
        self.received: str | None = None  # the first stop signal this rank received
        self._received_at = 0.0
        self.stopping = self.save_now = False  # agreed at the last step
        self._last_save = clock()

    @contextlib.contextmanager
    def signals(self) -> Iterator[None]:
        """Handle the stop signals while the block runs; the previous handlers afterwards. Python delivers signals to
        the main thread only, so elsewhere (a test's thread) nothing is installed."""
        if threading.current_thread() is not threading.main_thread() or not self.names:
            yield
            return
        previous = {}
        for name in self.names:
            number = getattr(signal, name)
            previous[number] = signal.signal(number, self._handle)
        try:
            yield
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)

    def _handle(self, number: int, frame: object) -> None:
        name = signal.Signals(number).name
        if self.received is not None and number == signal.SIGTERM:  # the second: at once, the default action
            if clock() - self._received_at >= REPEAT_S:
                signal.signal(number, signal.SIG_DFL)
                os.kill(os.getpid(), number)
            return
        if self.received is None:
            self.received, self._received_at = name, clock()

    def requests(self) -> tuple[float, float]:
        """This rank's (stop, clock checkpoint due) for the step's flags; only rank 0's clock counts."""
        due = self.is_main and self.every_s > 0 and clock() - self._last_save >= self.every_s
        return float(self.received is not None), float(due)

    def agreed(self, sums: list[float]) -> None:
        """The requests summed over ranks (the step's flags): any rank's stop stops every rank; rank 0's clock."""
        stop, due = [*sums, 0.0, 0.0][:2]
        if stop > 0 and not self.stopping:
            got = f"{self.received} reached this rank" if self.received else "another rank received a stop signal"
            log.warning("%s: every rank finishes this step, a checkpoint is written, then the run exits with status %d",
                        got, STOPPED_EXIT, extra={"rank_own": self.received is not None})  # fmt: skip
        self.stopping, self.save_now = stop > 0, stop > 0 or due > 0

    def saved(self) -> None:
        """A checkpoint was written: the clock starts again."""
        self._last_save = clock()
        self.save_now = False


def stopped_message(step: int, checkpoint: str, run_dir: str) -> str:
    return (f"stopped by a signal after step {step}; checkpoint {checkpoint} written; continue with "
            f"`sharpclip train --resume {run_dir}` (or the same `--resume auto` command)")  # fmt: skip
