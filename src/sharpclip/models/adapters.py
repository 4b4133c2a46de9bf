"""Low-rank adapters through peft: LoRA (Hu et al. 2021, eq. 3: W' = W + (α/r)·BA) and DoRA (Liu et al. 2024,
eq. 5: W' = m · (W + ΔW) / ‖W + ΔW‖, per output row), with presets over the towers' attention and MLP projections.

Preset target names (identical in CLIP, SigLIP and SigLIP 2, and in the RoPE text tower):

    {text,vision}_model.encoder.layers.N.self_attn.{q,k,v,out}_proj     attention
    {text,vision}_model.encoder.layers.N.mlp.{fc1,fc2}                  mlp

peft freezes every base parameter; `unfreeze_extras` re-enables the few that must keep training with adapters
(docs/method-notes.md §9): the logit scale (when learnable) and bias, and a stretched position table (its frozen
first rows live in a buffer, so only the stretched part trains). `merge_adapters` folds the adapters into plain
Linear layers (`merge_and_unload`) for export.
"""

from __future__ import annotations

from peft import LoraConfig, get_peft_model

from sharpclip.config import AdapterConfig
from sharpclip.models.hf import HFDualEncoder
from sharpclip.models.long_context import KeptPositionEmbedding

_MODULES = {"attention": r"self_attn\.(q|k|v|out)_proj", "mlp": r"mlp\.fc[12]", "attention_mlp": None}
_TOWERS = {"text": "text_model", "vision": "vision_model", "both": "(text|vision)_model"}


def target_pattern(cfg: AdapterConfig) -> str:
    """The regex peft full-matches against module names, e.g. `.*text_model\\.encoder\\.layers\\.\\d+\\.(…)`."""
    modules = _MODULES[cfg.modules] or f"({_MODULES['attention']}|{_MODULES['mlp']})"
    return rf".*{_TOWERS[cfg.towers]}\.encoder\.layers\.\d+\.{modules}"


def add_adapters(model: HFDualEncoder, cfg: AdapterConfig) -> None:
    """Wrap `model.backbone` in a peft model with LoRA/DoRA on the preset's projections (no-op for method none)."""
    if cfg.method == "none" or is_adapted(model):
        return
    lora = LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=target_pattern(cfg),
        use_dora=cfg.method == "dora",
    )
    model.backbone = get_peft_model(model.backbone, lora)


def is_adapted(model: HFDualEncoder) -> bool:
    """True when the backbone is wrapped by peft (LoRA / DoRA adapters)."""
    return hasattr(model.backbone, "merge_and_unload")


def unfreeze_extras(model: HFDualEncoder, logit_scale_learnable: bool) -> None:
    """Re-enable what must train beside the adapters: logit scale/bias and a stretched position table."""
    model.logit_scale.requires_grad_(logit_scale_learnable)
    if model.logit_bias is not None:
        model.logit_bias.requires_grad_(logit_scale_learnable)
    positions = getattr(model.text_model.embeddings, "position_embedding", None)
    if isinstance(positions, KeptPositionEmbedding):
        positions.weight.requires_grad_(True)


def merge_adapters(model: HFDualEncoder) -> None:
    """Fold LoRA/DoRA into the base weights in place: the backbone becomes the plain transformers model again."""
    if is_adapted(model):
        model.backbone = model.backbone.merge_and_unload()
