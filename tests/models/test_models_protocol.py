"""The DualEncoder protocol over the HF adapters: shapes, normalisation, pooling, token masks, loading errors."""

from __future__ import annotations

import pytest
import torch

from sharpclip.config import ModelConfig
from sharpclip.models import ModelNotFoundError, create_model, tiny_model

KINDS = ["clip", "siglip", "siglip2"]
CAPTIONS = ["a red square left of a blue circle", "two stars"]


def _inputs(model):
    enc = model.tokenizer(CAPTIONS, padding="max_length", truncation=True, return_tensors="pt")
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)), enc


@pytest.mark.parametrize("kind", KINDS)
def test_embeddings_are_normalised_with_token_masks(kind: str) -> None:
    model = tiny_model(kind)
    pixels, enc = _inputs(model)
    img = model.encode_image(pixels, tokens=True)
    txt = model.encode_text(enc["input_ids"], enc["attention_mask"], tokens=True)
    assert img.embedding.shape == (2, 32) and txt.embedding.shape == (2, 32)
    assert img.tokens.shape == (2, 16, 32)  # 4x4 patches, CLS excluded
    assert txt.tokens.shape == (2, enc["input_ids"].shape[1], 32)
    for t in (img.embedding, txt.embedding, img.tokens, txt.tokens):
        torch.testing.assert_close(t.norm(dim=-1), torch.ones(t.shape[:-1]))
    assert img.token_mask.all() and txt.token_mask.tolist() == enc["attention_mask"].bool().tolist()
    assert model.encode_image(pixels).tokens is None
    feats = model(pixels, enc["input_ids"], enc["attention_mask"], tokens=True)
    keys = {"image", "image_tokens", "image_token_mask", "text", "text_tokens", "text_token_mask"}
    assert set(feats) == keys


def test_clip_pools_at_the_end_of_text_token_and_tokens_use_the_projection() -> None:
    model = tiny_model("clip")
    _, enc = _inputs(model)
    ids = enc["input_ids"]
    eos = (ids == model.tokenizer.eos_token_id).int().argmax(-1)
    assert model.text_model.config.eos_token_id == model.tokenizer.eos_token_id
    txt = model.encode_text(ids, enc["attention_mask"], tokens=True)
    pooled_tokens = txt.tokens[torch.arange(2), eos]  # the normalised projected token at eos = the global embedding
    torch.testing.assert_close(pooled_tokens, txt.embedding)
    assert eos.tolist() == [9, 3]  # bos + 8 words + eos; bos + 2 words + eos


def test_clip_image_tokens_are_post_layernormed_projected_patches() -> None:
    model = tiny_model("clip")
    pixels, _ = _inputs(model)
    hidden = model.vision_model(pixel_values=pixels).last_hidden_state
    expected = model.hf_model.visual_projection(model.vision_model.post_layernorm(hidden))
    expected = torch.nn.functional.normalize(expected, dim=-1)
    got = model.encode_image(pixels, tokens=True)
    torch.testing.assert_close(got.tokens, expected[:, 1:])
    torch.testing.assert_close(got.embedding, expected[:, 0])  # CLS through the same norm + projection


def test_text_token_mask_without_attention_mask_stops_at_the_first_eos() -> None:
    model = tiny_model("clip")
    _, enc = _inputs(model)
    got = model.encode_text(enc["input_ids"], tokens=True).token_mask
    assert got.tolist() == enc["attention_mask"].bool().tolist()


def test_logit_scale_and_bias() -> None:
    clip, siglip = tiny_model("clip"), tiny_model("siglip")
    assert isinstance(clip.logit_scale, torch.nn.Parameter) and clip.logit_bias is None
    assert clip.logit_scale.item() == pytest.approx(2.6592, abs=1e-4)
    assert siglip.logit_bias.item() == -10.0 and siglip.logit_scale.item() == pytest.approx(2.302585, abs=1e-5)
    frozen = create_model(ModelConfig(name="tiny-clip", logit_scale_learnable=False, logit_scale_init=4.6052))
    assert not frozen.logit_scale.requires_grad and frozen.logit_scale.item() == pytest.approx(4.6052)


@pytest.mark.parametrize("kind", KINDS)
def test_create_model_from_a_transformers_folder_reproduces_the_model(kind: str, tmp_path) -> None:
    model = tiny_model(kind, seed=3)
    model.hf_model.save_pretrained(tmp_path)
    model.tokenizer.save_pretrained(tmp_path)
    model.image_processor.save_pretrained(tmp_path)
    again = create_model(ModelConfig(name=str(tmp_path)))
    assert type(again) is type(model) and again.tokenizer is not None and again.image_processor is not None
    pixels, enc = _inputs(model)
    with torch.no_grad():
        torch.testing.assert_close(again.encode_image(pixels).embedding, model.encode_image(pixels).embedding)
        torch.testing.assert_close(
            again.encode_text(enc["input_ids"]).embedding, model.encode_text(enc["input_ids"]).embedding
        )


def test_missing_model_names_what_to_download_and_never_fetches(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match=r"hf download someone/not-cached-clip --local-dir"):
        create_model(ModelConfig(name="someone/not-cached-clip"))
    with pytest.raises(ModelNotFoundError, match="no such file or folder"):
        create_model(ModelConfig(name="/nonexistent/folder"))


@pytest.mark.parametrize("adapter", ["none", "lora"])
def test_siglip_logit_bias_follows_logit_scale_learnable_with_or_without_adapters(adapter: str) -> None:
    from sharpclip.config import AdapterConfig

    adapters = AdapterConfig(method=adapter, rank=4) if adapter != "none" else AdapterConfig()
    frozen = create_model(ModelConfig(name="tiny-siglip", logit_scale_learnable=False, adapter=adapters))
    assert not frozen.logit_scale.requires_grad and not frozen.logit_bias.requires_grad
    learnable = create_model(ModelConfig(name="tiny-siglip", logit_scale_learnable=True, adapter=adapters))
    assert learnable.logit_scale.requires_grad and learnable.logit_bias.requires_grad
