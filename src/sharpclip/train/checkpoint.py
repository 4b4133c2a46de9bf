"""Checkpoints of a run: written whole or not at all, pruned to the last N and the best, resumed exactly.

Layout under `<run>/checkpoints/`:

    step-000120/                 one checkpoint
        model.safetensors, ...   the whole model in one file, as models.factory.save_checkpoint writes it (loadable
                                 and exportable): gathered once from every rank's shards, written by rank 0
        state/                   torch.distributed.checkpoint (DCP): the optimiser's state (each rank writes its
                                 shards; replicated tensors once), the scheduler and every rank's RNG states
        trainer_state.json       step, epoch, every rank's loader position, the best metric so far
    best.json                    {"name": "step-000100", "metric": ...}

Every rank calls `save`: rank 0 prepares `.step-000120.tmp/`, every rank writes its part of `state/` into it, rank 0
adds the model and the trainer state and renames the folder when complete, so a crash mid-write leaves only a
temporary folder that `latest()` ignores and the next save removes. Nothing complete is deleted before its
replacement is in place: a stale copy of the same step is renamed aside first (`swap_in`), and the end of an epoch at
a step already checkpointed replaces only that checkpoint's trainer state, by one atomic rename of a file
(`update_trainer_state`): the step is never written twice. The trainer state records the size and sha256 of every
other file (`file_digests`), an id of the checkpoint and the run's id (train.run_dir.run_id); `load` checks them
(`check_files`), so a damaged shard, another checkpoint's state or another run's checkpoint is a `CorruptCheckpoint`
naming the file, which resume falls back from. A checkpoint whose weights made every later step
fail is marked with `diverged.json` and is no longer listed (resume falls back to the one before it).

DCP reshards on load: the optimiser state is read into whatever layout the resuming run has (another world size,
replicated or sharded parameters, `load_sharded`), through `get_optimizer_state_dict` / `set_optimizer_state_dict`,
which serve plain modules and `fully_shard`ed ones alike; the model is loaded from the one safetensors file the same
way (`load_model`). Nothing is unpickled unchecked: DCP's metadata file is read with an unpickler that admits only
DCP's own record classes, torch sizes and dtypes (`SafeReader`), and its non-tensor values (the scheduler's numbers,
Python's RNG state) with torch.load(weights_only=True) (`SafeLoadPlanner`). Checkpoints written before `state/`
existed (a `training_state.pt`, read with weights_only=True: the whole optimiser state by parameter name) still
resume onto any layout: the trainer loads that state by name (train.engine).

`begin_save(asynchronous=True)` (the trainer's `train.async_checkpoint`, on CUDA) copies the sharded state to CPU
memory (dcp.async_save's staging) and writes it, with the model snapshot and the trainer state, in a background
thread; `PendingSave.wait()` renames the folder once everything is written, so a checkpoint is complete or absent
either way. The log gives each save's seconds (and how long training waited for an asynchronous one).

Reading one back (`load`) checks each of its three files and raises `CorruptCheckpoint` naming the bad one; a run's
resume then falls back to the previous complete checkpoint (train.resume.pick_checkpoint). The model part is read
back by the code that wrote it (models.factory.read_weights / save_weights), so the two can never disagree on the
layout. `resolve_source` is how the commands that read a run (export, blend, eval) pick one of its checkpoints.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import pickle
import random
import re
import shutil
import signal
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from torch import nn
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch < 2.5 kept it private
    from torch.distributed._tensor import DTensor

from sharpclip.eval.manifest import sha256_file
from sharpclip.models.factory import CHECKPOINT_CONFIG, WEIGHTS, read_weights, step_order
from sharpclip.train import run_dir

_log = logging.getLogger("sharpclip.train")
TRAINING_STATE = "training_state.pt"  # the optimiser, scheduler and RNG of checkpoints written before STATE
STATE = "state"  # the DCP folder of a checkpoint
TRAINER_STATE = "trainer_state.json"
BEST = "best.json"
DIVERGED = "diverged.json"
MANIFEST_KEYS = ("files", "id", "run_id")  # what a checkpoint's trainer_state.json records about its own files
DIGEST_BLOCK = 1 << 22  # bytes read at a time when a checkpoint's files are hashed
LOW_SPACE = 1 << 20  # bytes free below which a failed write is put down to a full disk
# DCP warns at every save and load without a process group (also from its background thread, where a local
# catch_warnings cannot reach); one process is a run sharpclip supports, so that one message is silenced
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


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


@contextlib.contextmanager
def rng_kept(device: torch.device | None = None) -> Iterator[None]:
    """Every generator `rng_state` saves is as it was before the block (a validation's DataLoader draws its seed
    from torch's): training's random streams do not depend on whether or how often it validates, and the
    checkpoint of an epoch's last step holds the streams its next epoch starts from."""
    saved = rng_state(device)
    try:
        yield
    finally:
        set_rng_state(saved, device)


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
    sharded: dict[str, Any],
    trainer_state: dict[str, Any],
    main: bool = True,
) -> Path:
    """Write checkpoint `step` atomically (temporary folder, then rename); returns its final path. Every rank calls
    it: `sharded` (`sharded_state`) goes through DCP from every rank; rank 0 (`main`) writes the model
    (`write_model(folder)`) and `trainer_state`, then renames."""
    return begin_save(directory, step, write_model, sharded, trainer_state, main).wait()


class PendingSave:
    """A checkpoint whose files are written (at once, or in the background); `wait()` renames it complete on rank 0
    and returns its path. Until then only its temporary folder exists, which resume ignores."""

    def __init__(self, directory: Path, step: int, main: bool, job: Future, started: float, blocked: float):
        self.directory, self.step, self.main, self._job = directory, step, main, job
        self.final = directory / checkpoint_name(step)
        self._started, self._blocked = started, blocked

    def wait(self) -> Path:
        tmp = self.directory / f".{self.final.name}.tmp"
        try:
            self._job.result()
            if self.main:
                fault_point("checkpoint", self.step)
                swap_in(tmp, self.final)
        except (OSError, RuntimeError, SafetensorError, CheckpointException) as err:  # disk full, permissions
            _write_failed(err, self.directory, tmp, self.main)
        if self.main:
            seconds = time.perf_counter() - self._started
            if not isinstance(self._job, _Done):
                _log.info("checkpoint %s written in %.2f s in the background (training waited %.2f s for it)",
                          self.final.name, seconds, self._blocked)  # fmt: skip
            else:
                _log.info("checkpoint %s written in %.2f s", self.final.name, seconds)
        return self.final


def swap_in(tmp: Path, final: Path) -> None:
    """Rename the complete folder `tmp` to `final`. A `final` already there (a checkpoint of this step from an
    abandoned attempt: the run resumed from an older one) is renamed aside to `.step-N.old` first and deleted only
    once the new copy is in place, so nothing complete is deleted before its replacement is complete; a kill in
    between leaves the resume point the run started from, and the next save or prune removes the leftover."""
    if not final.exists():
        os.replace(tmp, final)
        return
    aside = final.parent / f".{final.name}.old"
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(final, aside)
    fault_point("swap", int(final.name.removeprefix("step-")))
    os.replace(tmp, final)
    shutil.rmtree(aside, ignore_errors=True)


def update_trainer_state(checkpoint: Path, trainer_state: dict[str, Any]) -> None:
    """Record the end of an epoch in the complete checkpoint of its last step, which is already written (its
    weights and sharded state are the step's; validation changes neither): the trainer state (epoch, best metric,
    loader positions) is replaced by one atomic rename of a file, so the checkpoint is complete at every instant,
    and the step is never written twice. What `save` recorded about the files (`MANIFEST_KEYS`) is kept."""
    path, tmp = checkpoint / TRAINER_STATE, checkpoint / f".{TRAINER_STATE}.tmp"
    previous = load_trainer_state(checkpoint)
    kept = {k: previous[k] for k in MANIFEST_KEYS if k in previous}
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps({**trainer_state, **kept}, indent=2))
            f.flush()
            os.fsync(f.fileno())
        fault_point("update", int(trainer_state["step"]))
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"cannot write checkpoint to {checkpoint}: {_write_failure(err, tmp)}") from err


class _Done(Future):
    """The job of a checkpoint written at once."""

    def __init__(self) -> None:
        super().__init__()
        self.set_result(None)


_background: ThreadPoolExecutor | None = None
_cpu_groups: dict[int, Any] = {}  # id of the default process group → the group asynchronous saves coordinate on


def begin_save(
    directory: Path,
    step: int,
    write_model: Callable[[Path], Any],
    sharded: dict[str, Any],
    trainer_state: dict[str, Any],
    main: bool = True,
    asynchronous: bool = False,
) -> PendingSave:
    """Start writing checkpoint `step` (every rank); `asynchronous`: `sharded` is copied to CPU memory here
    (dcp.async_save's staging) and written, with rank 0's model and trainer state, in a background thread, so
    `write_model` must write a snapshot, not the live model. The returned `PendingSave.wait()` completes it."""
    final = directory / checkpoint_name(step)
    tmp = directory / f".{final.name}.tmp"
    if main:
        _prepare(final, tmp)
    _barrier()  # nobody writes into the temporary folder before rank 0 has emptied it
    start = time.perf_counter()

    def files() -> None:
        if main:
            write_model(tmp)
            manifest = {"files": file_digests(tmp), "id": uuid.uuid4().hex, "run_id": run_dir.run_id(directory.parent)}
            (tmp / TRAINER_STATE).write_text(json.dumps({**trainer_state, **manifest}, indent=2))

    try:
        if asynchronous:
            staged = _async_write(sharded, tmp / STATE)
            job: Future = _executor().submit(_then, staged, files)
        else:
            write_sharded(sharded, tmp / STATE)
            files()
            job = _Done()
    except (OSError, RuntimeError, SafetensorError, CheckpointException) as err:
        _write_failed(err, directory, tmp, main)
    return PendingSave(directory, step, main, job, start, time.perf_counter() - start)


def _async_write(state: dict[str, Any], folder: Path) -> Future:
    """dcp.async_save: staged to CPU memory now, written by a thread; its collectives run on a gloo group of their
    own (NCCL cannot serve a background thread's CPU collectives, and sharing the training's group would interleave
    the thread's collectives with the step's)."""
    group = None
    if _distributed():
        world = dist.group.WORLD
        if id(world) not in _cpu_groups:  # created once per process group, on every rank (new_group is collective)
            _cpu_groups[id(world)] = dist.new_group(backend="gloo")
        group = _cpu_groups[id(world)]
    staged = dcp.async_save(state, storage_writer=FileSystemWriter(folder), process_group=group,
                            no_dist=not _distributed())  # fmt: skip
    return staged if isinstance(staged, Future) else staged.upload_completion


def _executor() -> ThreadPoolExecutor:
    global _background
    if _background is None:
        _background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sharpclip-checkpoint")
    return _background


def _then(staged: Future, files: Callable[[], None]) -> None:
    staged.result()
    files()


def _write_failed(err: Exception, directory: Path, tmp: Path, main: bool) -> NoReturn:
    """Raise the one-line `CheckpointError` for a failed write (a bug's error as it is); rank 0 removes `tmp`."""
    reason = _write_failure(_first_cause(err), tmp)
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
    if reason is None:
        raise err
    raise CheckpointError(f"cannot write checkpoint to {directory}: {reason}") from err


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """`full_state(model)` as copies: tensors that still share memory with the model's (a model on the CPU) are
    cloned, so a background write sees the weights of this step while training goes on."""
    tensors = [t.to_local() if isinstance(t, DTensor) else t for t in [*model.parameters(), *model.buffers()]]
    live = {t.untyped_storage().data_ptr() for t in tensors}  # a DTensor's own storage cannot be read: its shard's
    return {k: v.clone() if v.untyped_storage().data_ptr() in live else v for k, v in full_state(model).items()}


def _prepare(final: Path, tmp: Path) -> None:
    """An empty temporary folder for `final`; refuses to replace anything that is not sharpclip's own folder."""
    for path in (final, tmp):  # replaced below: never through a link, never someone else's file
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            raise CheckpointError(
                f"cannot write checkpoint {final.name}: {path} exists and is not sharpclip's own checkpoint folder "
                "(a symbolic link or a file); move it out of the run directory and resume"
            )
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
    except OSError as err:
        raise CheckpointError(f"cannot write checkpoint to {final.parent}: {_write_failure(err, tmp)}") from err


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _first_cause(err: Exception) -> Exception:
    """The error under DCP's CheckpointException (which gathers every rank's failures), else `err`."""
    if isinstance(err, CheckpointException):
        found = [e for e in err.failures.values() if isinstance(e, Exception)]
        return found[0] if found else err
    return err


# -- the sharded part: DCP ---------------------------------------------------------------------------------------
def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's whole state dict on the CPU, gathered from every rank's shards (every rank must call it; rank 0
    receives the tensors, the others an empty dict when several processes run)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter is a DTensor (laid out over ranks by fully_shard)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, rngs: list) -> dict:
    """What DCP saves: the optimiser's state by parameter name (each rank its shards), the scheduler, and `rngs`,
    every rank's RNG states (gathered: the same list on every rank)."""
    return {"optimizer": get_optimizer_state_dict(model, optimizer), "scheduler": scheduler.state_dict(),
            "rng": {"ranks": rngs}}  # fmt: skip


def write_sharded(state: dict[str, Any], folder: Path) -> None:
    """Every rank writes its part of `state` into `folder` (rank 0 also DCP's metadata); synchronous. The seam for
    `dcp.async_save` on GPUs."""
    dcp.save(state, storage_writer=FileSystemWriter(folder), no_dist=not _distributed())


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's metadata records and nothing else: its own classes, torch.Size, dtypes, paths."""

    MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
    ALLOWED = frozenset({("torch.serialization", "_get_layout"), ("torch", "Size"), ("pathlib", "PosixPath"),
                         ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")})  # fmt: skip

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if module in self.MODULES or (module, name) in self.ALLOWED or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP checkpoint's metadata")


class SafeReader(FileSystemReader):
    """FileSystemReader whose metadata is read by `_MetadataUnpickler` (DCP's own reader unpickles anything)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = Path(self.path) / ".metadata"
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner reading non-tensor values with torch.load(weights_only=True)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        super().load_bytes(read_item, io.BytesIO(_safe_bytes(value)))

    def __init__(self, allow_partial_load: bool = False):
        super().__init__(allow_partial_load=allow_partial_load)


def _safe_bytes(value: io.BytesIO) -> bytes:
    """`value` unchanged after checking it loads with weights_only=True (the planner's own load then finds only
    plain values)."""
    raw = value.read()
    torch.load(io.BytesIO(raw), weights_only=True)
    return raw


def read_sharded(state: dict[str, Any], folder: Path, partial: bool = False) -> None:
    """Fill `state` in place from the DCP checkpoint in `folder`, resharded to this run's layout; `partial`: keys the
    checkpoint lacks keep their values. A missing or damaged folder raises `CorruptCheckpoint`."""
    if not (folder / ".metadata").is_file():
        raise CorruptCheckpoint(folder, "missing (no .metadata)")
    try:
        dcp.load(state, storage_reader=SafeReader(folder), planner=SafeLoadPlanner(partial),
                 no_dist=not _distributed())  # fmt: skip
    except (CheckpointException, OSError, RuntimeError, pickle.UnpicklingError, ValueError, KeyError) as err:
        cause = _first_cause(err)
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:200]
        raise CorruptCheckpoint(folder, f"unreadable sharded state: {type(cause).__name__}: {first}") from None


def load_model(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """The whole state dict `weights` into `model`, however its parameters are laid out (each rank keeps its
    shards of a fully_shard'ed model)."""
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))


def load_sharded(
    checkpoint: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    ranks: int | None,
    world: int = 1,
    device: torch.device | None = None,
) -> list | None:
    """Restore the optimiser and scheduler from `checkpoint`'s DCP folder onto this run's layout; returns every
    rank's saved RNG states when `ranks` (the saved world size) is `world` (this run's), else None."""
    folder = checkpoint / STATE
    state = {"optimizer": get_optimizer_state_dict(model, optimizer), "scheduler": scheduler.state_dict()}
    read_sharded(state, folder)
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if ranks != world:
        return None
    rngs = {"rng": {"ranks": [rng_state(device) for _ in range(world)]}}
    read_sharded(rngs, folder, partial=True)  # a CUDA generator saved on a GPU is not asked for on the CPU
    return rngs["rng"]["ranks"]


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


def file_digests(folder: Path) -> dict[str, list]:
    """{relative path: [bytes, sha256]} of every file under `folder` but its trainer state (which records them)."""
    found = sorted(p for p in folder.rglob("*") if p.is_file() and p != folder / TRAINER_STATE)
    return {p.relative_to(folder).as_posix(): [p.stat().st_size, sha256_file(p, DIGEST_BLOCK)] for p in found}


def check_files(checkpoint: Path, trainer_state: dict[str, Any]) -> None:
    """Every file `save` recorded in `trainer_state` (`file_digests`) as it was written: first every size (cheap),
    then every sha256; and the run id the same as the run directory's. `CorruptCheckpoint` names the first file that
    differs: a damaged shard, or the state or weights of another checkpoint or run. Checkpoints written before the
    record are not checked."""
    recorded = trainer_state.get("files")
    if not isinstance(recorded, dict):
        return
    for name, (size, _) in sorted(recorded.items()):
        path = checkpoint / name
        actual = path.stat().st_size if path.is_file() and not path.is_symlink() else -1
        if actual != size:
            raise CorruptCheckpoint(path, "missing" if actual < 0 else f"{actual} bytes, {size} when it was written")
    for name, (_, digest) in sorted(recorded.items()):
        if sha256_file(checkpoint / name, DIGEST_BLOCK) != digest:
            raise CorruptCheckpoint(checkpoint / name, "its sha256 is not the one recorded when the checkpoint was "
                                    "written (damaged, or another checkpoint's or run's file)")  # fmt: skip
    this_run, saved = run_dir.run_id(checkpoint.parent.parent), trainer_state.get("run_id")
    if this_run and saved and saved != this_run:
        raise CorruptCheckpoint(checkpoint / TRAINER_STATE, f"written by another run (run id {saved}; this run's "
                                f"{run_dir.MARKER} says {this_run})")  # fmt: skip


def load(checkpoint: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(weights, training state, trainer state) of `checkpoint`, each checked; `CorruptCheckpoint` names a bad file.
    The training state of a sharded checkpoint is {} (its DCP metadata and every file's size and digest checked):
    `load_sharded` reads it into the optimiser; an older checkpoint's is its training_state.pt."""
    trainer_state = load_trainer_state(checkpoint)
    check_files(checkpoint, trainer_state)
    trainer_state = {k: v for k, v in trainer_state.items() if k not in MANIFEST_KEYS}  # the trainer's own part
    if is_legacy(checkpoint):
        return load_weights(checkpoint), load_training_state(checkpoint), trainer_state
    _check_metadata(checkpoint / STATE)
    return load_weights(checkpoint), {}, trainer_state


def is_legacy(checkpoint: Path) -> bool:
    """A checkpoint written before the DCP folder: training_state.pt and no state/."""
    return not (checkpoint / STATE).is_dir() and (checkpoint / TRAINING_STATE).is_file()


def _check_metadata(folder: Path) -> None:
    """DCP's metadata readable, and every data file it names present and long enough for its entries."""
    path = folder / ".metadata"
    try:
        metadata = SafeReader(folder).read_metadata()
    except FileNotFoundError:
        raise CorruptCheckpoint(path, "missing") from None
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, AttributeError) as err:
        raise CorruptCheckpoint(path, f"unreadable DCP metadata: {err}") from None
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        size = (folder / name).stat().st_size if (folder / name).is_file() else -1
        if size < end:
            reason = "missing" if size < 0 else f"truncated ({size} bytes, its entries need {end})"
            raise CorruptCheckpoint(folder / name, reason)


def sharded_keys(checkpoint: Path) -> list[str]:
    """The names DCP's metadata lists in `checkpoint` (flattened: optimizer.state.<param>.exp_avg, ...)."""
    return sorted(SafeReader(checkpoint / STATE).read_metadata().state_dict_metadata)


def all_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints, oldest first (interrupted .tmp writes, diverged checkpoints and entries that are not
    sharpclip's own folders, such as a symbolic link to one, are not listed: see `prune`)."""
    return sorted((p for p in _complete(directory) if _own_entry(p)), key=step_order)


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
    for tmp in [*directory.glob(".step-*.tmp"), *directory.glob(".step-*.old")]:
        if _own_entry(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    if skipped:
        _log.warning("pruning left %s in place: not sharpclip's own checkpoint folder%s (a symbolic link is never "
                     "deleted through); move it out of %s", ", ".join(p.name for p in skipped),
                     "s" if len(skipped) > 1 else "", directory)  # fmt: skip


CHECKPOINT_NAME = re.compile(r"\.?step-\d+(\.tmp|\.old)?")  # checkpoint_name(step), its temporary and set-aside copies


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
