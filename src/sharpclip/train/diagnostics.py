"""Gradient dynamics on the current batch (HN-CLIP §2.4, Fig. 4), recorded every N steps to diagnostics.jsonl.

For the step's global batch, both objectives of the paper's analysis are evaluated on the same features:

    L_CLIP (eq. 1) and L_HN (eq. 2, γ of the objective's hn_clip term, else hn_clip's default 0.5), their
    gradients w.r.t. every trainable parameter,
    ‖∇L_CLIP‖, ‖∇L_HN‖, their ratio and cosine, and whether each gradient is exactly zero in float32
    (the paper's "exact zero in fp32": the softmax residual underflowed for every row),
    and the batch's Ḡ statistics: mean off-diagonal caption similarity and mean hardest companion.

Each gradient is the full effective-batch gradient, computed with the accumulation training uses, and averaged
across ranks. The record's fields (read by analysis/dynamics.py):

    step, epoch, loss_infonce, loss_hn, grad_norm_infonce, grad_norm_hn, grad_norm_ratio (hn / infonce),
    grad_cosine, grad_zero_infonce, grad_zero_hn, margin_mean, margin_hardest, batch_rows

Under per_micro_batch accumulation every micro-batch is its own contrastive problem (HN-CLIP's 16 × 8), so the
record also lists, per micro-batch, its InfoNCE and whether its own InfoNCE gradient is exactly zero
(micro_loss_infonce, micro_grad_zero_infonce); the step's gradient is their mean, as in training. As in training,
each micro-batch's matrix is built from one rank's rows alone (`micro_batch_size` rows at every world size), and the
lists hold every rank's micro-batches, in rank order.

Memory: gradients are kept per parameter (the `.grad` tensors themselves, taken out of the model), never flattened
into one copy; norms come from `torch._foreach_norm` and the cosine from per-parameter dot products.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from sharpclip import collectives
from sharpclip.data.schema import Batch
from sharpclip.losses import hn_clip, infonce, margin_matrix
from sharpclip.train import distributed
from sharpclip.train.accumulate import CachedFeatures
from sharpclip.train.features import FeatureEncoder
from sharpclip.train.parallel import ParallelContext
from sharpclip.train.step import split_rows

# the keys of a diagnostics.jsonl record that analysis.dynamics and demo.measure read back
LOSS_INFONCE, LOSS_HN = "loss_infonce", "loss_hn"  # the batch's loss (mean over micro-batches under per_micro_batch)
MICRO_LOSS_INFONCE, MICRO_LOSS_HN = "micro_loss_infonce", "micro_loss_hn"  # per micro-batch (per_micro_batch only)
MICRO_GRAD_ZERO_INFONCE, MICRO_GRAD_ZERO_HN = "micro_grad_zero_infonce", "micro_grad_zero_hn"  # 1.0: exactly zero
GRAD_NORM_INFONCE, GRAD_NORM_HN = "grad_norm_infonce", "grad_norm_hn"
GRAD_ZERO_INFONCE, GRAD_ZERO_HN = "grad_zero_infonce", "grad_zero_hn"
GRAD_COSINE = "grad_cosine"
_KEYS = {
    "infonce": (LOSS_INFONCE, MICRO_LOSS_INFONCE, MICRO_GRAD_ZERO_INFONCE),
    "hn": (LOSS_HN, MICRO_LOSS_HN, MICRO_GRAD_ZERO_HN),
}


Grads = list[Tensor]  # one gradient per trainable parameter


def _take_grads(params: list[torch.nn.Parameter], ctx: ParallelContext | None = None) -> Grads:
    """The parameters' gradients (`ctx` on several processes: first averaged over ranks), taken out of the model
    (every `.grad` is None afterwards)."""
    if ctx is not None and ctx.several:
        distributed.average_gradients(params)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    for p in params:
        p.grad = None
    return grads


def _norm(grads: Grads) -> Tensor:
    """‖g‖ over all parameters (fp32), from per-parameter norms."""
    return torch.linalg.vector_norm(torch.stack([n.float() for n in torch._foreach_norm(grads)]))


def _dot(a: Grads, b: Grads) -> Tensor:
    """⟨a, b⟩ over all parameters, one dot product per parameter (flattened views, no copies)."""
    return sum(torch.dot(x.reshape(-1).float(), y.reshape(-1).float()) for x, y in zip(a, b, strict=True))


def margin_stats(text: Tensor) -> dict[str, float]:
    """Mean off-diagonal Ḡ and mean (over captions) of the hardest companion's similarity. text: (B, D)."""
    g = margin_matrix(text)
    b = g.shape[0]
    off = g.masked_fill(torch.eye(b, dtype=torch.bool, device=g.device), float("-inf"))
    return {"margin_mean": float(g.sum() / max(1, b * (b - 1))), "margin_hardest": float(off.max(dim=1).values.mean())}


def _per_micro_batch(
    encoder: FeatureEncoder, micro: list[Batch], fn, params: list, record: dict, ctx: ParallelContext
) -> tuple:
    """Each micro-batch's own loss and gradient (this rank's rows, never gathered); returns (mean loss, mean
    gradient, losses) over every rank's micro-batches and fills the per-micro lists, in rank order."""
    losses, zero, margins, total = [], [], [], None
    for mb in micro:
        encoder.model.zero_grad(set_to_none=True)
        feats = encoder(mb)
        loss = fn(feats["image"], feats["text"], encoder.model.logit_scale)
        loss.backward()
        grad = _take_grads(params)
        losses.append(float(loss.detach()))
        zero.append(float(_norm(grad) == 0.0))
        margins.append(margin_stats(feats["text"].detach()))
        if total is None:
            total = grad
        else:
            torch._foreach_add_(total, grad)
        del grad
    losses, zero, margins = (ctx.all_ranks_lists(x) for x in (losses, zero, margins))
    for p, g in zip(params, total or [None] * len(params), strict=True):  # the sum, back in place to be reduced
        p.grad = g
    total = _take_grads(params, ctx)  # every rank's sum, averaged over ranks: the sum over ranks / W
    torch._foreach_mul_(total, ctx.world / len(losses))  # the mean over every rank's micro-batches
    record["_zero"], record["_margin"] = zero, margins
    return sum(losses) / len(losses), total, losses


def _whole_batch(
    encoder: FeatureEncoder, micro: list[Batch], fn, params: list, ctx: ParallelContext
) -> tuple[float, Grads, dict]:
    """The loss over the whole batch (cached gradients, as training), its gradient and the batch's Ḡ statistics."""
    cache = CachedFeatures(encoder, micro, encoder.device)
    feats = collectives.gather_features(cache.leaves) if ctx.several else cache.leaves
    loss = fn(feats["image"], feats["text"], encoder.model.logit_scale)
    loss.backward()
    cache.backward()
    stats = {**margin_stats(feats["text"].detach()), "batch_rows": len(feats["text"])}
    return float(loss.detach()), _take_grads(params, ctx), stats


def gradient_diagnostics(
    encoder: FeatureEncoder,
    batch: Batch,
    micro_batch_size: int,
    gamma: float = 0.5,
    accumulation: str = "exact",
    ctx: ParallelContext | None = None,
) -> dict[str, float]:
    """Both objectives' losses and gradients on `batch` (γ: the objective's hn_clip term's); leaves every `.grad`
    zeroed. ctx: the run's parallel context (default: this process in the default process group). The encoder's
    model must be a plain module (not under the engine): each rank's own gradients are read and averaged here."""
    ctx = ctx if ctx is not None else ParallelContext.from_process_group()
    encoder = encoder.restricted(("image", "text"))
    model = encoder.model
    params = [p for p in model.parameters() if p.requires_grad]
    micro = split_rows(encoder.to_device(batch), micro_batch_size)
    record: dict = {}
    grads = {}
    for name, fn in (("infonce", infonce), ("hn", lambda i, t, s: hn_clip(i, t, s, gamma=gamma))):
        model.zero_grad(set_to_none=True)
        loss_key, micro_loss_key, micro_zero_key = _KEYS[name]
        if accumulation == "per_micro_batch":
            parts: dict = {}
            record[loss_key], grads[name], losses = _per_micro_batch(encoder, micro, fn, params, parts, ctx)
            record[micro_loss_key], record[micro_zero_key] = losses, parts["_zero"]
            record["margin_mean"] = sum(m["margin_mean"] for m in parts["_margin"]) / len(losses)
            record["margin_hardest"] = sum(m["margin_hardest"] for m in parts["_margin"]) / len(losses)
            record["batch_rows"] = int(ctx.all_reduce_sum(torch.tensor(len(batch), device=encoder.device)))
            continue
        record[loss_key], grads[name], stats = _whole_batch(encoder, micro, fn, params, ctx)
        if name == "hn":
            record.update(stats)
    model.zero_grad(set_to_none=True)
    norm_c, norm_h = float(_norm(grads["infonce"])), float(_norm(grads["hn"]))
    both = norm_c > 0 and norm_h > 0
    cosine = float(_dot(grads["infonce"], grads["hn"])) / (norm_c * norm_h) if both else math.nan
    record.update(
        {
            GRAD_NORM_INFONCE: norm_c,
            GRAD_NORM_HN: norm_h,
            "grad_norm_ratio": norm_h / norm_c if norm_c else math.inf,
            GRAD_COSINE: cosine,
            GRAD_ZERO_INFONCE: float(norm_c == 0.0),
            GRAD_ZERO_HN: float(norm_h == 0.0),
        }
    )
    return record
