"""Collectives across processes that autograd sees through, for losses that run inside someone else's training loop.

sharpclip's own trainer gathers features in train.distributed and hands its losses the global batch, so the losses
stay pure. A loss dropped into open_clip_train, a Long-CLIP-style script or a Hugging Face Trainer (losses.drop_in)
has no such trainer around it: like open_clip's loss it must gather by itself, and it sits in the losses layer,
below train. These collectives therefore live here, below every part that needs them, and touch nothing but
torch.distributed's default process group; train.distributed (the trainer's side: process groups, gradient
averaging, gathering of padded token tensors) keeps its own.

    gather_parts(x, with_grad)    every rank's (B, ...) tensor, in rank order; with_grad: the backward hands each
                                  rank the sum over ranks of the gradient of its own block (a reduce-scatter)
    exchange(x, send_to, recv_from)          one point-to-point shift, its backward the shift the other way
    exchange_both(x_left, x_right, left, right)   both directions at once (open_clip's bidirectional exchange)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor


def process_group_size() -> int:
    """The default process group's world size; 1 when torch.distributed is not initialised."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _all_gather(tensor: Tensor) -> list[Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor)
    return parts


class _GatherWithGrad(torch.autograd.Function):
    """All-gather whose backward sums every rank's gradient of this rank's block: W blocks of (B, ...) in, one out."""

    @staticmethod
    def forward(ctx, tensor: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        return tuple(_all_gather(tensor.contiguous()))

    @staticmethod
    def backward(ctx, *grads: Tensor) -> Tensor:  # type: ignore[override]
        summed = torch.stack([g.contiguous() for g in grads])  # all-reduce then keep our block: gloo has no
        dist.all_reduce(summed)  # reduce-scatter, and the blocks are small next to the towers' activations
        return summed[dist.get_rank()]


def gather_parts(tensor: Tensor, with_grad: bool, uneven: bool = False) -> list[Tensor]:
    """Every rank's `tensor` (B_r, ...), in rank order. with_grad: differentiable (see the module docstring), else
    plain copies without a graph. uneven: ranks may hold different numbers of rows (one more collective: the row
    counts; blocks are zero-padded to the largest, then trimmed)."""
    rows = [tensor.shape[0]] * dist.get_world_size()
    if uneven:
        counts = _all_gather(torch.tensor([tensor.shape[0]], device=tensor.device))
        rows = [int(c) for c in counts]
        tensor = F.pad(tensor, [0, 0] * (tensor.dim() - 1) + [0, max(rows) - tensor.shape[0]])
    parts = list(_GatherWithGrad.apply(tensor)) if with_grad else _all_gather(tensor.detach().contiguous())
    return [p[:n] for p, n in zip(parts, rows, strict=True)]


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
