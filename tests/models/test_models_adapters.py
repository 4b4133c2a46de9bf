"""LoRA/DoRA presets via peft (targets, what trains, merge) and freezing presets."""

from __future__ import annotations

import pytest
import torch

from sharpclip.config import AdapterConfig, FreezeConfig, ModelConfig
from sharpclip.models import create_model
from sharpclip.models.adapters import merge_adapters


def _adapted_modules(model) -> set[str]:
    names = {n.split(".lora_A")[0] for n, _ in model.named_parameters() if ".lora_A." in n}
    return {n.split("base_model.model.")[1] for n in names}


@pytest.mark.parametrize(
    ("towers", "modules", "expected"),
    [
        (
            "text",
            "attention",
            {f"text_model.encoder.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "qkv"}
            | {f"text_model.encoder.layers.{i}.self_attn.out_proj" for i in (0, 1)},
        ),
        ("vision", "mlp", {f"vision_model.encoder.layers.{i}.mlp.fc{j}" for i in (0, 1) for j in (1, 2)}),
    ],
)
def test_presets_target_exactly_the_named_projections(towers: str, modules: str, expected: set[str]) -> None:
    model = create_model(ModelConfig(adapter=AdapterConfig(method="lora", towers=towers, modules=modules, rank=4)))
    assert _adapted_modules(model) == expected


def test_both_towers_attention_and_mlp_is_six_projections_per_layer_and_rank_alpha_apply() -> None:
    model = create_model(ModelConfig(name="tiny-siglip", adapter=AdapterConfig(method="lora", rank=4, alpha=8.0)))
    assert len(_adapted_modules(model)) == 2 * 2 * 6
    layer = model.text_model.encoder.layers[0].self_attn.q_proj
    assert layer.r["default"] == 4 and layer.scaling["default"] == 2.0


@pytest.mark.parametrize("method", ["lora", "dora"])
def test_only_adapters_scale_and_stretched_positions_train_and_merge_is_exact(method: str) -> None:
    cfg = ModelConfig(context_length=248, adapter=AdapterConfig(method=method, rank=4))
    model = create_model(cfg)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    extras = {n for n in trainable if "lora_" not in n}
    assert extras == {
        "backbone.base_model.model.logit_scale",
        "backbone.base_model.model.text_model.embeddings.position_embedding.weight",
    }
    assert any("lora_magnitude_vector" in n for n in trainable) == (method == "dora")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)  # adapters that change the function
    ids = model.tokenizer(["a red square left of a blue circle"], return_tensors="pt")["input_ids"]
    pixels = torch.randn(2, 3, 32, 32)
    model.eval()
    with torch.no_grad():
        before = model.encode_text(ids).embedding, model.encode_image(pixels).embedding
        merge_adapters(model)
        after = model.encode_text(ids).embedding, model.encode_image(pixels).embedding
    assert not any("lora_" in n for n, _ in model.named_parameters())
    assert type(model.backbone).__name__ == "CLIPModel"
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_lock_vision_tower_with_last_layer_unlocked() -> None:
    model = create_model(ModelConfig(freeze=FreezeConfig(vision=True, vision_unlocked_layers=1)))
    trains = {n for n, p in model.named_parameters() if p.requires_grad}
    vision = {n for n in trains if "vision_model" in n or "visual_projection" in n}
    assert all(
        n.startswith(
            (
                "backbone.vision_model.encoder.layers.1.",
                "backbone.vision_model.post_layernorm",
                "backbone.visual_projection",
            )
        )
        for n in vision
    )
    assert "backbone.visual_projection.weight" in vision and any("layers.1." in n for n in vision)
    assert "backbone.text_model.encoder.layers.0.mlp.fc1.weight" in trains  # the other tower is untouched


def test_lock_text_tower_entirely() -> None:
    model = create_model(ModelConfig(freeze=FreezeConfig(text=True)))
    trains = {n for n, p in model.named_parameters() if p.requires_grad}
    assert not any("text_model" in n or "text_projection" in n for n in trains)
    assert "backbone.logit_scale" in trains
    with pytest.raises(ValueError, match="has 2 layers"):
        create_model(ModelConfig(freeze=FreezeConfig(text=True, text_unlocked_layers=3)))
