"""Optimiser and schedule: AdamW with parameter groups, warmup + cosine, clipping, and the logit-scale clamp.

Weight decay skips gains, biases and the logit scale/bias (the CLIP convention: parameters with fewer than two
dimensions, plus anything named like a norm, bias or logit parameter). Per-module learning rates are given as
`{name prefix: lr}`; the longest matching prefix wins, everything else takes the base rate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from sharpclip.losses._common import LN_100

NO_DECAY_WORDS = ("bias", "norm", "logit_scale", "logit_bias")


def _decays(name: str, param: nn.Parameter) -> bool:
    return param.ndim >= 2 and not any(word in name for word in NO_DECAY_WORDS)


def _lr_for(name: str, base_lr: float, module_lr: Mapping[str, float]) -> float:
    matches = [prefix for prefix in module_lr if name.startswith(prefix)]
    return module_lr[max(matches, key=len)] if matches else base_lr


def param_groups(
    named_params: Iterable[tuple[str, nn.Parameter]],
    lr: float,
    weight_decay: float,
    module_lr: Mapping[str, float] | None = None,
) -> list[dict]:
    """AdamW groups keyed by (lr, decays); only parameters with requires_grad. Each group lists its `names`."""
    groups: dict[tuple[float, bool], dict] = {}
    for name, param in named_params:
        if not param.requires_grad:
            continue
        group_lr, decays = _lr_for(name, lr, module_lr or {}), _decays(name, param)
        group = groups.setdefault(
            (group_lr, decays), {"params": [], "names": [], "lr": group_lr, "weight_decay": weight_decay * decays}
        )
        group["params"].append(param)
        group["names"].append(name)
    if not groups:
        raise ValueError("the model has no trainable parameters (check model.freeze and model.adapter)")
    return list(groups.values())


def build_optimizer(
    model: nn.Module, lr: float, weight_decay: float, module_lr: Mapping[str, float] | None = None, betas=(0.9, 0.98)
) -> torch.optim.AdamW:
    """AdamW over the model's trainable parameters (betas 0.9/0.98, eps 1e-6: the CLIP fine-tuning defaults)."""
    return torch.optim.AdamW(param_groups(model.named_parameters(), lr, weight_decay, module_lr), betas=betas, eps=1e-6)


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> float:
    """Learning-rate multiplier: linear from 1/warmup to 1 over `warmup_steps`, then cosine down to `min_ratio`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_ratio: float = 0.0
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, warmup_steps, total_steps, min_ratio)
    )


@torch.no_grad()
def clamp_logit_scale(logit_scale: nn.Parameter | None, max_value: float = LN_100) -> None:
    """Keep s = exp(logit_scale) ≤ 100 after each step (CLIP); a no-op for a frozen or absent scale."""
    if logit_scale is not None:
        logit_scale.clamp_(max=max_value)
