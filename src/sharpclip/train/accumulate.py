"""Large contrastive batches on small memory: exact cached-gradient accumulation (GradCache, Gao et al. 2021).

A contrastive loss over B = k·m samples is not a sum of k losses over m samples, so ordinary gradient accumulation
changes the objective (every micro-batch sees only m − 1 negatives). The cached-gradient step keeps the objective:

  1. encode each micro-batch without a graph, recording its RNG state, and keep the (B, ...) features;
  2. compute the loss on the whole batch from detached copies of those features and backpropagate it to them,
     caching ∂L/∂f. Parameters that live in the loss (the logit scale and bias) receive their gradient here, once;
  3. re-encode each micro-batch with a graph, RNG restored so dropout draws the same masks, and backpropagate the
     surrogate Σ ⟨f, ∂L/∂f⟩, whose parameter gradient is exactly this micro-batch's share of ∂L/∂θ.

Summed over micro-batches this is ∂L/∂θ of the full batch (up to float rounding), at the activation memory of one
micro-batch plus the (B, ...) features. The ordinary alternative (each micro-batch its own loss, averaged; the HN-CLIP
paper's effective batch of 128 was 16 × 8 that way) needs no machinery and is written out in train.step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

Features = dict[str, Tensor]
EncodeFn = Callable[[Any], Mapping[str, Tensor]]  # micro-batch -> per-sample features, dim 0 = samples
ReplayFn = Callable[[Any, Collection[str]], Mapping[str, Tensor]]  # micro-batch, names -> those features
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


def _split_like(full: Tensor, shapes: Sequence[torch.Size]) -> list[Tensor]:
    """Undo `concat_features` for one key: slice rows and strip the padding of each micro-batch (its `shapes`)."""
    out, start = [], 0
    for shape in shapes:
        block = full[start : start + shape[0]]
        out.append(block[tuple(slice(0, n) for n in shape)])
        start += shape[0]
    return out


def _as_leaves(features: Mapping[str, Tensor], constant: Collection[str] = ()) -> Features:
    return {k: v.detach().requires_grad_(v.is_floating_point() and k not in constant) for k, v in features.items()}


class CachedFeatures:
    """Steps 1 and 3 of the cached-gradient step, around the caller's step 2.

        cache = CachedFeatures(encode, micro_batches, device)   # step 1: encode without a graph, RNG recorded
        loss = <the loss on cache.leaves, gathered if need be>    # step 2: the caller's, on the whole batch
        loss.backward()                                           #   ∂L/∂f lands in cache.leaves[k].grad
        cache.backward()                                          # step 3: replay each micro-batch, backprop Σ⟨f, g⟩

    encode: runs the towers on one micro-batch (the caller applies autocast there if wanted); dim 0 = samples.
    device: the training device; on a GPU its generator is replayed with the CPU's, so dropout masks match.
    constant: features that receive no gradient (a frozen tower's): their leaves do not require grad.
    replay: `(micro-batch, names) -> features` computing only `names`, the features whose leaves received a
    gradient (default: `encode`, all of them); the replay then skips what needs no graph (frozen towers).
    `leaves` are the (B, ...) features of all micro-batches, detached, floating ones requiring grad. Parameters that
    live in the loss (the logit scale and bias) receive their gradient in step 2, once. Only the micro-batches'
    shapes are kept besides the leaves, not a second copy of their features.
    """

    def __init__(
        self,
        encode: EncodeFn,
        micro_batches: Sequence[Any],
        device: torch.device | None = None,
        constant: Collection[str] = (),
        replay: ReplayFn | None = None,
    ):
        self.encode, self.micro_batches = encode, list(micro_batches)
        self.replay = replay or (lambda mb, names: encode(mb))
        self.states, parts = [], []
        for mb in self.micro_batches:
            self.states.append(RngState.capture(device))
            with torch.no_grad():
                parts.append({k: v.detach() for k, v in encode(mb).items()})
        self.shapes = [{k: v.shape for k, v in p.items()} for p in parts]
        self.leaves = _as_leaves(concat_features(parts), constant)

    def backward(self, no_sync: NoSyncFn = contextlib.nullcontext) -> None:
        """Step 3, once the loss was backpropagated to `leaves`: each micro-batch's share of ∂L/∂θ into `.grad`.

        no_sync: context that suspends the gradient reduction (the engine's `ParallelContext.accumulating`, or DDP's
        `no_sync`); entered for every replay but the last.
        """
        grads = {
            k: _split_like(v.grad, [p[k] for p in self.shapes]) for k, v in self.leaves.items() if v.grad is not None
        }
        last = len(self.micro_batches) - 1
        for j, (mb, state) in enumerate(zip(self.micro_batches, self.states, strict=True)):
            with no_sync() if j < last else contextlib.nullcontext(), state.replay():
                fresh = self.replay(mb, frozenset(grads))
                surrogate = sum((fresh[k] * g[j]).sum() for k, g in grads.items())
                if isinstance(surrogate, Tensor) and surrogate.requires_grad:
                    surrogate.backward()


def cached_gradient_step(
    encode: EncodeFn,
    micro_batches: Sequence[Any],
    loss_fn: LossFn,
    *,
    gather: GatherFn = dict,
    no_sync: NoSyncFn = contextlib.nullcontext,
    device: torch.device | None = None,
) -> dict[str, Tensor]:
    """One exact large-batch backward pass over `micro_batches` for a loss of the features alone; returns the
    detached loss terms. (train.step writes the same three steps out, as its loss also reads the batch.)

    loss_fn: the objective on the whole (gathered) batch, returning {"loss": ..., term: ...}; model-level
        parameters such as the logit scale are read from the caller's closure.
    gather: across processes (`distributed.gather_features`: every rank then computes the whole loss; the
        training step computes local rows instead, train.step); identity on one process.
    Gradients are accumulated into `.grad`; the caller zeroes them and steps the optimiser.
    """
    cache = CachedFeatures(encode, micro_batches, device)
    terms = loss_fn(gather(cache.leaves))
    terms["loss"].backward()
    cache.backward(no_sync)
    return {k: v.detach() for k, v in terms.items()}
