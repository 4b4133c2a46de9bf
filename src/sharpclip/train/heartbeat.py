"""A hung rank ends the job: each rank's progress, published through the process group's store by the failure
watcher (`failures.failures_end_every_rank`), and the one line that names a rank that stopped making progress.

A rank that deadlocks or waits on stuck I/O raises nothing, so the failure watcher alone would leave every rank in
a collective until `train.dist_timeout_min` (60 minutes by default). The trainer's main thread beats after every
optimiser step (`beat`); the watcher thread, which runs whatever the main thread is stuck in, publishes this rank's
step and how long it has gone without a beat (its own monotonic clock: hosts' clocks need not agree) and reads the
other ranks'. When a rank has gone without a beat for `train.hang_timeout_min`, the rank stalled longest (the one
that stopped first: the others stalled later, waiting for it in a collective) is named in one line on every rank,
and every rank exits with status 1.

Saves and validations are long, legitimate pauses in which no step is taken: `busy` marks them and they are bounded
by `train.dist_timeout_min` instead. Detection is armed once every rank has taken its first step (compilation and
the first step's memory trials are not a hang), and `train.hang_timeout_min` is 0 (off) or at least
config.HANG_FLOOR_MIN (3 s): a shorter one would stop a healthy run between two steps.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator

clock = time.monotonic  # seconds, this host's own (tests replace it)

BEAT_KEY = "sharpclip/beat/{rank}"


class Heartbeat:
    """This rank's progress (written by the main thread, read by the watcher) and the check over every rank's.

    Progress counts twice per step: a step done (`beat(step)`), and arrival at the next step's flags agreement
    with a batch in hand (`beat(step, arrived=True)`), so a rank that waits for another in that agreement is ahead
    of the rank it waits for."""

    def __init__(self, timeout_min: float, rank: int, world: int):
        self.timeout_s, self.rank, self.world = 60.0 * timeout_min, rank, world
        self.step: int | None = None  # the last step this process took (None: none yet, detection not armed)
        self.progress = -1
        self.since = clock()  # when the main thread last made progress
        self.busy_with = ""  # a long pause that is not a hang (a save, a validation)
        self._published = 0.0

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0 and self.world > 1

    def beat(self, step: int, arrived: bool = False) -> None:
        """The main thread finished optimiser step `step` (or, `arrived`, holds the next batch and enters the
        agreement before step `step` + 1)."""
        self.progress, self.since = 2 * step + int(arrived), clock()
        if not arrived:
            self.step = step

    @contextlib.contextmanager
    def busy(self, what: str) -> Iterator[None]:
        """A pause in which no step is taken (a checkpoint save, a validation): not counted as a hang."""
        self.busy_with = what
        try:
            yield
        finally:
            self.busy_with, self.since = "", clock()

    def interval(self) -> float:
        """Seconds between two publications: a tenth of the timeout, between 0.5 and 5 s."""
        return min(5.0, max(0.5, self.timeout_s / 10))

    def check(self, store) -> str | None:
        """Publish this rank's beat; return the one-line verdict when a rank has stalled past the timeout."""
        now = clock()
        if not self.enabled or now - self._published < self.interval():
            return None
        self._published = now
        stalled = 0.0 if self.step is None or self.busy_with else now - self.since
        beat = {"step": self.step, "progress": self.progress, "stalled": stalled}
        store.set(BEAT_KEY.format(rank=self.rank), json.dumps(beat))
        keys = [BEAT_KEY.format(rank=r) for r in range(self.world)]
        if not store.check(keys):  # a rank has not published yet
            return None
        return verdict([json.loads(v) for v in _get_all(store, keys)], self.timeout_s)


def verdict(beats: list[dict], timeout_s: float) -> str | None:
    """The line naming the rank(s) furthest behind, once some rank has stalled for `timeout_s` or more; else None.
    Not before every rank has taken its first step (start-up, compilation and the first step's memory trials are not
    a hang, and a rank with no step yet has no step to name)."""
    stalled = max(b["stalled"] for b in beats)
    if stalled < timeout_s or any(b["step"] is None for b in beats):
        return None
    low = min(b["progress"] for b in beats)
    behind = [r for r, b in enumerate(beats) if b["progress"] == low]
    step = beats[behind[0]]["step"]
    setting = f"train.hang_timeout_min={timeout_s / 60:g}"
    if len(behind) == len(beats):  # every rank inside the same step: none is waiting for another at its start
        return (f"no rank made progress for {stalled:.0f} s after step {step}: every rank is inside step "
                f"{(step or 0) + 1} (a deadlock or stuck I/O; {setting}); every rank stops")  # fmt: skip
    names = ", ".join(map(str, behind))
    return (f"rank {names} made no progress for {stalled:.0f} s after step {step} while the others waited for it "
            f"(a deadlock or stuck I/O; {setting}); every rank stops")  # fmt: skip


def _get_all(store, keys: list[str]) -> list[str]:
    """Every key's value in one round trip where the store has `multi_get`, else one get each."""
    try:
        values = store.multi_get(keys)
    except (AttributeError, NotImplementedError, RuntimeError):  # an older store, or a wrapper without it
        values = [store.get(k) for k in keys]
    return [v.decode() if isinstance(v, bytes | bytearray) else bytes(v).decode() for v in values]
