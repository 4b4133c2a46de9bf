"""Causal text towers with right-padded captions run without the padding mask (models.hf): the same embeddings and
real-token states as the masked run, and attention without a mask (`attn_mask=None, is_causal=True`, which a GPU's
flash kernel accepts). Left-padding tokenizers keep the mask; SigLIP never passes one."""

from __future__ import annotations

import pytest
import torch

from sharpclip.config import ModelConfig
from sharpclip.data.transforms import TextTokenizer
from sharpclip.models import create_model, tiny_model
from sharpclip.models.base import normalize

CAPTIONS = ["a red square", "a small green circle left of a large blue star at the top", "a ring", "a black cross ."]


def _model(kind: str):
    if kind == "rope":
        return create_model(ModelConfig(name="tiny-clip", text_encoder="rope")).eval()
    return tiny_model(kind).eval()


def _masked_run(model, ids, mask):
    """What the adapter computed when it passed the mask: pooled embedding and projected token states."""
    out = model.text_model(input_ids=ids, attention_mask=mask)
    proj = model.hf_model.text_projection
    return normalize(proj(out.pooler_output)), normalize(proj(out.last_hidden_state))


class SdpaSpy:
    def __init__(self, monkeypatch):
        self.calls: list[tuple[bool, bool]] = []  # (a mask was passed, is_causal)
        original = torch.nn.functional.scaled_dot_product_attention

        def spy(*args, **kwargs):
            self.calls.append((kwargs.get("attn_mask") is not None, bool(kwargs.get("is_causal", False))))
            return original(*args, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)


@pytest.mark.parametrize("kind", ["clip", "rope"])
def test_right_padded_causal_towers_run_without_the_mask_and_agree_with_the_masked_run(kind, monkeypatch):
    model = _model(kind)
    ids, mask = TextTokenizer(model.tokenizer, model.context_length)(CAPTIONS)
    assert not bool(mask.all())  # the batch is padded: a mask would have been built from it
    with torch.no_grad():
        reference, reference_tokens = _masked_run(model, ids, mask)
        spy = SdpaSpy(monkeypatch)
        out = model.encode_text(ids, mask, tokens=True)
    assert spy.calls and set(spy.calls) == {(False, True)}  # every layer: no mask, causal
    torch.testing.assert_close(out.embedding, reference, rtol=0, atol=1e-6)
    real = mask.bool()
    torch.testing.assert_close(out.tokens[real], reference_tokens[real], rtol=0, atol=1e-6)
    assert torch.equal(out.token_mask, real)  # FILIP's token mask is still the caption's


@pytest.mark.parametrize("kind", ["clip", "rope"])
def test_a_left_padding_tokenizer_keeps_the_mask(kind, monkeypatch):
    model = _model(kind)
    model.tokenizer.padding_side = "left"
    ids, mask = TextTokenizer(model.tokenizer, model.context_length)(CAPTIONS)
    assert not bool(mask[:, 0].all())  # padded on the left
    with torch.no_grad():
        reference, _ = _masked_run(model, ids, mask)
        spy = SdpaSpy(monkeypatch)
        out = model.encode_text(ids, mask)
    assert spy.calls and all(masked for masked, _ in spy.calls)
    torch.testing.assert_close(out.embedding, reference)


def test_siglip_reads_no_mask_and_vision_towers_none(monkeypatch):
    model = tiny_model("siglip")
    ids, mask = TextTokenizer(model.tokenizer, model.context_length, pad_to_context=True)(CAPTIONS)
    spy = SdpaSpy(monkeypatch)
    with torch.no_grad():
        model.encode_text(ids, mask)
        model.encode_image(torch.randn(2, 3, 32, 32))
    assert spy.calls and not any(masked for masked, _ in spy.calls)
