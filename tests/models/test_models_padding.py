"""Dynamic text padding (to the batch's longest caption, rounded up to 8) gives the embeddings of full-context padding
for CLIP and the RoPE tower; SigLIP's tower reads its padding, so it keeps the full context. The towers attend with
torch's scaled_dot_product_attention (transformers' "sdpa"), the RoPE tower with its causal mask."""

from __future__ import annotations

import pytest
import torch

from sharpclip.config import TinyConfig
from sharpclip.data.transforms import TextTokenizer
from sharpclip.models import tiny_model
from sharpclip.models.preprocessing import model_transforms
from sharpclip.models.rope import to_rope

CAPTIONS = ["a red square", "a small blue circle left of a large green star at the top", "star"]


def _model(kind: str):
    if kind == "rope":
        model = tiny_model("clip", size=TinyConfig(context_length=96))
        to_rope(model.text_model)
        return model.eval()
    return tiny_model(kind).eval()


def _embed(model, tokenize: TextTokenizer, tokens: bool = False):
    ids, mask = tokenize(CAPTIONS)
    with torch.no_grad():
        out = model.encode_text(ids, mask, tokens=tokens)
    return ids.shape[1], out


@pytest.mark.parametrize("kind", ["clip", "rope"])
def test_dynamic_padding_equals_full_context_padding(kind):
    model = _model(kind)
    _, tokenize = model_transforms(model)
    assert not tokenize.pad_to_context
    full = TextTokenizer(model.tokenizer, model.context_length, pad_to_context=True)
    width, dynamic = _embed(model, tokenize, tokens=True)
    full_width, padded = _embed(model, full, tokens=True)
    assert width % 8 == 0 and width < full_width == model.context_length
    torch.testing.assert_close(dynamic.embedding, padded.embedding, atol=1e-5, rtol=1e-5)
    real = dynamic.token_mask  # token features agree on the real tokens
    torch.testing.assert_close(dynamic.tokens[real], padded.tokens[:, :width][real], atol=1e-5, rtol=1e-5)


def test_siglip_keeps_full_context_padding_because_its_tower_reads_the_padding():
    model = _model("siglip")
    _, tokenize = model_transforms(model)
    assert tokenize.pad_to_context and model.pads_to_context
    width, full = _embed(model, tokenize)
    assert width == model.context_length
    short = TextTokenizer(model.tokenizer, model.context_length)  # what dynamic padding would give SigLIP
    _, dynamic = _embed(model, short)
    assert not torch.allclose(dynamic.embedding, full.embedding, atol=1e-4)


def test_the_padded_width_is_the_longest_caption_rounded_up_to_eight_within_the_context():
    tok = tiny_model("clip").tokenizer
    lengths = TextTokenizer(tok, 77).lengths(CAPTIONS)
    ids, mask = TextTokenizer(tok, 77)(CAPTIONS)
    assert ids.shape == mask.shape == (3, -(-max(lengths) // 8) * 8)
    assert mask.sum(1).tolist() == lengths
    ids, _ = TextTokenizer(tok, 13)(CAPTIONS)  # the context caps the width (13 is no multiple of 8)
    assert ids.shape[1] == 13 and ids[1, -1] == tok.eos_token_id


@pytest.mark.parametrize("kind", ["clip", "siglip", "rope"])
def test_towers_attend_with_scaled_dot_product_attention(kind, monkeypatch):
    model = _model(kind)
    assert model.text_model.config._attn_implementation == "sdpa"
    assert model.vision_model.config._attn_implementation == "sdpa"
    calls = []
    original = torch.nn.functional.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(kwargs.get("is_causal", False) or kwargs.get("attn_mask") is not None)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    _, tokenize = model_transforms(model)
    _embed(model, tokenize)
    assert len(calls) == model.text_model.config.num_hidden_layers
    if kind != "siglip":  # CLIP and the RoPE tower: causal (mask or flag) in every layer
        assert all(calls)


def test_the_rope_tower_is_causal_under_sdpa_and_matches_eager():
    model = _model("rope")
    ids, mask = TextTokenizer(model.tokenizer, model.context_length)(CAPTIONS)
    with torch.no_grad():
        sdpa = model.text_model(input_ids=ids, attention_mask=mask).last_hidden_state
        changed = ids.clone()
        changed[:, -1] = 5  # a later position: no earlier state may move
        later = model.text_model(input_ids=changed, attention_mask=mask).last_hidden_state
        model.text_model.config._attn_implementation = "eager"
        eager = model.text_model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(sdpa, eager, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(later[:, :-1], sdpa[:, :-1], atol=1e-6, rtol=0)
