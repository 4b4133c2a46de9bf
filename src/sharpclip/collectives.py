"""The one autograd all-gather, and the other collectives autograd sees through, for every part that gathers.

Both the trainer's exact accumulation (train.step: local rows against every rank's columns) and the losses dropped
into someone else's loop (losses.drop_in, open_clip's gather flags) gather here, so there is one backward semantics
and one cost: the all-gather's backward is a reduce-scatter, which hands each rank the sum over ranks of the
gradient of its own block (the semantics of the deprecated `torch.distributed.nn.functional.all_gather`). This
module sits below losses and train and touches nothing but torch.distributed's default process group.

    gather(features, shapes)      every rank's per-sample features, concatenated in rank order, differentiable,
                                  and this rank's slice of each; ranks may differ in rows and token lengths (every
                                  shape travels in one small all-gather, `exchange_shapes`, skipped when the caller
                                  passes the shapes it already holds)
    gather_parts(x, with_grad)    every rank's (B, ...) tensor, in rank order (the drop-in losses' form)
    exchange(x, send_to, recv_from)          one point-to-point shift, its backward the shift the other way
    exchange_both(x_left, x_right, left, right)   both directions at once (open_clip's bidirectional exchange)

Torch versions. torch 2.13 renamed the tensor collectives (`all_gather_single`, `reduce_scatter_single`; the old
`all_gather_into_tensor` / `reduce_scatter_tensor` warn there); older releases, down to the declared floor, have
only the old names. Each call looks the name up when it runs and falls back to the old one (`_collective`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

Shapes = list[list[list[int]]]  # [rank][key][dim]: every rank's shape of every feature (missing dims 0)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank in the default process group; 0 when torch.distributed is not initialised."""
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    """The default process group's world size; 1 when torch.distributed is not initialised."""
    return dist.get_world_size() if is_initialized() else 1


process_group_size = world_size  # the name the drop-in losses' argument check reads


def _collective(new: str, old: str):
    """torch.distributed's collective `new` (torch 2.13+), else the same call under its older name `old`."""
    return getattr(dist, new, None) or getattr(dist, old)


def _all_gather(tensor: Tensor) -> Tensor:
    """(W·N, ...) from every rank's (N, ...) tensor, in rank order, without gradient."""
    tensor = tensor.contiguous()
    out = tensor.new_empty((world_size() * tensor.shape[0], *tensor.shape[1:]))
    _collective("all_gather_single", "all_gather_into_tensor")(out, tensor)
    return out


class _AllGather(torch.autograd.Function):
    """All-gather with gradient: forward stacks every rank's (N, ...) tensor into (W·N, ...) in rank order; backward
    hands each rank the sum over ranks of the gradient of its own block (a reduce-scatter). Every rank's tensor
    must have the same shape (`gather` pads them)."""

    @staticmethod
    def forward(ctx, tensor: Tensor) -> Tensor:  # type: ignore[override]
        ctx.rows = tensor.shape[0]
        return _all_gather(tensor)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        out = grad.new_empty((ctx.rows, *grad.shape[1:]))
        _collective("reduce_scatter_single", "reduce_scatter_tensor")(out, grad.contiguous(), op=dist.ReduceOp.SUM)
        return out


def _pad_to(tensor: Tensor, shape: tuple[int, ...]) -> Tensor:
    pad: list[int] = []
    for have, want in zip(reversed(tensor.shape), reversed(shape), strict=True):
        pad += [0, want - have]
    return F.pad(tensor, pad) if any(pad) else tensor


def exchange_shapes(features: Mapping[str, Tensor]) -> Shapes:
    """Every rank's shape of every feature, [rank][key][dim] (keys in order, missing dims 0): one small all-gather
    for all keys, read back to the host once."""
    values = list(features.values())
    ndim = max(v.ndim for v in values)
    local = torch.zeros(len(values), ndim, dtype=torch.int64)
    for k, v in enumerate(values):
        local[k, : v.ndim] = torch.tensor(v.shape, dtype=torch.int64)
    return _all_gather(local.to(values[0].device)[None]).tolist()  # NCCL gathers on the features' GPU


def _gather_one(tensor: Tensor, shapes: list[list[int]]) -> tuple[Tensor, slice]:
    """Every rank's `tensor` concatenated along dim 0 (padded to the largest shape to travel, cut back after) and
    this rank's rows in the result. shapes: [rank][dim] every rank's shape of this tensor."""
    rows = [shape[0] for shape in shapes]
    largest = tuple(max(shape[d] for shape in shapes) for d in range(tensor.ndim))
    is_mask = tensor.dtype == torch.bool  # gloo cannot gather bool; masks carry no gradient
    padded = _pad_to(tensor.to(torch.uint8) if is_mask else tensor, largest)
    full = _AllGather.apply(padded) if tensor.requires_grad else _all_gather(padded)
    parts = [block[:n] for block, n in zip(full.chunk(len(shapes)), rows, strict=True)]
    out = torch.cat(parts) if len(set(rows)) > 1 else full  # equal rows: the blocks are already in place
    start = sum(rows[: rank()])
    return (out.bool() if is_mask else out), slice(start, start + rows[rank()])


def gather(
    features: Mapping[str, Tensor], shapes: Shapes | None = None
) -> tuple[dict[str, Tensor], dict[str, slice], Shapes | None]:
    """Every rank's per-sample features, concatenated in rank order along dim 0, differentiable; the slice of each
    key's result that holds this rank's own rows (the rows a local loss computes); and the shapes used.

    Ranks may differ in rows and token length: token tensors are zero-padded (masks with False) to the longest.
    shapes: every rank's shapes of these features as this function returned them before; given, the shape exchange
    is skipped (the caller knows that no rank's shapes changed); None: exchanged here, once for all keys. On one
    process this returns the features unchanged and slices over all their rows.
    """
    if world_size() == 1 or not features:
        return dict(features), {k: slice(0, len(v)) for k, v in features.items()}, None
    shapes = exchange_shapes(features) if shapes is None else shapes
    gathered, local = {}, {}
    for k, (key, value) in enumerate(features.items()):
        gathered[key], local[key] = _gather_one(value, [per_rank[k][: value.ndim] for per_rank in shapes])
    return gathered, local, shapes


def gather_features(features: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """`gather` without the slices: every rank's features in rank order; the features themselves on one process."""
    return gather(features)[0]


def gather_parts(tensor: Tensor, with_grad: bool, uneven: bool = False) -> list[Tensor]:
    """Every rank's `tensor` (B_r, ...), in rank order. with_grad: differentiable (the reduce-scatter backward of
    `gather`), else plain copies without a graph. uneven: ranks may hold different numbers of rows (their shapes
    travel first, in one small all-gather)."""
    shapes = exchange_shapes({"x": tensor}) if uneven else [[list(tensor.shape)]] * world_size()
    source = tensor if with_grad else tensor.detach()
    full, _ = _gather_one(source, [s[0][: tensor.ndim] for s in shapes])
    return list(full.split([s[0][0] for s in shapes]))


def _shift(tensor: Tensor, send_to: int, recv_from: int) -> Tensor:
    received = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, send_to), dist.P2POp(dist.irecv, received, recv_from)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: Tensor, send_to: int, recv_from: int) -> Tensor:  # type: ignore[override]
        ctx.send_to, ctx.recv_from = send_to, recv_from
        return _shift(tensor.contiguous(), send_to, recv_from)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        return _shift(grad.contiguous(), ctx.recv_from, ctx.send_to), None, None


def exchange(tensor: Tensor, send_to: int, recv_from: int, with_grad: bool = True) -> Tensor:
    """Send `tensor` to rank `send_to` and return what rank `recv_from` sent (same shape); differentiable."""
    return _Exchange.apply(tensor, send_to, recv_from) if with_grad else _shift(tensor.detach(), send_to, recv_from)


def _shift_both(to_left: Tensor, to_right: Tensor, left: int, right: int) -> tuple[Tensor, Tensor]:
    from_right, from_left = torch.empty_like(to_left), torch.empty_like(to_right)
    ops = [
        dist.P2POp(dist.isend, to_right, right),
        dist.P2POp(dist.isend, to_left, left),
        dist.P2POp(dist.irecv, from_right, right),
        dist.P2POp(dist.irecv, from_left, left),
    ]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return from_right, from_left


class _ExchangeBoth(torch.autograd.Function):
    @staticmethod
    def forward(ctx, to_left: Tensor, to_right: Tensor, left: int, right: int) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        ctx.left, ctx.right = left, right
        return _shift_both(to_left.contiguous(), to_right.contiguous(), left, right)

    @staticmethod
    def backward(ctx, grad_from_right: Tensor, grad_from_left: Tensor) -> tuple[Tensor, Tensor, None, None]:  # type: ignore[override]
        # what came from the right goes back to the right, and vice versa; what then arrives from the right is the
        # gradient of what we sent right
        to_right_grad, to_left_grad = _shift_both(
            grad_from_left.contiguous(), grad_from_right.contiguous(), ctx.left, ctx.right
        )
        return to_left_grad, to_right_grad, None, None


def exchange_both(
    to_left: Tensor, to_right: Tensor, left: int, right: int, with_grad: bool = True
) -> tuple[Tensor, Tensor]:
    """Send `to_left` to rank `left` and `to_right` to rank `right` at once; returns (from_right, from_left)."""
    if with_grad:
        return _ExchangeBoth.apply(to_left, to_right, left, right)
    return _shift_both(to_left.detach(), to_right.detach(), left, right)
