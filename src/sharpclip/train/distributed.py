"""The process group and its small collectives: joining torchrun's group, object collectives (every rank's value,
rank 0's value), sums and flags over ranks. Nothing here knows about models or steps: the training step reads
the world through one explicit object (train.parallel.ParallelContext), the engine that keeps gradients and
parameters in step lives in train.engine, and failure propagation in train.failures.

Devices: the backend follows the training device (NCCL for CUDA, gloo for the CPU), each rank binds its GPU
(`torch.cuda.set_device(LOCAL_RANK)`) before the process group allocates anything, and every collective runs on the
tensors' own device. Several nodes need nothing here: torchrun's rendezvous (`--nnodes`, `--rdzv-backend`,
`--rdzv-endpoint`) sets the environment this module reads.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterable
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from sharpclip import collectives
from sharpclip.train import rendezvous, slurm

T = TypeVar("T")


is_distributed = collectives.is_initialized
rank, world_size = collectives.rank, collectives.world_size


def init_from_env(device: torch.device | None = None, timeout_min: float | None = None) -> bool:
    """Join the process group that torchrun (or srun, train.slurm) describes in the environment; False when not
    launched by either.

    device: the training device of this rank; a CUDA device is made current (with or without torchrun: the pin
    thread and every allocation without an explicit device then go to it, not to GPU 0) and the backend is NCCL,
    otherwise gloo (the default device: CUDA's when available). timeout_min: how long a collective may wait for the
    slowest rank (train.dist_timeout_min; None: torch's default of 10 minutes).
    """
    slurm.adopt()  # srun's one task per rank without torchrun: RANK, WORLD_SIZE, ... from SLURM_* (train.slurm)
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)  # before the first allocation: NCCL's communicator and every tensor go here
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ or is_distributed():
        return is_distributed()
    if device is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else None
        if device is not None:
            torch.cuda.set_device(device)
    timeout = {"timeout": timedelta(minutes=timeout_min)} if timeout_min else {}
    with rendezvous.joining(timeout_min):  # one line, not a traceback or a silent wait, when the store fails
        if device is not None and device.type == "cuda":
            dist.init_process_group(backend="nccl", device_id=device, **timeout)
        else:
            dist.init_process_group(backend="gloo", **timeout)
    return True


def backend() -> str:
    """The process group's backend ('nccl', 'gloo'), or 'none' on one process."""
    return str(dist.get_backend()) if is_distributed() else "none"


def all_ranks(value: T) -> list[T]:
    """Every rank's `value` (picklable), in rank order: each rank's device for the log, each rank's loader and RNG
    state for a checkpoint; [value] on one process."""
    if world_size() == 1:
        return [value]
    out: list = [None] * world_size()
    dist.all_gather_object(out, value)
    return out


def to_rank0(value: T) -> list[T]:
    """Every rank's `value` (picklable), in rank order, on rank 0; [] on the others (a gather, not an all-gather:
    what only rank 0 uses travels only to it); [value] on one process."""
    if world_size() == 1:
        return [value]
    out: list | None = [None] * world_size() if rank() == 0 else None
    dist.gather_object(value, out, dst=0)
    return out or []


def from_rank0(value: T) -> T:
    """Rank 0's `value` (picklable, trusted: it comes from this run's own rank 0) on every rank, by one object
    broadcast: what rank 0 alone computed (validation metrics) decides the same on every rank; `value` on one."""
    if world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_ranks_lists(values: list) -> list:
    """Every rank's list concatenated in rank order (small host values: the diagnostics); `values` on one."""
    if world_size() == 1:
        return values
    out: list[list] = [[] for _ in range(world_size())]
    dist.all_gather_object(out, values)
    return [v for part in out for v in part]


def shutdown() -> None:
    """Destroy the process group, after collecting cyclic garbage: a trainer or an FSDP state kept alive only by a
    reference cycle may still hold gloo work handles, and if they were freed during interpreter finalisation,
    gloo's threads would abort the process ("terminate called without an active exception", measured on about 1 in
    10 two-rank exits of tests/train/sync_worker.py; none in 30 after collecting first)."""
    if is_distributed():
        gc.collect()
        dist.destroy_process_group()


def all_reduce_sum(tensor: Tensor) -> Tensor:
    """Sum over ranks (of a detached copy); the tensor itself on one process."""
    if world_size() == 1:
        return tensor
    out = tensor.detach().clone()
    dist.all_reduce(out)
    return out


def average_gradients(params: Iterable[torch.nn.Parameter]) -> None:
    """All-reduce-mean every `.grad` of plain (unsharded) parameters in place, flattened into one buffer per dtype,
    after the backward: for the gradient diagnostics' occasional passes (a training step's gradients are reduced by
    the engine, train.engine, while its backward runs)."""
    if world_size() == 1:
        return
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for p in params:
        if p.requires_grad:
            if p.grad is None:  # a rank whose batch did not reach p still takes part in the reduction
                p.grad = torch.zeros_like(p)
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        flat /= world_size()
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            g.copy_(synced)


def broadcast_parameters(module: torch.nn.Module) -> None:
    """Make every rank start from rank 0's parameters and buffers."""
    if world_size() == 1:
        return
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.data, src=0)


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def _flag_device() -> torch.device:
    """Where a collective on a few host flags runs: NCCL reduces only CUDA tensors."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def all_true(flag: bool) -> bool:
    """True on every rank when `flag` is true on every rank (so that all ranks stop together); `flag` on one."""
    if world_size() == 1:
        return flag
    value = torch.tensor([float(flag)], device=_flag_device())
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item() == 1.0)


def all_flags(flag: bool) -> list[bool]:
    """Every rank's `flag` in rank order, from one all-reduce of W numbers; [flag] on one process, with no
    collective."""
    if world_size() == 1:
        return [flag]
    value = torch.zeros(world_size(), device=_flag_device())
    value[rank()] = float(flag)
    dist.all_reduce(value)
    return [v == 1.0 for v in value.tolist()]
