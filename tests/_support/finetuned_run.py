"""A tiny initialisation checkpoint and a run directory trained from it (weights perturbed), in the trainer's layout:
what `sharpclip blend` and the export tests read."""

from __future__ import annotations

from pathlib import Path

import torch

from sharpclip.config import AdapterConfig, ModelConfig, TinyConfig
from sharpclip.models import create_model, save_checkpoint
from sharpclip.train import checkpoint


def init_checkpoint(path: Path, width: int = 32) -> Path:
    """A random tiny CLIP saved as a sharpclip checkpoint at `path`."""
    cfg = ModelConfig(tiny=TinyConfig(width=width))
    save_checkpoint(create_model(cfg), path, cfg)
    return path


def finetuned_run(run: Path, init: Path, adapter: str = "none", context: int | None = 134):
    """`run/checkpoints/step-000003/`, built from `init` (stretched to `context`) with every trainable weight (or
    only the adapters' B matrices) moved; returns (model in eval mode, its ModelConfig)."""
    cfg = ModelConfig(name=str(init), context_length=context, adapter=AdapterConfig(method=adapter, rank=4))
    model = create_model(cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and (adapter == "none" or "lora_B" in name):
                p.add_(0.05 * torch.randn_like(p))
    checkpoint.save(run / "checkpoints", 3, lambda d: save_checkpoint(model, d, cfg), {}, {"step": 3})
    return model.eval(), cfg
