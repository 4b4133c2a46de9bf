"""Checkpoints of a run: written whole or not at all, pruned to the last N and the best, resumed exactly.

Layout under `<run>/checkpoints/`:

    step-000120/                 one checkpoint
        model.safetensors, ...   the model, as models.factory.save_checkpoint writes it (loadable and exportable)
        training_state.pt        optimizer and scheduler state dicts and RNG states (tensors, numbers, lists only:
                                 read back with torch.load(weights_only=True))
        trainer_state.json       step, epoch, the loader's position, the best metric so far
    best.json                    {"name": "step-000100", "metric": ...}

A checkpoint is written into `.step-000120.tmp/` and renamed when complete, so a crash mid-write leaves only a
temporary folder that `latest()` ignores and the next save removes.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

TRAINING_STATE = "training_state.pt"
TRAINER_STATE = "trainer_state.json"
BEST = "best.json"


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
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_model(tmp)
    torch.save(training_state, tmp / TRAINING_STATE)
    (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=2))
    fault_point("checkpoint", step)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def load_training_state(checkpoint: Path) -> dict[str, Any]:
    """Optimizer, scheduler and RNG states, on the CPU whatever device wrote them (the optimizer's
    `load_state_dict` moves its state to the parameters' device)."""
    return torch.load(checkpoint / TRAINING_STATE, map_location="cpu", weights_only=True)


def load_trainer_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / TRAINER_STATE).read_text())


def all_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary folders of interrupted writes are not listed)."""
    return sorted(p for p in directory.glob("step-*") if (p / TRAINER_STATE).is_file())


def latest(directory: Path) -> Path | None:
    found = all_checkpoints(directory)
    return found[-1] if found else None


def mark_best(directory: Path, checkpoint: Path, metric: float) -> None:
    tmp = directory / f".{BEST}.tmp"
    tmp.write_text(json.dumps({"name": checkpoint.name, "metric": metric}))
    os.replace(tmp, directory / BEST)


def best(directory: Path) -> Path | None:
    path = directory / BEST
    return directory / json.loads(path.read_text())["name"] if path.is_file() else None


def prune(directory: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints and the best one; also stale temporary folders."""
    keep = set(all_checkpoints(directory)[-keep_last:]) if keep_last > 0 else set()
    if (b := best(directory)) is not None:
        keep.add(b)
    for path in all_checkpoints(directory):
        if path not in keep:
            shutil.rmtree(path)
    for tmp in directory.glob(".step-*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True)


def fault_point(where: str, step: int) -> None:
    """Fault injection for crash tests: SHARPCLIP_FAULT=<where>:<step> kills the process here with SIGKILL."""
    if os.environ.get("SHARPCLIP_FAULT") == f"{where}:{step}":
        os.kill(os.getpid(), 9)
