"""The run directory's policy: who may write into it, and when: a fresh run, a resume, or an explicit overwrite.

A run directory holds one run. `sharpclip train` refuses one that already holds something unless `--resume`
(continue that run) or `--overwrite` (empty it first) says what to do with it, because mixing two runs loses both:
an older run's higher step numbers look newer to pruning, `metrics.jsonl` interleaves them and `config.yaml` lies.

While a run writes, `.sharpclip.lock` in the directory holds the writer's host and pid. A second run into the same
directory refuses with that pid; a lock left by a process that no longer exists on this host (a crash, SIGKILL) is
taken over with a warning. The lock file alone does not make a directory "non-empty".
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
from pathlib import Path

from sharpclip.train.logging import log

LOCK = ".sharpclip.lock"
RUN_MARKERS = ("config.yaml", "metrics.jsonl", "checkpoints")  # what makes a folder a sharpclip run directory
MODES = ("fresh", "resume", "overwrite")


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked (not empty, locked by a live process, not a run directory)."""


def contents(path: Path) -> list[str]:
    """The names in `path` other than the lock file (empty when `path` does not exist)."""
    if not path.is_dir():
        return []
    return sorted(p.name for p in path.iterdir() if p.name != LOCK)


def check_run_dir(path: Path, mode: str) -> None:
    """Raise `RunDirError` unless `path` may be used for `mode` (fresh | resume | overwrite); writes nothing."""
    if mode not in MODES:
        raise ValueError(f"run directory mode {mode!r} is not one of {', '.join(MODES)}")
    if path.exists() and not path.is_dir():
        raise RunDirError(f"train.output_dir={path} is a file, not a folder; choose a folder for the run")
    found = contents(path)
    if mode == "fresh" and found:
        shown = ", ".join(found[:5]) + (", ..." if len(found) > 5 else "")
        raise RunDirError(
            f"train.output_dir={path} is not empty ({shown}); continue that run with `--resume {path}`, replace it "
            "with `--overwrite`, or choose a new train.output_dir"
        )
    if mode == "overwrite" and found and not any(name in found for name in RUN_MARKERS):
        raise RunDirError(
            f"--overwrite: {path} holds files but is not a sharpclip run directory (no config.yaml, metrics.jsonl or "
            "checkpoints/); refusing to empty it: choose another train.output_dir"
        )


def empty_dir(path: Path) -> None:
    """Delete everything in `path` except the lock file."""
    for name in contents(path):
        child = path / name
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class RunLock:
    """`.sharpclip.lock` in a run directory, created atomically; `release()` removes it (only if still ours)."""

    def __init__(self, directory: Path):
        self.path = Path(directory) / LOCK
        self.owner = {"host": socket.gethostname(), "pid": os.getpid()}
        self.held = False

    def acquire(self) -> RunLock:
        """Take the lock; a live holder → `RunDirError` naming its pid; a dead one's lock is taken over (warning)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.owner, f)
            self.held = True
            return self
        raise RunDirError(f"{self.path}: could not take the run directory's lock; another run is starting there")

    def _holder(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}  # unreadable: a writer died between creating and filling it

    def _take_over_if_stale(self) -> None:
        holder = self._holder()
        pid, host = holder.get("pid"), holder.get("host")
        if host not in (None, self.owner["host"]):
            raise RunDirError(
                f"{self.path.parent} is in use by pid {pid} on host {host} ({self.path}); wait for it to finish, "
                "or delete the lock file if that run is gone"
            )
        if isinstance(pid, int) and _pid_alive(pid):
            raise RunDirError(
                f"{self.path.parent} is in use by a running training, pid {pid} ({self.path}); wait for it, or train "
                "into another train.output_dir"
            )
        log.warning("taking over the stale lock %s (pid %s is no longer running)", self.path, pid)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def release(self) -> None:
        """Remove the lock file if this process still holds it."""
        if self.held and self._holder() == self.owner:
            try:
                self.path.unlink()
            except OSError as err:
                if err.errno != errno.ENOENT:
                    raise
        self.held = False

    def __enter__(self) -> RunLock:
        return self if self.held else self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def open_run_dir(path: str | Path, mode: str) -> RunLock:
    """Check `path` for `mode`, take its lock, and empty it under `overwrite`; returns the held lock."""
    path = Path(path)
    check_run_dir(path, mode)
    lock = RunLock(path).acquire()
    try:
        if mode == "overwrite" and contents(path):
            log.warning("emptying the run directory %s (overwrite)", path)
            empty_dir(path)
    except BaseException:
        lock.release()
        raise
    return lock
