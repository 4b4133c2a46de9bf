"""Weight-space ensembling of a fine-tuned model with its initialisation (WiSE-FT, Wortsman et al. 2022, eq. 1):

    θ_α = (1 − α)·θ_init + α·θ_ft          α = 0: the initialisation, α = 1: the fine-tuned model

Both models must have one structure. The initialisation is therefore rebuilt the way the trainer built its starting
point: `INIT` loaded through `create_model` with the fine-tuned checkpoint's own ModelConfig (adapters off), so a
Long-CLIP stretch, its kept rows, a RoPE text tower and the logit-scale initialisation are applied to it exactly as
they were before the first step. LoRA/DoRA adapters of the fine-tuned model are merged into its weights first.
Floating-point tensors are interpolated with `torch.lerp`, which returns each end exactly at α = 0 and α = 1; any
other tensor (integer buffers) must be equal in both models. A structural mismatch is a `BlendError` naming the
tensors that differ.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch import Tensor

from sharpclip.config import AdapterConfig, ModelConfig
from sharpclip.models import adapters
from sharpclip.models.factory import CHECKPOINT_CONFIG, create_model, load_checkpoint
from sharpclip.models.hf import HFDualEncoder


class BlendError(ValueError):
    """The two models cannot be blended (different structure, or a checkpoint without its model config)."""


def checkpoint_model_config(directory: str | Path) -> ModelConfig:
    """The ModelConfig a sharpclip checkpoint was built with (its `sharpclip_model.yaml`)."""
    path = Path(directory) / CHECKPOINT_CONFIG
    if not path.is_file():
        raise BlendError(f"{directory}: not a sharpclip checkpoint (no {CHECKPOINT_CONFIG}); pass a run's checkpoint")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(path)))


def check_same_structure(init: Mapping[str, Tensor], tuned: Mapping[str, Tensor]) -> None:
    """Raise BlendError unless both state dicts have the same keys, shapes and dtypes (first differences named)."""
    problems = [f"only in the initialisation: {k}" for k in init if k not in tuned]
    problems += [f"only in the fine-tuned model: {k}" for k in tuned if k not in init]
    problems += [
        f"{k}: {tuple(init[k].shape)} {init[k].dtype} vs {tuple(tuned[k].shape)} {tuned[k].dtype}"
        for k in init
        if k in tuned and (init[k].shape != tuned[k].shape or init[k].dtype != tuned[k].dtype)
    ]
    if problems:
        shown = "; ".join(problems[:4]) + (f"; … {len(problems) - 4} more" if len(problems) > 4 else "")
        raise BlendError(f"the two models differ in structure, so their weights cannot be blended: {shown}")


def blend_states(init: Mapping[str, Tensor], tuned: Mapping[str, Tensor], alpha: float) -> dict[str, Tensor]:
    """θ_α for every tensor: lerp for floating point (exact at both ends), equality required for the rest."""
    check_same_structure(init, tuned)
    out: dict[str, Tensor] = {}
    for key, start in init.items():
        end = tuned[key]
        if start.is_floating_point():
            out[key] = torch.lerp(start, end.to(start.device), alpha)
        elif torch.equal(start, end.to(start.device)):
            out[key] = start.clone()
        else:
            raise BlendError(f"{key}: a non-floating tensor ({start.dtype}) differs between the two models")
    return out


class WeightBlend:
    """The models θ_α between an initialisation and a fine-tuned checkpoint (or run directory), one α at a time.

    init: any `model.name` form (a checkpoint, a transformers folder, an OpenAI-format file); finetuned: a sharpclip
    checkpoint (of a run directory: train.checkpoint.resolve_source picks its newest or best one).
    `at(alpha)` loads θ_α into one model instance and returns it; `model_config` is the ModelConfig to save it with.
    """

    def __init__(self, init: str, finetuned: str | Path) -> None:
        source = Path(finetuned)
        trained_cfg = checkpoint_model_config(source)
        plain_cfg = replace(trained_cfg, adapter=AdapterConfig(method="none"))
        tuned = load_checkpoint(source).float().eval()
        adapters.merge_adapters(tuned)
        start = create_model(replace(plain_cfg, name=str(init))).float().eval()
        self.source = source
        self.model_config = plain_cfg
        self.start = _detached(start.state_dict())
        self.end = _detached(tuned.state_dict())
        check_same_structure(self.start, self.end)
        self.model = tuned

    def at(self, alpha: float) -> HFDualEncoder:
        """The model with θ_α loaded (the same instance every call)."""
        if not 0.0 <= alpha <= 1.0:
            raise BlendError(f"alpha must be in [0, 1], got {alpha}")
        self.model.load_state_dict(blend_states(self.start, self.end, alpha))
        return self.model


def _detached(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in state.items()}
