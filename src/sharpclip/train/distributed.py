"""The trainer's side of torch.distributed: the process group, gradient sync, the step's flags, object collectives.

What is gathered (train.step): under exact accumulation every rank gathers every rank's features (with gradient)
and computes the loss rows of its own samples against all of them (local loss), its share of the global loss;
under per_micro_batch nothing is gathered, each matrix is one rank's micro-batch. The autograd all-gather's backward
sums the incoming gradients over ranks (a reduce-scatter), so each rank's local features receive what every rank's
share sent them; each rank backpropagates W times its share and the gradient averaging divides by W again, so the
parameters end with exactly ∂L/∂θ of the global loss, as on one process with the whole batch. Anything built from
the batch, such as HN-CLIP's Ḡ, is built over the gathered texts and matches the global logits by construction.

The autograd all-gather itself (all-gather forward, reduce-scatter backward, uneven rows, one shape exchange)
is `sharpclip.collectives.gather`, shared with the drop-in losses; this module keeps the process group, the
gradient sync and the step's flags.

Gradient averaging is DDP's bucketed all-reduce, overlapped with the step's last backward (`GradSync`), driven by
hooks on the parameters rather than by the DDP wrapper: the cached-gradient step runs one no-grad pass, a loss
backward that reaches parameters outside the towers (the logit scale) and k replays per step, and the feature
encoder calls the towers through `encode_image` / `encode_text`, none of which DDP's one-forward-one-backward
pairing sees. Syncing during the last replay only is exactly what DDP with `no_sync` on the first k − 1 computes.

Every rank must enter every collective: before each step the trainer agrees the step's flags (`StepFlags`: does
every rank hold a batch, did any rank's batch shapes change, every rank's rows) in one small all-reduce, and ends
the epoch on all ranks together when one holds no batch; `check_shared_dir` (train.run) refuses ranks that see
different run directories. A failure on one rank ends every rank at once (`failures_end_every_rank`), and so does
a rank that stops making progress (train.heartbeat, through the same watcher);
`train.dist_timeout_min` bounds how long a collective waits for the slowest rank.

Devices: the backend follows the training device (NCCL for CUDA, gloo for the CPU), each rank binds its GPU
(`torch.cuda.set_device(LOCAL_RANK)`) before the process group allocates anything, and every collective runs on the
tensors' own device. Several nodes need nothing here: torchrun's rendezvous (`--nnodes`, `--rdzv-backend`,
`--rdzv-endpoint`) sets the environment this module reads.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from sharpclip import collectives
from sharpclip.train import slurm

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
    slurm.adopt()  # i40: srun's one task per rank without torchrun: RANK, WORLD_SIZE, ... from SLURM_* (train.slurm)
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


def all_reduce_sum(tensor: Tensor) -> Tensor:
    """Sum over ranks (of a detached copy); the tensor itself on one process."""
    if world_size() == 1:
        return tensor
    out = tensor.detach().clone()
    dist.all_reduce(out)
    return out


def average_gradients(params: Iterable[torch.nn.Parameter]) -> None:
    """All-reduce-mean every `.grad` in place, flattened into one buffer per dtype, after the backward: for the
    gradient diagnostics' occasional passes (a training step overlaps the sync with its backward: `GradSync`)."""
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


FAILED_KEY, SEEN_KEY, REPORTED_KEY = "sharpclip/failed", "sharpclip/failure_seen", "sharpclip/failure_reported"
HUNG_KEY = "sharpclip/hung"  # i40: the failure is a hang (train.heartbeat), seen by every rank
FAILURE_POLL_S = 0.5  # how often each rank looks for another rank's failure
FAILURE_WAIT_S = 10.0  # how long a failing rank waits for the others to have reported it before it exits


class RankFailed(RuntimeError):
    """A rank's training raised: the one-line message names the first failing rank and its error, on every rank.
    The failing rank has already printed that line (`failures_end_every_rank`), so the CLI does not repeat it."""


def _one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())}"[:500]


def _watch(store, stop: threading.Event, heartbeat=None) -> None:
    """Until `stop`: when another rank's failure appears in the store (or the store, hosted by rank 0 or by
    torchrun's agent, is gone), print its one line and end this process now: it may be blocked in a collective
    that would otherwise wait for `train.dist_timeout_min` (NCCL does not notice a dead peer). `heartbeat`
    (train.heartbeat): this rank's progress is published, and a rank stalled past its timeout is a failure too."""
    while not stop.wait(FAILURE_POLL_S):
        try:
            hung = heartbeat.check(store) if heartbeat is not None else None  # i40: a hung rank (train.heartbeat)
            if hung is not None:
                store.compare_set(FAILED_KEY, "", hung)
                store.set(HUNG_KEY, "1")  # every rank (the hung one too) counts itself seen before exiting
                store.set(REPORTED_KEY, "1")  # the line is the detector's: no failing rank will print it
            if not store.check([FAILED_KEY]):
                continue
            message = store.get(FAILED_KEY).decode()
            store.add(SEEN_KEY, 1)
            # the failing rank prints its own line first: a launcher ends every rank once this one exits
            deadline = time.monotonic() + FAILURE_WAIT_S
            while not store.check([REPORTED_KEY]) and time.monotonic() < deadline:
                time.sleep(FAILURE_POLL_S / 5)
        except Exception as err:  # the store is unreachable: its host ended (a rank that finished first, too)
            if stop.wait(FAILURE_WAIT_S):  # this rank is finishing as well
                return
            message = f"the process group's store is gone ({_one_line(err)}): rank 0 or the launcher ended"
        if stop.is_set():  # this rank failed itself meanwhile and reports on its own
            return
        print(f"sharpclip: rank {rank()} stops: {message}", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):  # i40: after a hang no failing rank waits; the store's host (rank 0
            # without torchrun) stays until every rank has read the line
            if store.check([HUNG_KEY]):
                deadline = time.monotonic() + FAILURE_WAIT_S
                while store.add(SEEN_KEY, 0) < world_size() and time.monotonic() < deadline:
                    time.sleep(FAILURE_POLL_S / 5)
        os._exit(1)


@contextlib.contextmanager
def failures_end_every_rank(heartbeat=None) -> Iterator[None]:
    """Around the training loop on several ranks: an exception on any rank ends every rank promptly, each with one
    line naming the first failing rank and its error (RankFailed on the failing rank; the others print it and exit
    with status 1), instead of leaving them in a collective until the process group's timeout.

    The failing rank writes its error into the process group's key-value store (one key: the first failure wins),
    prints the line itself (a launcher may end it as soon as another rank exits, so it does not leave that to the
    CLI), marks it reported and waits up to FAILURE_WAIT_S for the others to have seen it; a thread on every rank
    polls the key and exits once the line is reported. Nothing changes on one process.

    `heartbeat` (train.heartbeat.Heartbeat): the same thread publishes this rank's progress and ends every rank,
    with one line naming the stalled rank, when one makes no progress for train.hang_timeout_min."""
    if world_size() == 1:
        yield
        return
    store = dist.distributed_c10d._get_default_store()
    stop = threading.Event()
    threading.Thread(target=_watch, args=(store, stop, heartbeat), daemon=True, name="sharpclip-failures").start()
    try:
        yield
    except Exception as err:
        stop.set()
        first = f"rank {rank()} failed: {_one_line(err)}"
        with contextlib.suppress(Exception):  # the store is gone (its host ended): our own line still stands
            first = store.compare_set(FAILED_KEY, "", first).decode()  # unset: ours; else the earlier one
        print(f"sharpclip: {first}", file=sys.stderr, flush=True)
        try:
            store.set(REPORTED_KEY, "1")
            deadline = time.monotonic() + FAILURE_WAIT_S
            while store.add(SEEN_KEY, 0) < world_size() - 1 and time.monotonic() < deadline:
                time.sleep(FAILURE_POLL_S / 5)
        except Exception:  # the store is gone (its host ended): nothing more to tell anyone
            pass
        raise RankFailed(first) from err
    finally:
        stop.set()


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


def batch_shapes(batch: object) -> tuple:
    """The shapes of every tensor field of `batch` (host metadata, no device read): equal shapes on a rank from one
    step to the next mean equal feature shapes, so the gather may reuse the shapes it exchanged before."""
    return tuple((k, tuple(v.shape)) for k, v in vars(batch).items() if isinstance(v, Tensor))


class StepFlags:
    """The step's flags, agreed in one all-reduce of 3·W numbers before each step (none on one process): whether
    every rank holds a batch, whether any rank's batch shapes changed since the last step, and every rank's rows.
    While no shape changed, `gather` reuses the shapes it exchanged (no per-step shape exchange); `equal_rows`
    tells the exact step that every rank runs the same backward (see train.step.exact_step)."""

    def __init__(self) -> None:
        self._last: tuple | None = None  # this rank's batch shapes at the last step
        self._shapes: collectives.Shapes | None = None  # every rank's feature shapes at the last gather
        self._reuse = False  # the last agreement found no rank's shapes changed: the next gather may reuse them
        self.equal_rows = False  # every rank holds as many rows as every other at this step
        self.requests: list[float] = []  # i40: the requests of the last agreement, summed over ranks

    def agree(self, batch: object | None, requests: tuple[float, ...] = ()) -> list[bool]:
        """Every rank's "I hold a batch", in rank order (the trainer's one host read before a step). `requests`:
        numbers summed over ranks in the same all-reduce, left in `self.requests` (train.stop: a stop signal, rank
        0's checkpoint clock); on one process they are this rank's own."""
        self.requests = list(requests)  # i40: run control (train.stop) rides on the step's flags
        if world_size() == 1:
            return [batch is not None]
        shapes = batch_shapes(batch) if batch is not None else None
        w, r = world_size(), rank()
        value = torch.zeros(3 * w + len(requests), device=_flag_device())
        value[r] = float(batch is not None)
        value[w + r] = float(shapes != self._last)
        value[2 * w + r] = float(len(batch) if batch is not None else 0)  # type: ignore[arg-type]
        value[3 * w :] = torch.tensor(requests, dtype=value.dtype)  # i40
        dist.all_reduce(value)
        flags = value.tolist()
        self.requests = flags[3 * w :]  # i40
        self._reuse, self._last = not any(flags[w : 2 * w]), shapes
        self.equal_rows = len(set(flags[2 * w :])) == 1
        return [v == 1.0 for v in flags[:w]]

    def gather(self, features: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, slice]]:
        """`collectives.gather`, exchanging shapes only when some rank's batch shapes changed since the last."""
        known, self._reuse = (self._shapes if self._reuse else None), False
        gathered, local, self._shapes = collectives.gather(features, known)
        return gathered, local


def all_flags(flag: bool) -> list[bool]:
    """Every rank's `flag` in rank order, from one all-reduce of W numbers; [flag] on one process, with no
    collective."""
    if world_size() == 1:
        return [flag]
    value = torch.zeros(world_size(), device=_flag_device())
    value[rank()] = float(flag)
    dist.all_reduce(value)
    return [v == 1.0 for v in value.tolist()]
