"""`train.micro_batch_size: auto`: the largest micro-batch that fits the device's memory, found before step 1.

Memory changes, the math never does. Under exact accumulation the micro-batch is only the rows per forward pass of
the cached-gradient step, so any size gives the global batch's gradient; `auto` picks it among the sizes the config
allows (divisors of `train.batch_size`), at most this rank's share b = batch_size / W (one pass per step). Under
per_micro_batch the micro-batch is the contrastive matrix and stays as the recipe set it; `auto` sizes the encode
passes instead (`train.encode_batch_size`: multiples of the micro-batch that divide the batch, at most b), which
are only speed and memory (train.step).

How: trial steps, each one whole forward and backward of `run_step` at the run's real shapes: the rank's first
batch, its rows repeated or cut to b (under exact on W ranks, to the global batch B, so the trial's matrix is at
least the b × B block each rank computes), captions padded to the context length (the longest any batch can have:
the model's, or a distillation teacher's when shorter), the run's precision and objective, so the loss's own tensors
(the gathered matrix, FILIP's token similarities, margins) count. A trial that raises `torch.OutOfMemoryError` has
failed: its gradients are set to None, its tensors dropped (the exception and its frames first), and on CUDA the
cache is emptied; any other error propagates. No trial steps the optimiser, but each holds an allocation of the size
AdamW's state will take at its first step (exp_avg and exp_avg_sq: 8 bytes per fp32 parameter, this rank's shards),
so a size chosen near the device's capacity still fits at step 2; gradients end as None, buffers and every
random generator (CPU, CUDA, numpy, Python) are restored, so the run then trains exactly as if it had been given the
size by hand.

Search (downward, then up): the largest candidate first (b: no accumulation at all); on out-of-memory the largest
candidate at most half the one that failed, until one fits; then a bisection among the candidates between the
largest that fitted and the smallest that failed. log2 of the candidates' range trials at most each way.

Several ranks: each rank searches on its own with collectives switched off (a one-process context for the step, the
engine's gradient reduction off: a rank out of memory inside a collective would leave the others waiting), then
every rank takes the smallest choice of all (one gather of W integers); a sharded layout, whose forwards gather
parameters from the other ranks, refuses `auto` (`check_layout`); when
one rank found nothing, every rank stops with the same message. The log gives the choice, the trials and the
memory of the chosen one (CUDA's max_memory_allocated and the device's total; on the CPU memory is not measured).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from sharpclip.config import AUTO, ConfigError, TrainConfig
from sharpclip.data.schema import Batch
from sharpclip.losses import Objective
from sharpclip.train import checkpoint
from sharpclip.train.engine import local
from sharpclip.train.features import FeatureEncoder
from sharpclip.train.logging import log
from sharpclip.train.parallel import ParallelContext
from sharpclip.train.step import ONE, run_step

OutOfMemory = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)  # torch.OutOfMemoryError from 2.5
GIB = 2**30


@dataclass
class Trial:
    size: int
    peak: int | None  # bytes at the trial's peak (0: not measured on this device); None: out of memory


def candidates(cfg: TrainConfig, world: int) -> list[int]:
    """The sizes `auto` may choose, ascending: micro-batches under exact (divisors of the batch, at most the rank's
    share), encode passes under per_micro_batch (multiples of the micro-batch dividing the batch, at most the share)."""
    share = cfg.batch_size // world
    if cfg.accumulation == "exact":
        return [d for d in range(1, share + 1) if cfg.batch_size % d == 0]
    micro = cfg.micro_batch_size
    return [e for e in range(micro, max(share, micro) + 1, micro) if cfg.batch_size % e == 0]


def largest_fitting(sizes: list[int], fits: Callable[[int], int | None]) -> list[Trial]:
    """Every trial made, in order, searching `sizes` (ascending) for the largest `fits` accepts (`fits(size)`: the
    peak bytes, None when out of memory): the largest first, halving on failure, then a bisection between the largest
    that fitted and the smallest that failed. The choice is the largest fitting trial (none: no trial fitted)."""
    trials: list[Trial] = []

    def attempt(k: int) -> bool:
        trials.append(Trial(sizes[k], fits(sizes[k])))
        return trials[-1].peak is not None

    k, failed = len(sizes) - 1, len(sizes)
    while k >= 0 and not attempt(k):
        failed = k
        k = max((j for j in range(k) if sizes[j] <= sizes[k] // 2), default=-1)
    while k >= 0 and failed - k > 1:  # sizes[k] fits, sizes[failed] does not (or is past the end)
        middle = (k + failed) // 2
        if attempt(middle):
            k = middle
        else:
            failed = middle
    return trials


def chosen(trials: list[Trial]) -> Trial | None:
    """The largest trial that fitted."""
    return max((t for t in trials if t.peak is not None), key=lambda t: t.size, default=None)


def trial_batch(batch: Batch, rows: int, context: int) -> Batch:
    """`batch` with its rows repeated (or cut) to `rows` and its captions padded to `context` tokens (pad 0, mask 0):
    the largest shapes a step of this run can meet. Edit pairs are repeated with their rows; groups stay distinct."""
    n = len(batch)
    copies = -(-rows // n)
    fields = {}
    for name, value in vars(batch).items():
        if isinstance(value, Tensor) and value.shape[:1] == (n,):
            value = torch.cat([value] * copies)[:rows]
            if name in ("input_ids", "attention_mask", "short_input_ids", "short_attention_mask"):
                value = torch.nn.functional.pad(value, (0, max(0, context - value.shape[1])))
            if name == "groups":
                value = value + (value.max() + 1) * torch.arange(copies).repeat_interleave(n)[:rows]
        fields[name] = value
    fields["ids"] = (batch.ids * copies)[:rows]
    source, target = ([v + k * n for k in range(copies)] for v in (batch.edit_source, batch.edit_target))
    source, target = torch.cat(source), torch.cat(target)
    keep = (source < rows) & (target < rows)
    fields["edit_source"], fields["edit_target"] = source[keep], target[keep]
    return replace(batch, **fields)


def optimizer_state_bytes(params: list[Tensor]) -> int:
    """Bytes AdamW's state will hold for `params` (this rank's shards): exp_avg and exp_avg_sq in each parameter's
    dtype (fp32 master weights: 8 bytes a parameter), allocated at its first step."""
    return sum(2 * local(p).numel() * local(p).element_size() for p in params if p.requires_grad)


def check_layout(cfg: TrainConfig, ctx: ParallelContext) -> None:
    """`auto` trials run each rank alone; a sharded layout gathers parameters from the other ranks in every forward,
    so a rank out of memory mid-trial would leave the others waiting: refused there, in one line."""
    if is_auto(cfg) and ctx.several and ctx.layout != "replicate":
        raise ConfigError(
            f"train.micro_batch_size: auto sizes micro-batches by trial steps on each process alone, which "
            f"train.layout={ctx.layout} cannot run (every forward gathers parameters from the other processes); "
            "give train.micro_batch_size (and train.encode_batch_size) by hand, or use train.layout=replicate"
        )


class Trials:
    """Trial steps of one encoder and objective on one batch; `fits(size)` for `largest_fitting`."""

    def __init__(
        self, encoder: FeatureEncoder, objective: Objective, batch: Batch, cfg: TrainConfig,
        ctx: ParallelContext = ONE, optimizer: torch.optim.Optimizer | None = None,
    ):  # fmt: skip
        self.encoder, self.objective, self.batch, self.cfg, self.ctx = encoder, objective, batch, cfg, ctx
        self.params = list(encoder.model.parameters())
        # the optimiser's state does not exist before its first step: its size is held during the trials instead
        stateless = optimizer is None or not optimizer.state
        self.state_bytes = optimizer_state_bytes(self.params) if stateless else 0

    def fits(self, size: int) -> int | None:
        """Peak bytes of one step at `size` (0 off CUDA), or None when it ran out of memory; nothing kept either way."""
        device = self.encoder.device
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        exact = self.cfg.accumulation == "exact"
        micro, encode = (size, 0) if exact else (self.cfg.micro_batch_size, size)
        reserve = None
        try:
            reserve = torch.empty(self.state_bytes, dtype=torch.uint8, device=device)  # AdamW's state to come
            # alone: no gather, no gradient reduction (a replicated engine's parameters are all here)
            with self.ctx.accumulating():
                run_step(self.encoder, self.objective, self.batch, micro, self.cfg.accumulation, encode, ctx=ONE)
            return torch.cuda.max_memory_allocated(device) if cuda else 0
        except OutOfMemory:
            pass  # leave the except clause first: the exception's frames hold the trial's tensors until then
        finally:
            del reserve
            if self.ctx.engine is not None:
                self.ctx.engine.discard_unsynced()
            for p in self.params:
                p.grad = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        return None


def fit_to_memory(
    encoder: FeatureEncoder, objective: Objective, batch: Batch, cfg: TrainConfig, ctx: ParallelContext = ONE,
    optimizer: torch.optim.Optimizer | None = None,
) -> TrainConfig:  # fmt: skip
    """`cfg` with `auto` replaced by the largest size whose trial step fits on every rank (see the module docstring);
    `batch`: this rank's first batch; `optimizer`: the run's, whose state (not yet allocated) each trial holds room
    for. The model, its gradients, buffers and random generators are left as found."""
    world = ctx.world
    rows = cfg.batch_size if cfg.accumulation == "exact" else cfg.batch_size // world
    context = min(t.context_length for t in (encoder.model, *encoder.towers.values()))  # a teacher's may be shorter
    trials = Trials(encoder, objective, trial_batch(encoder.to_device(batch), rows, context), cfg, ctx, optimizer)
    buffers = {name: b.detach().clone() for name, b in encoder.model.named_buffers()}
    rng = checkpoint.rng_state(encoder.device)
    try:
        made = largest_fitting(candidates(cfg, world), trials.fits)
    finally:
        checkpoint.set_rng_state(rng, encoder.device)
        with torch.no_grad():
            for name, b in encoder.model.named_buffers():
                b.copy_(buffers[name])
    best = chosen(made)
    size = min(ctx.all_ranks(best.size if best else 0))
    if not size:
        raise RuntimeError(_nothing_fits(cfg, encoder.device, made))
    _log_choice(cfg, encoder.device, made, size, world)
    if cfg.accumulation == "exact":
        return replace(cfg, micro_batch_size=size)
    return replace(cfg, encode_batch_size=size)


def _nothing_fits(cfg: TrainConfig, device: torch.device, made: list[Trial]) -> str:
    what = "a micro-batch of 1 row" if cfg.accumulation == "exact" else f"one micro-batch ({made[-1].size} rows)"
    where = "on this rank" if made and chosen(made) is None else "on another rank"
    return (
        f"train.micro_batch_size: auto: a training step with {what} runs out of memory on {device} ({where}); use "
        "train.precision=bf16, train.grad_checkpointing=true, a smaller train.batch_size (or micro-batch under "
        "per_micro_batch), or a device with more memory"
    )


def _log_choice(cfg: TrainConfig, device: torch.device, made: list[Trial], size: int, world: int) -> None:
    tried = ", ".join(f"{t.size} {'fits' if t.peak is not None else 'out of memory'}" for t in made)
    mine = next((t for t in made if t.size == size), None)
    if device.type != "cuda":
        memory = f"memory is not measured on {device.type}"
    elif mine is None or mine.peak is None:
        memory = "the smallest of the ranks' choices, not tried here"
    else:
        total = torch.cuda.get_device_properties(device).total_memory
        memory = f"peak {mine.peak / GIB:.2f} GiB of {total / GIB:.2f} GiB allocated on {device}"
    ranks = f", the smallest over {world} ranks" if world > 1 else ""
    if cfg.accumulation == "exact":
        head = f"train.micro_batch_size: auto chose {size} rows a pass (the global batch stays {cfg.batch_size})"
    else:
        head = (f"train.encode_batch_size: auto chose {size} rows a forward pass; the micro-batch stays "
                f"{cfg.micro_batch_size} rows, each its own contrastive matrix as the recipe set it")  # fmt: skip
    log.info("%s%s (trials: %s; %s)", head, ranks, tried, memory)


def is_auto(cfg: TrainConfig) -> bool:
    """Whether a size of `cfg` waits for `fit_to_memory`."""
    return AUTO in (cfg.micro_batch_size, cfg.encode_batch_size)
