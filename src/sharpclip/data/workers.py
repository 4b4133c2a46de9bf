"""What every DataLoader worker sharpclip starts does first: leave the stop signals to its rank.

A preemption (or `scancel`) signals every process of a job, DataLoader workers included. A worker that dies of
SIGTERM takes the rank's batches with it: the rank's stop checkpoint then fails ("DataLoader worker ... is killed by
signal: Terminated") and the steps since the previous checkpoint are lost. So each worker ignores the signals a rank
may stop on (config.STOP_SIGNALS: SIGTERM, SIGUSR1, SIGUSR2, SIGINT); the rank decides (train.stop), finishes its
step, checkpoints and ends, and its workers end with it (the DataLoader's shutdown, or torch's check that the parent
still lives). SIGKILL still ends a worker at once.
"""

from __future__ import annotations

import signal

from sharpclip.config import STOP_SIGNALS


def ignore_stop_signals(worker_id: int = 0) -> None:
    """A DataLoader `worker_init_fn`: ignore every stop signal in this worker process."""
    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_IGN)
