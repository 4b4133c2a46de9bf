"""Everything that talks to torch.distributed; the only module that imports it.

What is gathered (train.step): under exact accumulation every rank gathers every rank's features (with gradient)
and computes the loss rows of its own samples against all of them (local loss), its share of the global loss;
under per_micro_batch nothing is gathered, each matrix is one rank's micro-batch. The autograd all-gather's backward
sums the incoming gradients over ranks (a reduce-scatter), so each rank's local features receive what every rank's
share sent them; each rank backpropagates W times its share and DDP's gradient averaging divides by W again, so the
parameters end with exactly ∂L/∂θ of the global loss, as on one process with the whole batch. Anything built from
the batch, such as HN-CLIP's Ḡ, is built over the gathered texts and matches the global logits by construction.

One code path on every backend: `all_gather_single` forward and `reduce_scatter_single` backward (gloo has both,
so the CPU tests run what NCCL runs). Ranks may hold different rows and token lengths: every feature's shape
travels in one small all-gather per step (`exchange_shapes`, read back to the host once), then each feature is
padded to the largest shape, gathered and cut back.

Gradient averaging is DDP's all-reduce, called once per optimiser step (`average_gradients`) rather than through the
DDP wrapper: the cached-gradient step runs one no-grad pass, a loss backward that reaches parameters outside the
towers (the logit scale) and k replays per step, a pattern DDP's one-forward-one-backward pairing does not express.
Averaging after the last replay is exactly what DDP with `no_sync` on the first k − 1 replays computes. (A DDP
wrapper would average a second time: it must replace `average_gradients`, not be added to it.)

Every rank must enter every collective: the trainer asks `all_flags` once a step whether every rank holds a batch
and ends the epoch on all ranks together when one does not, and `check_shared_dir` (train.run) refuses ranks that
see different run directories. `train.dist_timeout_min` bounds how long a collective waits for the slowest rank.

Devices: the backend follows the training device (NCCL for CUDA, gloo for the CPU), each rank binds its GPU
(`torch.cuda.set_device(LOCAL_RANK)`) before the process group allocates anything, and every collective runs on the
tensors' own device. Several nodes need nothing here: torchrun's rendezvous (`--nnodes`, `--rdzv-backend`,
`--rdzv-endpoint`) sets the environment this module reads.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

T = TypeVar("T")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def init_from_env(device: torch.device | None = None, timeout_min: float | None = None) -> bool:
    """Join the process group that torchrun describes in the environment; False when not launched by torchrun.

    device: the training device of this rank; a CUDA device is made current (with or without torchrun: the pin
    thread and every allocation without an explicit device then go to it, not to GPU 0) and the backend is NCCL,
    otherwise gloo (the default device: CUDA's when available). timeout_min: how long a collective may wait for the
    slowest rank (train.dist_timeout_min; None: torch's default of 10 minutes).
    """
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)  # before the first allocation: NCCL's communicator and every tensor go here
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ or is_distributed():
        return is_distributed()
    if device is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else None
        if device is not None:
            torch.cuda.set_device(device)
    timeout = {"timeout": timedelta(minutes=timeout_min)} if timeout_min else {}
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
    if is_distributed():
        dist.destroy_process_group()


def _pad_to(tensor: Tensor, shape: tuple[int, ...]) -> Tensor:
    pad: list[int] = []
    for have, want in zip(reversed(tensor.shape), reversed(shape), strict=True):
        pad += [0, want - have]
    return F.pad(tensor, pad) if any(pad) else tensor


class _AllGather(torch.autograd.Function):
    """All-gather with gradient: forward stacks every rank's (N, ...) tensor into (W·N, ...) in rank order; backward
    hands each rank the sum over ranks of the gradient of its own block (a reduce-scatter), the semantics of the
    deprecated `torch.distributed.nn.functional.all_gather`. Every rank's tensor must have the same shape."""

    @staticmethod
    def forward(ctx, tensor: Tensor) -> Tensor:
        ctx.rows = tensor.shape[0]
        return _all_gather(tensor)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        out = grad.new_empty((ctx.rows, *grad.shape[1:]))
        dist.reduce_scatter_single(out, grad.contiguous(), op=dist.ReduceOp.SUM)
        return out


def _all_gather(tensor: Tensor) -> Tensor:
    """(W·N, ...) from every rank's (N, ...) tensor, in rank order, without gradient."""
    tensor = tensor.contiguous()
    out = tensor.new_empty((world_size() * tensor.shape[0], *tensor.shape[1:]))
    dist.all_gather_single(out, tensor)
    return out


def exchange_shapes(features: Mapping[str, Tensor]) -> Tensor:
    """Every rank's shape of every feature, (W, K, R) int64 on the host (K keys in order, R the largest ndim,
    missing dims 0): one small all-gather for all keys, read back once."""
    values = list(features.values())
    ndim = max(v.ndim for v in values)
    local = torch.zeros(len(values), ndim, dtype=torch.int64)
    for k, v in enumerate(values):
        local[k, : v.ndim] = torch.tensor(v.shape, dtype=torch.int64)
    return _all_gather(local.to(values[0].device)[None]).cpu()  # NCCL gathers on the features' GPU


def _gather_one(tensor: Tensor, shapes: Tensor) -> tuple[Tensor, slice]:
    """Every rank's `tensor` concatenated along dim 0 (padded to the largest shape to travel, cut back after) and
    this rank's rows in the result. shapes: (W, R) every rank's shape of this tensor (`exchange_shapes`)."""
    rows = shapes[:, 0].tolist()
    largest = tuple(int(n) for n in shapes[:, : tensor.ndim].max(dim=0).values.tolist())
    is_mask = tensor.dtype == torch.bool  # gloo cannot gather bool; masks carry no gradient
    padded = _pad_to(tensor.to(torch.uint8) if is_mask else tensor, largest)
    full = _AllGather.apply(padded) if tensor.requires_grad else _all_gather(padded)
    parts = [block[:n] for block, n in zip(full.chunk(world_size()), rows, strict=True)]
    out = torch.cat(parts)
    start = sum(rows[: rank()])
    return (out.bool() if is_mask else out), slice(start, start + rows[rank()])


def gather(features: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, slice]]:
    """Every rank's per-sample features, concatenated in rank order along dim 0, differentiable, and the slice of
    each key's result that holds this rank's own rows (the rows a local loss computes).

    Ranks may differ in rows and token length: token tensors are zero-padded (masks with False) to the longest.
    Shapes travel once for all keys (`exchange_shapes`), then one all-gather per key. On one process this returns
    the features unchanged and slices over all their rows.
    """
    if world_size() == 1 or not features:
        return dict(features), {k: slice(0, len(v)) for k, v in features.items()}
    shapes = exchange_shapes(features)
    gathered, local = {}, {}
    for k, (key, value) in enumerate(features.items()):
        gathered[key], local[key] = _gather_one(value, shapes[:, k])
    return gathered, local


def gather_features(features: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """`gather` without the slices: every rank's features in rank order; the features themselves on one process."""
    return gather(features)[0]


def all_reduce_sum(tensor: Tensor) -> Tensor:
    """Sum over ranks (of a detached copy); the tensor itself on one process."""
    if world_size() == 1:
        return tensor
    out = tensor.detach().clone()
    dist.all_reduce(out)
    return out


def all_reduce_mean(tensor: Tensor) -> Tensor:
    """Mean over ranks (in place on a copy); the identity on one process."""
    if world_size() == 1:
        return tensor
    out = tensor.detach().clone()
    dist.all_reduce(out)
    return out / world_size()


def average_gradients(params: Iterable[torch.nn.Parameter]) -> None:
    """All-reduce-mean every `.grad` in place, flattened into one buffer per dtype (as DDP's buckets do)."""
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
    """Every rank's `flag` in rank order, from one all-reduce of W numbers (the trainer asks it once a step: does
    every rank hold a batch?); [flag] on one process, with no collective."""
    if world_size() == 1:
        return [flag]
    value = torch.zeros(world_size(), device=_flag_device())
    value[rank()] = float(flag)
    dist.all_reduce(value)
    return [v == 1.0 for v in value.tolist()]
