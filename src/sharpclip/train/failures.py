"""Failure propagation over ranks: an exception on one rank ends every rank at once, each with one line naming the
first failing rank and its error, instead of leaving the others in a collective until the process group's timeout
(`train.dist_timeout_min`). Nothing happens on one process."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator

import torch.distributed as dist

from sharpclip.train import rendezvous
from sharpclip.train.distributed import rank, world_size

FAILED_KEY, SEEN_KEY, REPORTED_KEY = "sharpclip/failed", "sharpclip/failure_seen", "sharpclip/failure_reported"
HUNG_KEY = "sharpclip/hung"  # the failure is a hang (train.heartbeat), seen by every rank
FAILURE_POLL_S = 0.5  # how often each rank looks for another rank's failure
FAILURE_WAIT_S = 10.0  # how long a failing rank waits for the others to have reported it before it exits


class RankFailed(RuntimeError):
    """A rank's training raised: the one-line message names the first failing rank and its error, on every rank.
    The failing rank has already printed that line (`failures_end_every_rank`), so the CLI does not repeat it."""


def _one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())}"[:500]


def _watch(store, reporting: _Reporting, heartbeat=None) -> None:
    """Until the training thread stops (`reporting`): when another rank's failure appears in the store (or the
    store, hosted by rank 0 or by torchrun's agent, is gone), print its one line and end this process now: it may be
    blocked in a collective that would otherwise wait for `train.dist_timeout_min` (NCCL does not notice a dead
    peer). `heartbeat` (train.heartbeat): this rank's progress is published, and a rank stalled past its timeout is a
    failure too."""
    while not reporting.stopped.wait(FAILURE_POLL_S):
        try:
            if not rendezvous.store_reachable(store):  # a call on a dead store prints a C++ stack dump
                raise ConnectionError("its host accepts no connection")
            hung = heartbeat.check(store) if heartbeat is not None else None  # a hung rank (train.heartbeat)
            if hung is not None:
                store.compare_set(FAILED_KEY, "", hung)
                store.set(HUNG_KEY, "1")  # every rank (the hung one too) counts itself seen before exiting
                store.set(REPORTED_KEY, "1")  # the line is the detector's: no failing rank will print it
            if not store.check([FAILED_KEY]):
                continue
            message = store.get(FAILED_KEY).decode()
            store.add(SEEN_KEY, 1)
            # the failing rank prints its own line first: a launcher ends every rank once this one exits
            deadline = time.monotonic() + FAILURE_WAIT_S
            while not store.check([REPORTED_KEY]) and time.monotonic() < deadline:
                time.sleep(FAILURE_POLL_S / 5)
        except Exception as err:  # the store is unreachable: its host ended (a rank that finished first, too)
            if reporting.stopped.wait(FAILURE_WAIT_S):  # this rank is finishing as well
                return
            message = f"the process group's store is gone ({_one_line(err)}): rank 0 or the launcher ended"
        if not reporting.claim():  # this rank failed itself, or finished, meanwhile: nothing for the watcher to say
            return
        print(f"sharpclip: rank {rank()} stops: {message}", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):  # after a hang no failing rank waits; the store's host (rank 0
            # without torchrun) stays until every rank has read the line
            if store.check([HUNG_KEY]):
                deadline = time.monotonic() + FAILURE_WAIT_S
                while store.add(SEEN_KEY, 0) < world_size() and time.monotonic() < deadline:
                    time.sleep(FAILURE_POLL_S / 5)
        os._exit(1)


class _Reporting:
    """Who reports this rank's end: the watcher (another rank failed or hung) or the training thread (this rank
    raised), whichever claims it first, so a collective broken by the watcher's report is not reported again."""

    def __init__(self) -> None:
        self.stopped = threading.Event()  # set by the training thread's claim, or when it leaves the loop
        self._lock, self._watcher = threading.Lock(), False

    def claim(self) -> bool:
        """The watcher's claim: False when the training thread stopped first."""
        with self._lock:
            self._watcher = not self.stopped.is_set()
            return self._watcher

    def stop(self) -> bool:
        """The training thread's claim (and the watcher's stop): False when the watcher reports already."""
        with self._lock:
            self.stopped.set()
            return not self._watcher


@contextlib.contextmanager
def failures_end_every_rank(heartbeat=None) -> Iterator[None]:
    """Around the training loop on several ranks: an exception on any rank ends every rank promptly, each with one
    line naming the first failing rank and its error (RankFailed on the failing rank; the others print it and exit
    with status 1), instead of leaving them in a collective until the process group's timeout.

    The failing rank writes its error into the process group's key-value store (one key: the first failure wins),
    prints the line itself (a launcher may end it as soon as another rank exits, so it does not leave that to the
    CLI), marks it reported and waits up to FAILURE_WAIT_S for the others to have seen it; a thread on every rank
    polls the key and exits once the line is reported. Nothing changes on one process.

    `heartbeat` (train.heartbeat.Heartbeat): the same thread publishes this rank's progress and ends every rank,
    with one line naming the stalled rank, when one makes no progress for train.hang_timeout_min."""
    if world_size() == 1:
        yield
        return
    store = dist.distributed_c10d._get_default_store()
    reporting = _Reporting()
    threading.Thread(target=_watch, args=(store, reporting, heartbeat), daemon=True,
                     name="sharpclip-failures").start()  # fmt: skip
    try:
        yield
    except Exception as err:
        if not reporting.stop():  # the watcher is already ending this rank (another rank failed, or hung): a
            # collective broken by that ends here too; the watcher's line stands and it exits with status 1
            threading.Event().wait(3 * FAILURE_WAIT_S)
            os._exit(1)
        first = f"rank {rank()} failed: {_one_line(err)}"
        alive = rendezvous.store_reachable(store)  # its host (rank 0) may be what failed: no calls, no C++ dumps
        # the store is gone (its host ended): our own line still stands
        with contextlib.suppress(Exception), rendezvous.c10d_stderr_silenced():
            first = store.compare_set(FAILED_KEY, "", first).decode() if alive else first  # unset: ours
        print(f"sharpclip: {first}", file=sys.stderr, flush=True)
        try:
            if not alive:
                raise ConnectionError("the store is gone")
            with rendezvous.c10d_stderr_silenced():
                store.set(REPORTED_KEY, "1")
                deadline = time.monotonic() + FAILURE_WAIT_S
                while store.add(SEEN_KEY, 0) < world_size() - 1 and time.monotonic() < deadline:
                    time.sleep(FAILURE_POLL_S / 5)
        except Exception:  # the store is gone (its host ended): nothing more to tell anyone
            pass
        raise RankFailed(first) from err
    finally:
        reporting.stopped.set()
