"""`model.tiny.*` sizes the tiny presets (the demo's SynthDense model), and a checkpoint keeps them."""

from __future__ import annotations

import pytest
import torch

from sharpclip.config import ConfigError, load_config
from sharpclip.models import create_model, save_checkpoint
from sharpclip.models.factory import load_checkpoint

SIZES = [
    "model.tiny.width=48",
    "model.tiny.layers=3",
    "model.tiny.heads=4",
    "model.tiny.image_size=48",
    "model.tiny.patch_size=8",
    "model.tiny.context_length=144",
]


def test_tiny_sizes_reach_the_model(tmp_path):
    cfg = load_config(None, ["model.vocabulary=synthdense", *SIZES])
    model = create_model(cfg.model)
    vision, text = model.vision_model.config, model.text_model.config
    assert (vision.hidden_size, vision.num_hidden_layers, vision.image_size, vision.patch_size) == (48, 3, 48, 8)
    assert (text.hidden_size, text.num_hidden_layers, text.max_position_embeddings) == (48, 3, 144)
    assert model.context_length == 144 and model.tokenizer.model_max_length == 144
    assert model.image_processor.crop_size == {"height": 48, "width": 48}
    pixels, ids = torch.rand(2, 3, 48, 48), torch.randint(3, 20, (2, 144))
    image = model.encode_image(pixels).embedding
    assert image.shape == (2, 48)
    reloaded = load_checkpoint(save_checkpoint(model, tmp_path / "ckpt", cfg.model))
    assert reloaded.context_length == 144
    mask = torch.ones_like(ids)
    torch.testing.assert_close(reloaded.encode_text(ids, mask).embedding, model.eval().encode_text(ids, mask).embedding)


def test_default_tiny_size_is_unchanged():
    model = create_model(load_config().model)
    assert model.vision_model.config.hidden_size == 32 and model.context_length == 77


@pytest.mark.parametrize("bad", ["model.tiny.width=30", "model.tiny.image_size=36", "model.tiny.layers=0"])
def test_bad_tiny_sizes_are_config_errors(bad):
    with pytest.raises(ConfigError, match=r"model\.tiny"):
        load_config(None, [bad])
