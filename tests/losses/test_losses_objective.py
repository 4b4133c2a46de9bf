"""The composed objective: weighted named terms, input remapping, and config errors that name the key."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sharpclip.config import ConfigError, LossConfig, TermConfig, load_config
from sharpclip.losses import build_objective, edit_negatives, filip, hn_clip, infonce


def _feats(b=6, d=5, seed=0):
    g = torch.Generator().manual_seed(seed)

    def unit(*shape):
        return F.normalize(torch.randn(*shape, generator=g, dtype=torch.float64), dim=-1)

    return {
        "image": unit(b, d),
        "text": unit(b, d),
        "text_short": unit(b, d),
        "text_long": unit(b, d),
        "image_tokens": unit(b, 3, d),
        "text_tokens": unit(b, 4, d),
        "source_image": unit(b, d),
        "target_image": unit(b, d),
        "source_text": unit(b, d),
        "target_text": unit(b, d),
        "logit_scale": torch.tensor(2.0, dtype=torch.float64),
    }


def test_hnclip_eq3_is_the_weighted_sum_of_its_terms():
    terms = {"hn": TermConfig("hn_clip", params={"gamma": 0.25}), "tok": TermConfig("filip", weight=0.7)}
    cfg = LossConfig(terms=terms)
    f = _feats()
    out = build_objective(cfg)(f)
    hn = hn_clip(f["image"], f["text"], f["logit_scale"], gamma=0.25)
    tok = filip(f["image_tokens"], f["text_tokens"], f["logit_scale"])
    assert torch.allclose(out["hn"], hn) and torch.allclose(out["tok"], tok)
    assert torch.allclose(out["loss"], hn + 0.7 * tok)


def test_clipin_eq8_remaps_one_loss_onto_short_and_long_captions():
    cfg = load_config(
        None,
        [
            "loss.terms.short={loss: infonce, weight: 1.0, inputs: {text: text_short}}",
            "loss.terms.long={loss: infonce, weight: 0.1, inputs: {text: text_long}}",
            "loss.terms.edits={loss: edit_negatives, weight: 0.1}",
        ],
    )
    objective = build_objective(cfg.loss)
    f = _feats(seed=1)
    out = objective(f)
    short = infonce(f["image"], f["text_short"], f["logit_scale"])
    long = infonce(f["image"], f["text_long"], f["logit_scale"])
    edits = edit_negatives(f["source_image"], f["target_image"], f["source_text"], f["target_text"], f["logit_scale"])
    assert torch.allclose(out["loss"], short + 0.1 * long + 0.1 * edits)
    assert objective.feature_keys == {
        "image", "text_short", "text_long", "source_image", "target_image", "source_text", "target_text",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("term", "key"),
    [
        (TermConfig("hn_clip_typo"), "loss.terms.t.loss"),
        (TermConfig("hn_clip", params={"gama": 0.5}), "loss.terms.t.params.gama"),
        (TermConfig("infonce", inputs={"txt": "text_long"}), "loss.terms.t.inputs.txt"),
    ],
)
def test_bad_terms_name_the_key(term, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build_objective(LossConfig(terms={"t": term}))


def test_missing_feature_names_the_term_and_the_key():
    objective = build_objective(LossConfig(terms={"long": TermConfig("infonce", inputs={"text": "text_long"})}))
    f = _feats()
    del f["text_long"]
    with pytest.raises(KeyError, match=r"'long'.*text_long"):
        objective(f)


def test_optional_inputs_are_used_when_present():
    objective = build_objective(LossConfig(terms={"t": TermConfig("hn_clip")}))
    f = _feats(seed=2)
    frozen = {**f, "reference_text": f["text_short"]}
    expected = hn_clip(f["image"], f["text"], 2.0, reference_text=f["text_short"])
    assert torch.allclose(objective(frozen)["loss"], expected)
    assert not torch.allclose(objective(frozen)["loss"], objective(f)["loss"])
