"""Checkpoints of a run: written whole or not at all, pruned to the last N and the best, resumed exactly.

Layout under `<run>/checkpoints/`:

    step-000120/                 one checkpoint
        model.safetensors, ...   the model, as models.factory.save_checkpoint writes it (loadable and exportable)
        training_state.pt        optimizer and scheduler state dicts and RNG states (tensors, numbers, lists only:
                                 read back with torch.load(weights_only=True))
        trainer_state.json       step, epoch, the loader's position, the best metric so far
    best.json                    {"name": "step-000100", "metric": ...}

A checkpoint is written into `.step-000120.tmp/` and renamed when complete, so a crash mid-write leaves only a
temporary folder that `latest()` ignores and the next save removes. A checkpoint whose weights made every later step
fail is marked with `diverged.json` and is no longer listed (resume falls back to the one before it).

Reading one back (`load`) checks each of its three files and raises `CorruptCheckpoint` naming the bad one; a run's
resume then falls back to the previous complete checkpoint (train.resume.pick_checkpoint). The model part is read
back by the code that wrote it (models.factory.read_weights / save_weights), so the two can never disagree on the
layout. `resolve_source` is how the commands that read a run (export, blend, eval) pick one of its checkpoints.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError

from sharpclip.models.factory import CHECKPOINT_CONFIG, WEIGHTS, read_weights

_log = logging.getLogger("sharpclip.train")
TRAINING_STATE = "training_state.pt"
TRAINER_STATE = "trainer_state.json"
BEST = "best.json"
DIVERGED = "diverged.json"
LOW_SPACE = 1 << 20  # bytes free below which a failed write is put down to a full disk


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written (disk full, permissions) or read back; the message names the path."""


class CorruptCheckpoint(CheckpointError):
    """One file of a checkpoint is truncated or unreadable; `path` is that file."""

    def __init__(self, path: Path, reason: str):
        self.path = path
        super().__init__(f"{path}: {reason}")


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """Every generator a training step may draw from: torch CPU (and the training GPU's), numpy, Python.

    Only the training device's CUDA generator is kept (as a one-element list): it is the one its dropout draws from.
    """
    np_state = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": [torch.cuda.get_rng_state(device)] if device is not None and device.type == "cuda" else [],
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached": float(np_state[4]),
        },
        "python": {"version": py_version, "state": list(py_state), "gauss": py_gauss},
    }


def seed_rngs(seed: int) -> None:
    """Seed every generator `rng_state` saves: torch's CPU and CUDA ones, numpy's, Python's."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed % 2**64)  # torch takes 64 bits (resume adds rank and 1,000,003 per step)


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Restore `rng_state`'s generators; the CUDA one onto `device` when that is a GPU (a run saved on the CPU, or
    resumed there, has no CUDA state to restore: the device's generator keeps its seed)."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"][0], device)
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))


def save(
    directory: Path,
    step: int,
    write_model: Callable[[Path], Any],
    training_state: dict[str, Any],
    trainer_state: dict[str, Any],
) -> Path:
    """Write checkpoint `step` atomically (temporary folder, then rename); returns its final path."""
    final = directory / checkpoint_name(step)
    tmp = directory / f".{final.name}.tmp"
    for path in (final, tmp):  # replaced below: never through a link, never someone else's file
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            raise CheckpointError(
                f"cannot write checkpoint {final.name}: {path} exists and is not sharpclip's own checkpoint folder "
                "(a symbolic link or a file); move it out of the run directory and resume"
            )
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write_model(tmp)
        torch.save(training_state, tmp / TRAINING_STATE)
        (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=2))
        fault_point("checkpoint", step)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except (OSError, RuntimeError, SafetensorError) as err:  # disk full, read-only, permissions: one clear line
        reason = _write_failure(err, tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if reason is None:
            raise
        raise CheckpointError(f"cannot write checkpoint to {directory}: {reason}") from err
    return final


def _write_failure(err: Exception, tmp: Path) -> str | None:
    """Why writing into `tmp` failed, in words; None for an error that is not about the file system (a bug).

    torch.save reports a full disk as a RuntimeError ("unexpected pos ..."), safetensors as a SafetensorError:
    either counts as a full disk when the message says so or the file system has (next to) no space left."""
    if isinstance(err, OSError):
        return (err.strerror or str(err) or type(err).__name__).lower()
    try:
        free = shutil.disk_usage(tmp if tmp.exists() else tmp.parent).free
    except OSError:
        free = None
    if "no space left" in str(err).lower() or (free is not None and free < LOW_SPACE):
        return "no space left on device"
    return None


def load_training_state(checkpoint: Path) -> dict[str, Any]:
    """Optimizer, scheduler and RNG states, on the CPU whatever device wrote them (the optimizer's `load_state_dict`
    moves its state to the parameters' device); tensors and plain values only: no pickled objects are executed."""
    path = checkpoint / TRAINING_STATE
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CorruptCheckpoint(path, "missing") from None
    except Exception as err:  # truncated zip, or an object the safe unpickler refuses (never retried unsafely)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if "weights only" in first.lower():
            first = "holds objects other than tensors and plain values (not written by sharpclip)"
        raise CorruptCheckpoint(path, f"unreadable training state: {first[:200]}") from None


def load_trainer_state(checkpoint: Path) -> dict[str, Any]:
    """Step, epoch, loader position and best metric, as `save` wrote them."""
    path = checkpoint / TRAINER_STATE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CorruptCheckpoint(path, f"unreadable trainer state: {err}") from None
    if not isinstance(state, dict) or "step" not in state or "loader" not in state:
        raise CorruptCheckpoint(path, "unreadable trainer state: not the JSON object sharpclip writes")
    return state


def load_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model's state dict, read by models.factory.read_weights (what wrote it); a missing, truncated or malformed
    file raises `CorruptCheckpoint`."""
    path = checkpoint / WEIGHTS
    if not path.is_file():
        raise CorruptCheckpoint(path, "missing")
    try:
        return read_weights(checkpoint)
    except ValueError as err:  # bad header, file shorter than its header says
        raise CorruptCheckpoint(path, str(err).removeprefix(f"{path}: ")) from None


def load(checkpoint: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(weights, training state, trainer state) of `checkpoint`, each checked; `CorruptCheckpoint` names a bad file."""
    trainer_state = load_trainer_state(checkpoint)
    return load_weights(checkpoint), load_training_state(checkpoint), trainer_state


def all_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints, oldest first (interrupted .tmp writes, diverged checkpoints and entries that are not
    sharpclip's own folders, such as a symbolic link to one, are not listed: see `prune`)."""
    return sorted(p for p in _complete(directory) if _own_entry(p))


def _complete(directory: Path) -> list[Path]:
    found = directory.glob("step-*")
    return [p for p in found if (p / TRAINER_STATE).is_file() and not (p / DIVERGED).exists()]


def mark_diverged(checkpoint: Path, reason: str) -> None:
    """Keep `checkpoint` for inspection but out of resume, export and pruning: its weights made training fail.
    A best.json naming it is removed (the metric it recorded was measured on weights that then diverged)."""
    (checkpoint / DIVERGED).write_text(json.dumps({"reason": reason}, indent=2) + "\n")
    if best(checkpoint.parent) == checkpoint:
        (checkpoint.parent / BEST).unlink()
        logging.getLogger("sharpclip.train").warning(
            "removed %s: it named %s, which is marked diverged", checkpoint.parent / BEST, checkpoint.name
        )


def latest(directory: Path) -> Path | None:
    found = all_checkpoints(directory)
    return found[-1] if found else None


def mark_best(directory: Path, checkpoint: Path, metric: float) -> None:
    tmp = directory / f".{BEST}.tmp"
    tmp.write_text(json.dumps({"name": checkpoint.name, "metric": metric}))
    os.replace(tmp, directory / BEST)


def best(directory: Path) -> Path | None:
    """The checkpoint `best.json` names (None without one; an unreadable one is ignored with a warning)."""
    path = directory / BEST
    if not path.is_file():
        return None
    try:
        return directory / json.loads(path.read_text())["name"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        logging.getLogger("sharpclip.train").warning("ignoring unreadable %s (%s)", path, err)
        return None


_named_best = best  # for resolve_source, whose `best` flag shadows the name


def prune(directory: Path, keep_last: int, keep: tuple[Path, ...] = ()) -> None:
    """Delete all but the newest `keep_last` (≥ 1) checkpoints, the best one and `keep` (the one just written);
    also stale temporary folders.

    Only sharpclip's own entries are deleted: a `step-*` entry that is a symbolic link (its target is someone's
    data), or whose name is not `step-<digits>`, is skipped and named in a warning, and the rest is still pruned. A
    checkpoint that cannot be deleted (permissions) is named as well; pruning never fails a finished run."""
    if keep_last < 1:
        raise ValueError(f"train.keep_last must be >= 1, got {keep_last}: the newest checkpoint is always kept")
    kept = set(all_checkpoints(directory)[-keep_last:]) | set(keep)
    if (b := best(directory)) is not None:
        kept.add(b)
    skipped = sorted(p for p in _complete(directory) if not _own_entry(p))
    for path in all_checkpoints(directory):
        if path not in kept:
            _remove(path)
    for tmp in directory.glob(".step-*.tmp"):
        if _own_entry(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    if skipped:
        _log.warning("pruning left %s in place: not sharpclip's own checkpoint folder%s (a symbolic link is never "
                     "deleted through); move it out of %s", ", ".join(p.name for p in skipped),
                     "s" if len(skipped) > 1 else "", directory)  # fmt: skip


CHECKPOINT_NAME = re.compile(r"\.?step-\d+(\.tmp)?")  # checkpoint_name(step), and its temporary copy


def _own_entry(path: Path) -> bool:
    """A real folder (not a link to one) named as sharpclip names its checkpoints (step-<digits>)."""
    return not path.is_symlink() and path.is_dir() and CHECKPOINT_NAME.fullmatch(path.name) is not None


def _remove(path: Path) -> None:
    try:
        shutil.rmtree(path)
    except OSError as err:
        _log.warning("pruning: cannot delete %s (%s); the other checkpoints are pruned", path, err.strerror or err)


def fault_point(where: str, step: int) -> None:
    """Fault injection for crash tests: SHARPCLIP_FAULT=<where>:<step> kills the process here with SIGKILL;
    SHARPCLIP_RAISE=<where>:<step>[:<rank>] raises a RuntimeError here (on that rank only, when one is given);
    SHARPCLIP_SIGNAL=<where>:<step>:<SIGNAL>[:<rank>][;...] sends the process that signal here (stop tests);
    SHARPCLIP_HANG=<where>:<step>[:<rank>] sleeps here for an hour without raising (hang tests);
    SHARPCLIP_DELAY=<where>:<step>:<seconds> sleeps that long here."""
    if os.environ.get("SHARPCLIP_FAULT") == f"{where}:{step}":
        os.kill(os.getpid(), 9)
    rank = os.environ.get("RANK", "0")
    for entry in filter(None, os.environ.get("SHARPCLIP_SIGNAL", "").split(";")):
        at, name, only = entry.split(":")[:2], entry.split(":")[2], entry.split(":")[3:]
        if at == [where, str(step)] and only in ([], [rank]):
            os.kill(os.getpid(), getattr(signal, name))
    hang = os.environ.get("SHARPCLIP_HANG", "").split(":")
    if hang[:2] == [where, str(step)] and hang[2:] in ([], [rank]):
        time.sleep(3600)
    delay = os.environ.get("SHARPCLIP_DELAY", "").split(":")  # <where>:<step>:<seconds>
    if delay[:2] == [where, str(step)]:
        time.sleep(float(delay[2]))
    raised = os.environ.get("SHARPCLIP_RAISE", "").split(":")
    if raised[:2] == [where, str(step)] and raised[2:] in ([], [os.environ.get("RANK", "0")]):
        raise RuntimeError(f"injected fault at {where} {step}")


def resolve_source(source: str | Path, best: bool = False) -> Path:
    """A model folder (sharpclip checkpoint or transformers) as it is; a run directory's newest complete checkpoint,
    or with `best` the one best.json names. Raises `CheckpointError` saying what `source` lacks."""
    source = Path(source)
    is_model = (source / CHECKPOINT_CONFIG).is_file() or (source / "config.json").is_file()
    if is_model and not best:
        return source
    if is_model:
        raise CheckpointError(f"{source}: --best picks a checkpoint of a run directory; this is one model already")
    checkpoints, pick = source / "checkpoints", _named_best if best else latest
    found = pick(checkpoints) if checkpoints.is_dir() else None
    if found is None or not (found / CHECKPOINT_CONFIG).is_file():
        raise CheckpointError(_no_checkpoint(source, found, best))
    if (found / DIVERGED).is_file():  # a best.json older than the divergence (written before it was dropped)
        raise CheckpointError(
            f"{source}: best.json names {found.name}, which is marked diverged ({found / DIVERGED}); drop --best to "
            "use the newest complete checkpoint"
        )
    return found


def model_source(name: str, best: bool = False) -> tuple[str, str | None]:
    """(model.name, default report folder) for `sharpclip eval --model NAME [--best]`: a run directory becomes its
    newest complete checkpoint (or best) with reports in `<run>/eval/<checkpoint>` (one folder per checkpoint, so
    the reports of different checkpoints never overwrite each other); anything else is passed on as it is."""
    path = Path(name).expanduser()
    if (path / "checkpoints").is_dir() and not (path / CHECKPOINT_CONFIG).is_file():
        found = resolve_source(path, best)
        return str(found), str(path / "eval" / found.name)
    if best:
        raise CheckpointError(f"{name}: --best picks a checkpoint of a run directory (one with checkpoints/)")
    return name, None


def _no_checkpoint(source: Path, found: Path | None, best: bool) -> str:
    if best and found is not None:
        return f"{source}: best.json names {found.name}, which is not a complete checkpoint; drop --best"
    if best:
        return (
            f"{source}: no checkpoints/best.json (the trainer marks a best checkpoint when it validates); drop --best"
        )
    return (
        f"{source}: neither a sharpclip checkpoint ({CHECKPOINT_CONFIG} + {WEIGHTS}), a run directory with a "
        "complete checkpoints/step-*/ inside (interrupted .step-*.tmp writes are ignored), nor a transformers folder "
        "(config.json)"
    )
