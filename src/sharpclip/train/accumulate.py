"""Large contrastive batches on small memory: exact cached-gradient accumulation (GradCache, Gao et al. 2021).

A contrastive loss over B = k·m samples is not a sum of k losses over m samples, so ordinary gradient accumulation
changes the objective (every micro-batch sees only m − 1 negatives). The cached-gradient step keeps the objective:

  1. encode each micro-batch without a graph, recording its RNG state, and keep the (B, ...) features;
  2. compute the loss on the whole batch from detached copies of those features and backpropagate it to them,
     caching ∂L/∂f. Parameters that live in the loss (the logit scale and bias) receive their gradient here, once;
  3. re-encode each micro-batch with a graph, RNG restored so dropout draws the same masks, and backpropagate the
     surrogate Σ ⟨f, ∂L/∂f⟩, whose parameter gradient is exactly this micro-batch's share of ∂L/∂θ.

Summed over micro-batches this is ∂L/∂θ of the full batch (up to float rounding), at the activation memory of one
micro-batch plus the (B, ...) features. `per_micro_batch_step` is the ordinary alternative (each micro-batch its own
loss, averaged), kept because the HN-CLIP paper's effective batch of 128 was 16 × 8 that way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

Features = dict[str, Tensor]
EncodeFn = Callable[[Any], Mapping[str, Tensor]]  # micro-batch -> per-sample features, dim 0 = samples
LossFn = Callable[[Mapping[str, Tensor]], Mapping[str, Tensor]]  # global features -> {"loss": ..., term: ...}
GatherFn = Callable[[Mapping[str, Tensor]], Mapping[str, Tensor]]
NoSyncFn = Callable[[], contextlib.AbstractContextManager]


@dataclass
class RngState:
    """The CPU generator's state and, when training on a GPU, that GPU's, to replay a forward pass's random draws.

    Only the training device's generator is recorded: dropout on `cuda:i` draws from cuda:i's generator alone, and
    touching every GPU's generator would create a context on each of them from every rank.
    """

    cpu: Tensor
    cuda: Tensor | None = None
    device: torch.device | None = None  # the CUDA device `cuda` belongs to

    @classmethod
    def capture(cls, device: torch.device | None = None) -> RngState:
        """The current states; `device`: the training device (its generator is recorded when it is a GPU)."""
        if device is not None and device.type == "cuda":
            return cls(torch.get_rng_state(), torch.cuda.get_rng_state(device), device)
        return cls(torch.get_rng_state())

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the body with this state; the surrounding RNG state is restored afterwards."""
        devices = [self.device] if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


def concat_features(parts: Sequence[Mapping[str, Tensor]]) -> Features:
    """Concatenate micro-batch features along dim 0, zero-padding other dims (token length) to the largest."""
    out: Features = {}
    for key in parts[0]:
        tensors = [p[key] for p in parts]
        shape = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].ndim)]
        padded = []
        for t in tensors:
            pad = [x for d in reversed(range(1, t.ndim)) for x in (0, shape[d - 1] - t.shape[d])]
            padded.append(F.pad(t, pad) if any(pad) else t)
        out[key] = torch.cat(padded)
    return out


def _split_like(full: Tensor, parts: Sequence[Tensor]) -> list[Tensor]:
    """Undo `concat_features` for one key: slice rows and strip the padding of each micro-batch."""
    out, start = [], 0
    for p in parts:
        block = full[start : start + p.shape[0]]
        out.append(block[tuple(slice(0, n) for n in p.shape)])
        start += p.shape[0]
    return out


def _as_leaves(features: Mapping[str, Tensor]) -> Features:
    return {k: v.detach().requires_grad_(v.is_floating_point()) for k, v in features.items()}


def cached_gradient_step(
    encode: EncodeFn,
    micro_batches: Sequence[Any],
    loss_fn: LossFn,
    *,
    gather: GatherFn = dict,
    no_sync: NoSyncFn = contextlib.nullcontext,
    device: torch.device | None = None,
) -> dict[str, Tensor]:
    """One exact large-batch backward pass over `micro_batches`; returns the detached loss terms.

    encode: runs the towers on one micro-batch (the caller applies autocast there if wanted).
    loss_fn: the objective on the whole (gathered) batch; model-level parameters such as the logit scale are read
        from the caller's closure and receive their gradient once, in step 2.
    gather: across processes (`distributed.gather_features`); identity on one process.
    no_sync: context that suspends DDP's gradient all-reduce; entered for every replay but the last.
    device: the training device; on a GPU its generator is replayed with the CPU's, so dropout masks match.
    Gradients are accumulated into `.grad`; the caller zeroes them and steps the optimiser.
    """
    states, cached = [], []
    for mb in micro_batches:  # step 1: features without a graph
        states.append(RngState.capture(device))
        with torch.no_grad():
            cached.append({k: v.detach() for k, v in encode(mb).items()})

    leaves = _as_leaves(concat_features(cached))  # step 2: full-batch loss, gradients w.r.t. the features
    terms = loss_fn(gather(leaves))
    terms["loss"].backward()
    grads = {k: _split_like(v.grad, [c[k] for c in cached]) for k, v in leaves.items() if v.grad is not None}

    last = len(micro_batches) - 1
    for j, (mb, state) in enumerate(zip(micro_batches, states, strict=True)):  # step 3: replay and backprop
        with no_sync() if j < last else contextlib.nullcontext(), state.replay():
            fresh = encode(mb)
            surrogate = sum((fresh[k] * g[j]).sum() for k, g in grads.items())
            if isinstance(surrogate, Tensor) and surrogate.requires_grad:
                surrogate.backward()
    return {k: v.detach() for k, v in terms.items()}


def per_micro_batch_step(
    encode: EncodeFn,
    micro_batches: Sequence[Any],
    loss_fn: LossFn,
    *,
    gather: GatherFn = dict,
    no_sync: NoSyncFn = contextlib.nullcontext,
) -> dict[str, Tensor]:
    """Ordinary accumulation: each micro-batch is its own contrastive problem; the loss is their mean.

    Returns the detached terms averaged over micro-batches.
    """
    k = len(micro_batches)
    totals: dict[str, Tensor] = {}
    for j, mb in enumerate(micro_batches):
        with no_sync() if j < k - 1 else contextlib.nullcontext():
            terms = loss_fn(gather(encode(mb)))
            (terms["loss"] / k).backward()
        for name, value in terms.items():
            totals[name] = totals.get(name, 0.0) + value.detach() / k
    return totals
