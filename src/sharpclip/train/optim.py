"""Optimiser and schedule: AdamW with parameter groups, warmup then cosine, linear or constant, and the logit-scale
clamp.

Weight decay skips gains, biases and the logit scale/bias (the CLIP convention: parameters with fewer than two
dimensions, plus anything named like a norm, bias or logit parameter). Per-module learning rates are given as
`{name prefix: lr}`; the longest matching prefix wins, everything else takes the base rate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from sharpclip.config import ConfigError

NO_DECAY_WORDS = ("bias", "norm", "logit_scale", "logit_bias")
LN_100 = math.log(100.0)  # the CLIP convention (open_clip's clamp): training never raises s above 100


def _decays(name: str, param: nn.Parameter) -> bool:
    return param.ndim >= 2 and not any(word in name for word in NO_DECAY_WORDS)


def _prefix_of(name: str, module_lr: Mapping[str, float]) -> str:
    matches = [prefix for prefix in module_lr if name.startswith(prefix)]
    return max(matches, key=len) if matches else ""


def lr_for(name: str, base_lr: float, module_lr: Mapping[str, float] | None = None) -> float:
    """The learning rate of parameter `name`: its longest matching `module_lr` prefix's, else `base_lr`."""
    prefix = _prefix_of(name, module_lr or {})
    return module_lr[prefix] if prefix else base_lr


def check_module_lr(names: Iterable[str], module_lr: Mapping[str, float]) -> None:
    """Every `train.module_lr` prefix must start some parameter's name (a typo would silently do nothing)."""
    names = list(names)
    for prefix in module_lr:
        if not any(n.startswith(prefix) for n in names):
            tops = sorted({".".join(n.split(".")[:2]) for n in names})
            raise ConfigError(
                f"train.module_lr.{prefix}: matches no parameter of the model; parameter names start with "
                f"{', '.join(tops[:8])}"
            )


def param_groups(
    named_params: Iterable[tuple[str, nn.Parameter]],
    lr: float,
    weight_decay: float,
    module_lr: Mapping[str, float] | None = None,
) -> list[dict]:
    """AdamW groups keyed by (module_lr prefix, decays); only parameters with requires_grad. Each group lists its
    `names`. Keying by prefix rather than by rate keeps the groups the same when a resume changes the rates."""
    groups: dict[tuple[str, bool], dict] = {}
    module_lr = module_lr or {}
    for name, param in named_params:
        if not param.requires_grad:
            continue
        prefix, decays = _prefix_of(name, module_lr), _decays(name, param)
        group_lr = module_lr[prefix] if prefix else lr
        group = groups.setdefault(
            (prefix, decays), {"params": [], "names": [], "lr": group_lr, "weight_decay": weight_decay * decays}
        )
        group["params"].append(param)
        group["names"].append(name)
    if not groups:
        raise ValueError("the model has no trainable parameters (check model.freeze and model.adapter)")
    return list(groups.values())


def build_optimizer(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    module_lr: Mapping[str, float] | None = None,
    betas: tuple[float, float] = (0.9, 0.98),
    eps: float = 1e-6,
    fused: bool = False,
) -> torch.optim.AdamW:
    """AdamW over the model's trainable parameters (defaults betas 0.9/0.98, eps 1e-6: the CLIP fine-tuning ones;
    `train.beta1`, `train.beta2`, `train.eps`). fused: one fused kernel per step (on CUDA: the trainer's choice
    there); else the multi-tensor (foreach) form. Built after the engine has sharded the model, so its state is
    sharded like the parameters (fp32)."""
    check_module_lr((n for n, _ in model.named_parameters()), module_lr or {})
    groups = param_groups(model.named_parameters(), lr, weight_decay, module_lr)
    kind = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(groups, betas=tuple(betas), eps=eps, **kind)


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> float:
    """Learning-rate multiplier: linear from 1/warmup to 1 over `warmup_steps`, then cosine down to `min_ratio`."""
    return lr_factor(step, warmup_steps, total_steps, min_ratio, "cosine")


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float = 0.0, shape: str = "cosine") -> float:
    """Learning-rate multiplier at `step`: linear from 1/warmup to 1 over `warmup_steps`, then `shape` (train.schedule):
    cosine or linear down to `min_ratio` at `total_steps`, or constant at 1."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if shape == "constant":
        return 1.0
    if shape == "linear":
        return min_ratio + (1 - min_ratio) * (1 - progress)
    if shape != "cosine":
        raise ConfigError(f"train.schedule: {shape!r} is not one of cosine, linear, constant")
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_ratio: float = 0.0, shape: str = "cosine"
) -> torch.optim.lr_scheduler.LambdaLR:
    """The warmup then `shape` schedule (lr_factor) on every parameter group."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup_steps, total_steps, min_ratio, shape)
    )


def logit_scale_ceiling(logit_scale: nn.Parameter | None) -> float:
    """The most log s that training may reach: ln 100 (open_clip's clamp), or the scale training starts from when that
    is higher (a SigLIP checkpoint's own ≈ 112, or a `model.logit_scale_init` above ln 100), so no checkpoint's scale is
    cut down by the first step."""
    return LN_100 if logit_scale is None else max(LN_100, float(logit_scale.detach()))


@torch.no_grad()
def clamp_logit_scale(logit_scale: nn.Parameter | None, max_value: float = LN_100, min_value: float = 0.0) -> None:
    """Keep 0 ≤ log s ≤ max_value after each step (open_clip clamps log s to [0, ln 100]; the trainer passes
    `logit_scale_ceiling` of the scale it started from): a runaway update can no longer drive the scale to 0, where
    every logit is equal. A no-op for a frozen or absent scale, which the losses use as given."""
    if logit_scale is not None and logit_scale.requires_grad:
        logit_scale.clamp_(min=min_value, max=max_value)
