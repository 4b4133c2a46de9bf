"""Which device a run computes on, and what that device can do: the one place that interprets `train.device`,
`eval.device`, `train.precision` against the machine, and `data.num_workers: auto` against the cores.

    device = resolve_device(cfg.train.device, "train.device")    # auto -> cuda:<LOCAL_RANK> if CUDA, else cpu
    check_precision(cfg.train.precision, device, "train.precision")
    workers = resolve_num_workers(cfg.data.num_workers)           # auto -> this rank's cores (quota-aware)

Every other module is device-agnostic: it takes a device (or reads the model's) and never guesses one. Errors are
`ConfigError`s naming the key and what the machine offers, so `sharpclip train` prints one line.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from sharpclip.config import DEVICE_SPEC, ConfigError

AUTO = "auto"
CGROUP = Path("/sys/fs/cgroup")  # where a container's CPU quota is


def check_device_spec(spec: str, key: str) -> None:
    """Syntax only (config load time): `auto`, `cpu`, `cuda` or `cuda:N`."""
    if not DEVICE_SPEC.match(spec):
        raise ConfigError(f"{key}: {spec!r} is not a device; use auto, cpu, cuda or cuda:N")


def local_rank() -> int:
    """This process's index on its node (torchrun's LOCAL_RANK; 0 when not launched by torchrun)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def available_devices() -> str:
    """What this machine offers, for error messages: 'cpu' or 'cpu, cuda:0 .. cuda:N-1 (<name>)'."""
    if not torch.cuda.is_available():
        return "cpu only (torch.cuda.is_available() is False)"
    n = torch.cuda.device_count()
    return f"cpu, cuda:0 .. cuda:{n - 1} ({torch.cuda.get_device_name(0)})"


def resolve_device(spec: str, key: str, rank_on_node: int | None = None) -> torch.device:
    """The torch device `spec` names on this machine; `auto` is `cuda:<LOCAL_RANK>` with CUDA, else `cpu`.

    `cuda` without an index means this rank's GPU: `cuda:<LOCAL_RANK>` when the process sees every GPU of its node
    (torchrun), `cuda:0` when it sees exactly one (a cluster that sets `CUDA_VISIBLE_DEVICES` per task, as SLURM's
    `--gpus-per-task=1` does). Raises `ConfigError` naming `key` when CUDA is absent or the index is past the GPUs
    there are.
    """
    check_device_spec(spec, key)
    rank_on_node = local_rank() if rank_on_node is None else rank_on_node
    if spec == AUTO:
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return torch.device("cpu")
    check_one_gpu_per_rank(spec, key)
    if not torch.cuda.is_available():
        raise ConfigError(f"{key}: {spec!r} but this machine has no usable CUDA; available: {available_devices()}")
    visible = torch.cuda.device_count()
    # one GPU visible to a process of a multi-GPU node: the cluster has already chosen it for this rank
    own = 0 if visible == 1 else rank_on_node
    index = int(spec.split(":")[1]) if ":" in spec else own
    if index >= visible:
        raise ConfigError(
            f"{key}: cuda:{index} does not exist (local rank {rank_on_node}); available: {available_devices()}"
        )
    return torch.device("cuda", index)


def check_one_gpu_per_rank(spec: str, key: str) -> None:
    """Refuse `cuda:N` under several processes (torchrun or a scheduler's WORLD_SIZE): every rank would take GPU N
    (NCCL then fails at its first collective). One GPU per process that sees only its own (`cuda:0` with one
    visible device) is what a per-task CUDA_VISIBLE_DEVICES gives, and is allowed."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if ":" in spec and world > 1 and torch.cuda.device_count() != 1:
        raise ConfigError(
            f"{key}: {spec!r} puts all {world} processes on one GPU; use {key}=cuda (each process takes the GPU of "
            "its LOCAL_RANK) or auto"
        )


def check_precision(precision: str, device: torch.device, key: str) -> None:
    """bf16 needs a GPU that has it (Ampere or later); the CPU autocasts to bf16 everywhere torch runs."""
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name(device)
        raise ConfigError(f"{key}: bf16 is not supported on {device} ({name}); use {key}=fp32")


def set_tf32(enabled: bool) -> None:
    """TF32 tensor-core matmuls and convolutions on CUDA (10-bit mantissa inputs, fp32 accumulation)."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def configure_tf32(device: torch.device, enabled: bool) -> None:
    """Set TF32 once per process, before any model runs, when `device` is a GPU (train, distill and eval alike);
    nothing on the CPU, where the flags do not apply."""
    if device.type == "cuda":
        set_tf32(enabled)


def cpu_quota(root: Path | None = None) -> float | None:
    """The container's CPU quota in cores (cgroup v2 `cpu.max`, else v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`),
    or None when there is none (or no cgroup file to read: not Linux). root: the cgroup mount (CGROUP)."""
    root = CGROUP if root is None else root
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def cores_for_this_rank() -> int:
    """CPU cores this process may use: its affinity mask, within the container's CPU quota (a pod's affinity may list
    every host core while its quota allows a few), shared evenly by the ranks on this node."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cores = os.cpu_count() or 1
    quota = cpu_quota()
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return max(1, cores // ranks_here)


def resolve_num_workers(value: int | str, key: str = "data.num_workers") -> int:
    """`auto`: this rank's cores (quota and affinity, shared by the node's ranks); an integer (or its string) as
    given."""
    if value == AUTO:
        return cores_for_this_rank()
    try:
        workers = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: {value!r} is neither auto nor a number of worker processes") from None
    if workers < 0:
        raise ConfigError(f"{key}: must be auto or >= 0, got {workers}")
    return workers


def describe(device: torch.device) -> str:
    """'cuda:0 (NVIDIA H100 80GB HBM3)' or 'cpu (N threads)', for the log."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"{device} ({torch.get_num_threads()} threads)"
