"""Gradient dynamics on the current batch (HN-CLIP §2.4, Fig. 4), recorded every N steps to diagnostics.jsonl.

For the step's global batch, both objectives of the paper's analysis are evaluated on the same features:

    L_CLIP (eq. 1) and L_HN (eq. 2, γ from config), their gradients w.r.t. every trainable parameter,
    ‖∇L_CLIP‖, ‖∇L_HN‖, their ratio and cosine, and whether each gradient is exactly zero in float32
    (the paper's "exact zero in fp32": the softmax residual underflowed for every row),
    and the batch's Ḡ statistics: mean off-diagonal caption similarity and mean hardest companion.

Each gradient is the full effective-batch gradient, computed with the same exact accumulation as training, and
averaged across ranks. The record's fields (read by analysis/dynamics.py):

    step, epoch, loss_infonce, loss_hn, grad_norm_infonce, grad_norm_hn, grad_norm_ratio (hn / infonce),
    grad_cosine, grad_zero_infonce, grad_zero_hn, margin_mean, margin_hardest, batch_rows
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from sharpclip.data.schema import Batch
from sharpclip.losses import hn_clip, infonce, margin_matrix
from sharpclip.train import distributed
from sharpclip.train.accumulate import cached_gradient_step
from sharpclip.train.step import FeatureEncoder, model_device, split_rows, to_model_device


def _flat_grad(params: list[torch.nn.Parameter]) -> Tensor:
    distributed.average_gradients(params)
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().float() for p in params])


def margin_stats(text: Tensor) -> dict[str, float]:
    """Mean off-diagonal Ḡ and mean (over captions) of the hardest companion's similarity. text: (B, D)."""
    g = margin_matrix(text)
    b = g.shape[0]
    off = g.masked_fill(torch.eye(b, dtype=torch.bool, device=g.device), float("-inf"))
    return {"margin_mean": float(g.sum() / max(1, b * (b - 1))), "margin_hardest": float(off.max(dim=1).values.mean())}


def gradient_diagnostics(
    encoder: FeatureEncoder, batch: Batch, micro_batch_size: int, gamma: float = 0.5
) -> dict[str, float]:
    """Both objectives' losses and gradients on `batch`; leaves every `.grad` zeroed."""
    model = encoder.model
    params = [p for p in model.parameters() if p.requires_grad]
    micro = split_rows(to_model_device(batch, model), micro_batch_size)
    record: dict[str, float] = {}
    grads = {}
    for name, fn in (("infonce", infonce), ("hn", lambda i, t, s: hn_clip(i, t, s, gamma=gamma))):
        model.zero_grad(set_to_none=True)

        def loss_fn(feats: Mapping[str, Tensor], fn=fn, name=name) -> dict[str, Tensor]:
            if name == "hn":
                record.update(margin_stats(feats["text"]))
                record["batch_rows"] = len(feats["text"])
            return {"loss": fn(feats["image"], feats["text"], model.logit_scale)}

        terms = cached_gradient_step(
            encoder, micro, loss_fn, gather=distributed.gather_features, device=model_device(model)
        )
        record[f"loss_{name}"] = float(terms["loss"])
        grads[name] = _flat_grad(params)
    model.zero_grad(set_to_none=True)
    norm_c, norm_h = float(grads["infonce"].norm()), float(grads["hn"].norm())
    both = norm_c > 0 and norm_h > 0
    cosine = float(torch.nn.functional.cosine_similarity(grads["infonce"], grads["hn"], dim=0)) if both else math.nan
    record.update(
        grad_norm_infonce=norm_c,
        grad_norm_hn=norm_h,
        grad_norm_ratio=norm_h / norm_c if norm_c else math.inf,
        grad_cosine=cosine,
        grad_zero_infonce=float(norm_c == 0.0),
        grad_zero_hn=float(norm_h == 0.0),
    )
    return record
