"""The reducer sharpclip trained on before FSDP2 (`GradSync`, bucketed all-reduces driven by post-accumulate-grad
hooks), kept here only so that `benchmarks/engine_speed.py` can time it against the engine; nothing in the package
uses it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist


def world_size() -> int:
    return dist.get_world_size()


def from_rank0(value):
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb: fewer, larger all-reduces against earlier overlap


class _Bucket:
    """Parameters whose gradients travel in one all-reduce, through one persistent flat buffer (one dtype)."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        self.views = list(torch.split(self.flat, [p.numel() for p in params]))
        self.views = [v.view(p.shape) for v, p in zip(self.views, params, strict=True)]
        self.handle = None

    def launch(self) -> None:
        """Copy the gradients in (a parameter no backward reached counts as zero, as DDP does) and start the sum."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        torch._foreach_copy_(self.views, [p.grad for p in self.params])
        self.handle = dist.all_reduce(self.flat, async_op=True)

    def land(self, world: int) -> None:
        """Wait for the sum and write the mean back into the gradients."""
        self.handle.wait()
        self.handle = None
        self.flat /= world
        torch._foreach_copy_([p.grad for p in self.params], self.views)


def _buckets(params: list[torch.nn.Parameter], order: list[int], cap: int) -> list[_Bucket]:
    """`params` in `order`, cut into buckets of at most `cap` bytes (one dtype and device each)."""
    buckets: list[list[torch.nn.Parameter]] = []
    size = 0
    for i in order:
        p = params[i]
        last = buckets[-1][-1] if buckets else None
        if last is None or (last.dtype, last.device) != (p.dtype, p.device) or size + p.nbytes > cap:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.nbytes
    return [_Bucket(b) for b in buckets]


class GradSync:
    """Gradient averaging over ranks, overlapped with the backward pass: DDP's bucketed all-reduce, driven by
    per-parameter post-accumulate-grad hooks instead of a wrapper around the model.

        sync.start()                      the step begins: nothing reduced yet
        with sync.no_sync(): backward()   every backward of the step but the last (earlier micro-batches, the
                                          exact step's loss backward and its replays but the last)
        backward()                        the last: each bucket's all-reduce starts as soon as its gradients are in,
                                          while the backward still runs through earlier layers
        sync.finish()                     the buckets no hook completed (the logit scale, whose gradient came from
                                          an earlier backward; parameters no loss reached) are reduced; all waited
                                          for and divided by W

    Buckets hold about BUCKET_BYTES each and start in bucket order on every rank (as DDP's reducer: collectives must
    match across ranks). The first step reduces in reverse registration order and records the order in which
    gradients became ready; rank 0's order becomes the bucket layout from the second step on (DDP's rebuild).
    The hooks act only between `start` and `finish`, so other backward passes (the gradient diagnostics) are not
    reduced here. The result equals one all-reduce-mean of every gradient after the backward.
    """

    def __init__(self, params: list[torch.nn.Parameter], bucket_bytes: int = BUCKET_BYTES):
        self.params, self.cap = [p for p in params if p.requires_grad], bucket_bytes
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._layout(list(reversed(range(len(self.params)))))
        self._seen: list[int] | None = []  # the ready order of the first synced backward (None once rebuilt)
        self._active = self._paused = False
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._ready)

    def _layout(self, order: list[int]) -> None:
        self.buckets = _buckets(self.params, order, self.cap)
        self._bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket.params}

    def start(self) -> None:
        self._active, self._paused, self._next = True, False, 0
        self._pending = [len(b.params) for b in self.buckets]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally (forward and backward: the hooks fire in backward)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def _ready(self, param: torch.nn.Parameter) -> None:
        if not self._active or self._paused:
            return
        if self._seen is not None:
            self._seen.append(self._index[id(param)])
        self._pending[self._bucket_of[id(param)]] -= 1
        while self._next < len(self.buckets) and self._pending[self._next] == 0:  # in bucket order, as every rank
            self.buckets[self._next].launch()
            self._next += 1

    def finish(self) -> None:
        for bucket in self.buckets[self._next :]:
            bucket.launch()
        for bucket in self.buckets:
            bucket.land(world_size())
        self._active = False
        if self._seen is not None:  # the first step: buckets follow the order the gradients arrived in (rank 0's)
            seen = list(dict.fromkeys(self._seen))
            rest = set(range(len(self.params))) - set(seen)
            order = seen + sorted(rest, reverse=True)
            self._layout(from_rank0(order))
            self._seen = None
