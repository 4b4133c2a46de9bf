"""The run directory's policy: who may write into it, and when: a fresh run, a resume, or an explicit overwrite.

A run directory holds one run. `sharpclip train` refuses one that already holds something unless `--resume`
(continue that run) or `--overwrite` (empty it first) says what to do with it, because mixing two runs loses both:
an older run's higher step numbers look newer to pruning, `metrics.jsonl` interleaves them and `config.yaml` lies.

A folder is a run directory only by sharpclip's own evidence: the marker `.sharpclip-run`, written the moment a run
takes the folder (before the model is built, so a run killed during start-up is still recognised), or the checkpoint
layout (`checkpoints/step-*/trainer_state.json`, for runs written before the marker existed). A `config.yaml` alone
proves nothing: many projects have one. `--overwrite` deletes only the files and folders a run writes (`RUN_FILES`,
`RUN_FOLDERS`, and inside tensorboard/, wandb/ and eval/ only what their writers write) and refuses, naming them,
when anything else is there; the refusal of a fresh run suggests `--overwrite` only when that would be safe.

While a run writes, `.sharpclip.lock` holds the writer's host and pid and an `flock` that the writer keeps for its
whole life. The lock file is written completely under a temporary name and then hard-linked into place, so it never
exists half-written; liveness comes from the flock (a pid can be reused: a container's entrypoint is always pid 1),
the pid only names the holder in messages. A lock whose flock is free was left by a dead writer and is taken over
with a warning; an unreadable one, or one from another host (whose flock this host cannot see), is treated as live.
A temporary copy left by a writer killed before linking it is deleted by the next run that takes the lock.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import shutil
import socket
import time
import uuid
from pathlib import Path

from sharpclip import owned_files
from sharpclip.train.logging import log

LOCK = ".sharpclip.lock"
MARKER = ".sharpclip-run"  # written when a run takes the folder: sharpclip's own evidence that it is a run directory
CHECKPOINTS = "checkpoints"
RUN_FILES = frozenset({
    MARKER, "config.yaml", "metrics.jsonl", "diagnostics.jsonl", "train.log", "resumes.jsonl", "guards_initial.json",
    "wandb_id",
})  # fmt: skip
RUN_FOLDERS = frozenset({CHECKPOINTS, "tensorboard", "wandb", "eval"})  # what the trainer and its sinks create
MODES = ("fresh", "resume", "overwrite")
STALE_COPY_SECONDS = 60.0  # a temporary lock copy this old, its flock free, was left by a killed writer


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked (not empty, locked by a live process, not a run directory)."""


def contents(path: Path) -> list[str]:
    """The names in `path` other than the lock file and its temporary copies (empty when `path` does not exist)."""
    if not path.is_dir():
        return []
    return sorted(p.name for p in path.iterdir() if not p.name.startswith(LOCK))


def is_run_dir(path: Path) -> bool:
    """Whether sharpclip's own evidence says `path` holds a run: its marker, or a checkpoint's trainer_state.json."""
    return (path / MARKER).is_file() or any((path / CHECKPOINTS).glob("step-*/trainer_state.json"))


def foreign(path: Path) -> list[str]:
    """The entries of run directory `path` that a run does not write (relative names; empty when it is clean)."""
    found = [n for n in contents(path) if n not in RUN_FILES | RUN_FOLDERS or (path / n).is_symlink()]
    found += [n for n in contents(path) if n in RUN_FOLDERS and not (path / n).is_dir()]
    ckpts = path / CHECKPOINTS
    if ckpts.is_dir() and not ckpts.is_symlink():
        found += [f"{CHECKPOINTS}/{p.name}" for p in sorted(ckpts.iterdir()) if not _is_checkpoint_entry(p)]
    return sorted(found + _foreign_reports(path) + _foreign_sink_files(path))


def _foreign_reports(path: Path) -> list[str]:
    """Files under the run's eval/ that sharpclip's reports did not write (their folders' `owned_files` records
    say): a user's notes beside `eval/<checkpoint>/eval_report.md` are never deleted with the folder."""
    folder = path / "eval"
    if not folder.is_dir() or folder.is_symlink():
        return []
    files = [p for p in sorted(folder.rglob("*")) if p.is_symlink() or not p.is_dir()]
    return [str(p.relative_to(path)) for p in files if p.name != owned_files.REGISTRY and not owned_files.is_ours(p)]


WANDB_TOP = frozenset({"latest-run", "debug.log", "debug-internal.log", "settings"})  # besides run-* folders


def _foreign_sink_files(path: Path) -> list[str]:
    """Entries under the run's tensorboard/ and wandb/ that those sinks do not write: TensorBoard writes only event
    files (`events.out.tfevents.*`, in sub-folders too), wandb its run folders (`run-*`, `offline-run-*`) and
    `WANDB_TOP` (links in recent versions). Anything else is a user's, never deleted with the folder."""
    found = []
    tensorboard = path / "tensorboard"
    if tensorboard.is_dir() and not tensorboard.is_symlink():
        for p in sorted(tensorboard.rglob("*")):
            if p.is_symlink() or (not p.is_dir() and not p.name.startswith("events.out.tfevents.")):
                found.append(str(p.relative_to(path)))
    wandb = path / "wandb"
    if wandb.is_dir() and not wandb.is_symlink():
        for p in sorted(wandb.iterdir()):
            runs = p.name.startswith(("run-", "offline-run-")) and p.is_dir() and not p.is_symlink()
            if not runs and p.name not in WANDB_TOP:
                found.append(str(p.relative_to(path)))
    return found


def _is_checkpoint_entry(p: Path) -> bool:
    """step-*/ folders, their interrupted .step-*.tmp writes, best.json and its temporary file."""
    if p.is_symlink():
        return False
    if p.name.startswith(("step-", ".step-")):
        return p.is_dir()
    return p.name in ("best.json", ".best.json.tmp") and p.is_file()


def _shown(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f", ... ({len(names)} in all)" if len(names) > 5 else "")


def check_run_dir(path: Path, mode: str, resumable: bool = True) -> None:
    """Raise `RunDirError` unless `path` may be used for `mode` (fresh | resume | overwrite); writes nothing.
    `resumable`: whether the command can continue a run (`--resume`), which its refusals then suggest."""
    if mode not in MODES:
        raise ValueError(f"run directory mode {mode!r} is not one of {', '.join(MODES)}")
    if path.exists() and not path.is_dir():
        raise RunDirError(f"train.output_dir={path} is a file, not a folder; choose a folder for the run")
    found = contents(path)
    if not found or mode == "resume":
        return
    run, extra = is_run_dir(path), foreign(path)
    resume = f"continue that run with `--resume {path}`, " if resumable else ""
    if mode == "fresh" and run and extra:  # --overwrite would refuse: do not suggest it
        raise RunDirError(
            f"train.output_dir={path} holds a run and files a run does not write ({_shown(extra)}); "
            f"{resume}choose a new train.output_dir"
        )
    if mode == "fresh" and run:
        raise RunDirError(
            f"train.output_dir={path} is not empty ({_shown(found)}); {resume}replace it with `--overwrite`, or "
            "choose a new train.output_dir"
        )
    if not run:
        raise RunDirError(
            f"train.output_dir={path} is not empty ({_shown(found)}) and is not a sharpclip run directory (no "
            f"{MARKER} nor checkpoints/step-*/trainer_state.json); sharpclip will not write into it or empty it: "
            "choose a new train.output_dir"
        )
    if mode == "overwrite" and extra:
        raise RunDirError(
            f"--overwrite: the run directory {path} also holds files a run does not write ({_shown(extra)}); "
            "refusing to delete them: move them away, or choose a new train.output_dir"
        )


def empty_dir(path: Path) -> None:
    """Delete what a run writes in `path` (`RUN_FILES`, `RUN_FOLDERS`), nothing else; the lock file stays."""
    for name in contents(path):
        child = path / name
        if child.is_symlink():
            continue  # never followed, never ours
        if name in RUN_FILES and child.is_file():
            child.unlink()
        elif name in RUN_FOLDERS and child.is_dir():
            _remove_run_folder(child)


def remove_if_empty(path: Path) -> None:
    """Remove folder `path` when nothing is left in it (a fresh run that failed to start, after `empty_dir`)."""
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
            path.rmdir()


def _remove_run_folder(folder: Path) -> None:
    if folder.name != CHECKPOINTS:
        shutil.rmtree(folder)  # tensorboard/, wandb/, eval/: only the sinks' and reports' files (`foreign`)
        return
    for entry in folder.iterdir():
        if _is_checkpoint_entry(entry):
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    with contextlib.suppress(OSError):  # kept when anything else is left in it
        folder.rmdir()


def write_marker(path: Path) -> None:
    """Mark `path` as a sharpclip run directory (the evidence `is_run_dir` reads), with a new run id that every
    checkpoint of the run records (train.checkpoint: a checkpoint of another run is never resumed as this one's)."""
    when = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    record = {"created": when, "pid": os.getpid(), "run_id": uuid.uuid4().hex}
    (path / MARKER).write_text(json.dumps(record) + "\n")


def run_id(path: Path) -> str | None:
    """The run id in `path`'s marker (None for a run started before markers held one, or without a marker)."""
    try:
        found = json.loads((path / MARKER).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, str) else None


class RunLock:
    """`.sharpclip.lock` in a run directory: linked into place whole, flock-held while this process runs."""

    def __init__(self, directory: Path):
        self.path = Path(directory) / LOCK
        self.owner = {"host": socket.gethostname(), "pid": os.getpid()}
        self.held = False
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        """Take the lock; a live holder → `RunDirError` naming its pid; a dead one's lock is taken over (warning)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = self._prepared()
        try:
            for _ in range(5):
                try:
                    os.link(tmp, self.path)  # atomic: the lock exists complete or not at all
                except FileExistsError:
                    if self._take_over_if_stale(tmp):
                        break
                    continue
                break
            else:
                raise RunDirError(f"{self.path}: could not take the lock; another run is starting there")
        except BaseException:
            os.close(fd)
            raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        self._fd, self.held = fd, True
        self._sweep_dead_copies()
        return self

    def _sweep_dead_copies(self) -> None:
        """Delete temporary lock copies that a writer killed between writing and linking one left behind: older than
        STALE_COPY_SECONDS with a free flock. A starter's copy lives for microseconds and is flock-held from just after
        its creation, so the age keeps that instant safe too."""
        for copy in self.path.parent.glob(f"{LOCK}.*"):
            try:
                if time.time() - copy.stat().st_mtime < STALE_COPY_SECONDS:
                    continue
                fd = os.open(copy, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # another process is starting: its copy is live
            else:
                with contextlib.suppress(FileNotFoundError):
                    copy.unlink()
            finally:
                os.close(fd)

    def _prepared(self) -> tuple[int, Path]:
        """A complete lock file under a temporary name, flock-held by this process."""
        tmp = self.path.with_name(f"{LOCK}.{self.owner['pid']}.{os.urandom(4).hex()}")
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, json.dumps(self.owner).encode())
        os.fsync(fd)
        return fd, tmp

    def _holder(self, fd: int) -> dict | None:
        try:
            os.lseek(fd, 0, os.SEEK_SET)
            holder = json.loads(os.read(fd, 4096).decode())
        except (OSError, ValueError):
            return None
        return holder if isinstance(holder, dict) else None

    def _take_over_if_stale(self, tmp: Path) -> bool:
        """True when the existing lock was stale and `tmp` (ours) replaced it; False to retry (it vanished or
        changed); raises `RunDirError` when it is held."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RunDirError(self._in_use(self._holder(fd))) from None
            if not _same_file(fd, self.path):  # replaced or released while we looked: look again
                return False
            holder = self._holder(fd)
            if holder is None or holder.get("host") != self.owner["host"]:  # unreadable, or another host's: live
                raise RunDirError(self._in_use(holder))
            log.warning("taking over the stale lock %s (pid %s is no longer running)", self.path, holder.get("pid"))
            os.replace(tmp, self.path)  # under the dead lock's flock: no one else can be taking it over now
            return True
        finally:
            os.close(fd)

    def _in_use(self, holder: dict | None) -> str:
        where = self.path.parent
        if holder is None:
            return (
                f"{where} is in use ({self.path} is unreadable: a run starting there, or one whose start crashed); "
                "wait for it, or delete the lock file if no training runs there"
            )
        pid, host = holder.get("pid"), holder.get("host")
        if host != self.owner["host"]:
            return (
                f"{where} is in use by pid {pid} on host {host} ({self.path}); wait for it to finish, or delete the "
                "lock file if that run is gone"
            )
        return (
            f"{where} is in use by a running training, pid {pid} ({self.path}); wait for it, or train into another "
            "train.output_dir"
        )

    def release(self) -> None:
        """Remove the lock file if it is still ours, then drop the flock."""
        if self._fd is not None:
            if _same_file(self._fd, self.path):
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
            os.close(self._fd)
        self._fd, self.held = None, False

    def __enter__(self) -> RunLock:
        return self if self.held else self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def open_run_dir(path: str | Path, mode: str, resumable: bool = True) -> RunLock:
    """Take `path`'s lock, check it for `mode` under the lock, empty it under `overwrite` and mark it (fresh and
    overwrite); returns the held lock. `resumable`: as `check_run_dir`."""
    path = Path(path)
    check_run_dir(path, mode, resumable)  # before creating anything: a refused folder is left exactly as it was
    lock = RunLock(path).acquire()
    try:
        check_run_dir(path, mode, resumable)  # again under the lock: another run may have started in between
        if mode == "overwrite" and contents(path):
            log.warning("emptying the run directory %s (overwrite)", path)
            empty_dir(path)
        if mode != "resume":
            write_marker(path)
    except BaseException:
        lock.release()
        raise
    return lock
