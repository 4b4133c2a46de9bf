"""Freezing presets: lock a tower, optionally leaving its last N layers trainable (open_clip's `lock_image`
with `unlocked_groups`, per tower).

Unlocking the last N layers also unlocks what sits after them (the final norm and the projection), which is what the
last layers feed; N = 0 locks the whole tower, projection included. Adapter weights (peft) are left as peft set them.
"""

from __future__ import annotations

from torch import nn

from sharpclip.config import FreezeConfig
from sharpclip.models.hf import HFDualEncoder


def _head(model: HFDualEncoder, tower: str) -> list[nn.Module]:
    """The modules after the last layer of `tower`: final norm and projection (whichever the backbone has)."""
    base = model.hf_model
    if tower == "vision":
        names = [(model.vision_model, "post_layernorm"), (model.vision_model, "head"), (base, "visual_projection")]
    else:
        names = [(model.text_model, "final_layer_norm"), (model.text_model, "head"), (base, "text_projection")]
    return [getattr(owner, n) for owner, n in names if isinstance(getattr(owner, n, None), nn.Module)]


def lock_tower(model: HFDualEncoder, tower: str, unlocked_layers: int = 0) -> None:
    """Freeze every non-adapter parameter of `tower` (text | vision) except its last `unlocked_layers` layers."""
    module = model.text_model if tower == "text" else model.vision_model
    _set_base_grad(module, False)
    for extra in _head(model, tower):
        _set_base_grad(extra, False)
    if unlocked_layers <= 0:
        return
    layers = module.encoder.layers
    if unlocked_layers > len(layers):
        raise ValueError(f"model.freeze.{tower}_unlocked_layers={unlocked_layers}: the tower has {len(layers)} layers")
    for layer in list(layers)[-unlocked_layers:]:
        _set_base_grad(layer, True)
    for extra in _head(model, tower):
        _set_base_grad(extra, True)


def _set_base_grad(module: nn.Module, flag: bool) -> None:
    for name, p in module.named_parameters():
        if "lora_" not in name:
            p.requires_grad_(flag)


def apply_freezing(model: HFDualEncoder, cfg: FreezeConfig) -> None:
    """Lock the towers `cfg` names, leaving their `*_unlocked_layers` last layers trainable."""
    if cfg.vision:
        lock_tower(model, "vision", cfg.vision_unlocked_layers)
    if cfg.text:
        lock_tower(model, "text", cfg.text_unlocked_layers)
