"""Everything that talks to torch.distributed; the only module that imports it.

Losses need the global batch: every rank gathers every rank's features (with gradient) and computes the same global
loss. The autograd all-gather's backward sums the incoming gradients over ranks, so each rank's local features
receive W · ∂L/∂f_local; DDP's gradient averaging divides by W again, so the parameters end with exactly ∂L/∂θ of
the global loss, as on one process with the whole batch. Anything built from the batch, such as HN-CLIP's Ḡ, is then
built over the gathered texts and matches the global logits by construction.

Gradient averaging is DDP's all-reduce, called once per optimiser step (`average_gradients`) rather than through the
DDP wrapper: the cached-gradient step runs one no-grad pass, a loss backward that reaches parameters outside the
towers (the logit scale) and k replays per step, a pattern DDP's one-forward-one-backward pairing does not express.
Averaging after the last replay is exactly what DDP with `no_sync` on the first k − 1 replays computes.

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


def shutdown() -> None:
    if is_distributed():
        dist.destroy_process_group()


def _pad_to(tensor: Tensor, shape: tuple[int, ...]) -> Tensor:
    pad: list[int] = []
    for have, want in zip(reversed(tensor.shape), reversed(shape), strict=True):
        pad += [0, want - have]
    return F.pad(tensor, pad) if any(pad) else tensor


def _max_shape(tensor: Tensor) -> tuple[int, ...]:
    shape = torch.tensor(tensor.shape, device=tensor.device)
    dist.all_reduce(shape, op=dist.ReduceOp.MAX)
    return tuple(int(s) for s in shape.tolist())


class _AllGather(torch.autograd.Function):
    """All-gather with gradient: forward stacks every rank's (N, ...) tensor into (W·N, ...) in rank order; backward
    hands each rank the sum over ranks of the gradient of its own block (a reduce-scatter), the semantics of the
    deprecated `torch.distributed.nn.functional.all_gather`. Every rank's tensor must have the same shape."""

    @staticmethod
    def forward(ctx, tensor: Tensor) -> Tensor:
        tensor = tensor.contiguous()
        ctx.rows = tensor.shape[0]
        if backend() == "nccl":
            out = tensor.new_empty((world_size() * tensor.shape[0], *tensor.shape[1:]))
            dist.all_gather_into_tensor(out, tensor)
            return out
        parts = [torch.empty_like(tensor) for _ in range(world_size())]
        dist.all_gather(parts, tensor)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        grad = grad.contiguous()
        if backend() == "nccl":
            out = grad.new_empty((ctx.rows, *grad.shape[1:]))
            dist.reduce_scatter_tensor(out, grad, op=dist.ReduceOp.SUM)
            return out
        summed = grad.clone()  # gloo has no reduce-scatter: all-reduce, then keep this rank's block
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        return summed[rank() * ctx.rows : (rank() + 1) * ctx.rows]


def _gather_one(tensor: Tensor) -> Tensor:
    """Concatenate every rank's `tensor` along dim 0; ranks may differ in batch size and token length."""
    rows = torch.tensor([tensor.shape[0]], device=tensor.device)
    all_rows = [torch.zeros_like(rows) for _ in range(world_size())]
    dist.all_gather(all_rows, rows)
    is_mask = tensor.dtype == torch.bool  # gloo cannot pad or gather bool; masks carry no gradient
    padded = _pad_to(tensor.to(torch.uint8) if is_mask else tensor, _max_shape(tensor))
    if is_mask:
        parts = [torch.zeros_like(padded) for _ in range(world_size())]
        dist.all_gather(parts, padded)
        parts = [p.bool() for p in parts]
    elif tensor.requires_grad:
        parts = list(_AllGather.apply(padded).chunk(world_size()))
    else:
        parts = [torch.zeros_like(padded) for _ in range(world_size())]
        dist.all_gather(parts, padded)
    return torch.cat([p[: int(n)] for p, n in zip(parts, all_rows, strict=True)])


def gather_features(features: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Every rank's per-sample features, concatenated in rank order along dim 0, differentiable.

    Token tensors of different lengths are zero-padded (masks with False) to the longest before gathering. On one
    process this returns the features unchanged.
    """
    if world_size() == 1:
        return dict(features)
    return {key: _gather_one(value) for key, value in features.items()}


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
