"""The composed objective: weighted named terms, input remapping against the feature table, typed
hyperparameters, and config errors that name the key."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from sharpclip.config import ConfigError, LossConfig, TermConfig, load_config
from sharpclip.losses import build_objective as build_terms
from sharpclip.losses import edit_negatives, filip, hn_clip, infonce
from sharpclip.train.features import build_objective


def _feats(b=6, d=5, seed=0):
    g = torch.Generator().manual_seed(seed)

    def unit(*shape):
        return F.normalize(torch.randn(*shape, generator=g, dtype=torch.float64), dim=-1)

    return {
        "image": unit(b, d),
        "text": unit(b, d),
        "text_short": unit(b, d),
        "text_frozen": unit(b, d),
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
            "loss.terms.long={loss: infonce, weight: 0.1}",
            "loss.terms.edits={loss: edit_negatives, weight: 0.1}",
        ],
    )
    objective = build_objective(cfg.loss)
    f = _feats(seed=1)
    out = objective(f)
    short = infonce(f["image"], f["text_short"], f["logit_scale"])
    long = infonce(f["image"], f["text"], f["logit_scale"])  # the training caption is the long one
    edits = edit_negatives(f["source_image"], f["target_image"], f["source_text"], f["target_text"], f["logit_scale"])
    assert torch.allclose(out["loss"], short + 0.1 * long + 0.1 * edits)
    # image, text and logit_scale are read by the saturation monitor too; each term's local-loss slice is that of
    # its inputs' rows (batch rows for the captions, edit rows for the edit pairs)
    assert objective.feature_keys == {
        "image", "text", "text_short", "source_image", "target_image", "source_text", "target_text", "logit_scale",
        "logit_bias", "rows", "edit_rows",
    }  # fmt: skip
    assert {t.name: t.inputs["rows"] for t in objective.terms if "rows" in t.inputs} == {
        "short": "rows", "long": "rows", "edits": "edit_rows"
    }  # fmt: skip


@pytest.mark.parametrize(
    ("term", "key"),
    [
        (TermConfig("hn_clip_typo"), "loss.terms.t.loss"),
        (TermConfig("hn_clip", params={"gama": 0.5}), "loss.terms.t.params.gama"),
        (TermConfig("infonce", inputs={"txt": "text_short"}), "loss.terms.t.inputs.txt"),
    ],
)
def test_bad_terms_name_the_key(term, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build_objective(LossConfig(terms={"t": term}))


def test_missing_feature_names_the_term_and_the_key():
    objective = build_objective(LossConfig(terms={"short": TermConfig("infonce", inputs={"text": "text_short"})}))
    f = _feats()
    del f["text_short"]
    with pytest.raises(KeyError, match=r"'short'.*text_short"):
        objective(f)


def test_a_remapped_optional_input_is_used_and_an_unmapped_one_keeps_its_default():
    frozen = build_objective(LossConfig(terms={"t": TermConfig("hn_clip", inputs={"reference_text": "text_frozen"})}))
    recomputed = build_objective(LossConfig(terms={"t": TermConfig("hn_clip")}))
    f = _feats(seed=2)
    expected = hn_clip(f["image"], f["text"], 2.0, reference_text=f["text_frozen"])
    assert torch.allclose(frozen(f)["loss"], expected)
    assert torch.allclose(recomputed(f)["loss"], hn_clip(f["image"], f["text"], 2.0))
    assert "reference_text" not in recomputed.terms[0].inputs  # no feature of that name: Ḡ from `text`
    del f["text_frozen"]  # a remapped optional input is never dropped in silence
    with pytest.raises(KeyError, match=r"needs feature 'text_frozen' for its argument 'reference_text'"):
        frozen(f)


@pytest.mark.parametrize(
    ("inputs", "key"),
    [
        ({"reference_text": "text_frozn"}, "loss.terms.hn.inputs.reference_text"),  # HN-CLIP Table 3c, one typo
        ({"text": "text_long"}, "loss.terms.hn.inputs.text"),  # no such feature: the long caption is `text`
    ],
)
def test_an_input_naming_no_feature_is_an_error_listing_the_features(inputs, key):
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: '.*' is no feature; the features are: "
                                          r"image, image_tokens, .*text_frozen"):  # fmt: skip
        build_objective(LossConfig(terms={"hn": TermConfig("hn_clip", inputs=inputs)}))


def test_a_required_input_no_feature_produces_is_an_error():
    with pytest.raises(ConfigError, match=r"^loss\.terms\.t\.inputs\.image: 'infonce' reads 'image', which is no "
                                          r"feature; the features are: text"):  # fmt: skip
        build_terms(LossConfig(terms={"t": TermConfig("infonce")}), ["text", "logit_scale"])


@pytest.mark.parametrize(
    ("params", "key", "expected"),
    [
        ({"gamma": "high"}, "loss.terms.hn.params.gamma", "float"),
        ({"gamma": True}, "loss.terms.hn.params.gamma", "float"),
        ({"duplicate_threshold": "x"}, "loss.terms.hn.params.duplicate_threshold", "float or None"),
    ],
)
def test_a_parameter_of_the_wrong_type_is_an_error_naming_the_key(params, key, expected):
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: expected {expected}, got "):
        build_objective(LossConfig(terms={"hn": TermConfig("hn_clip", params=params)}))


def test_gamma_high_from_the_command_line_fails_before_any_step_naming_the_key():
    cfg = load_config(None, ["loss.terms.hn={loss: hn_clip, params: {gamma: high}}"])
    with pytest.raises(ConfigError, match=r"^loss\.terms\.hn\.params\.gamma: expected float, got 'high' \(str\)"):
        build_objective(cfg.loss)


def test_parameters_of_the_right_type_pass_an_int_where_a_float_is_wanted_becomes_one():
    objective = build_objective(LossConfig(terms={"hn": TermConfig("hn_clip", params={"gamma": 1}),
                                                  "tok": TermConfig("filip", params={"chunk_size": 4})}))  # fmt: skip
    assert objective.terms[0].params == {"gamma": 1.0} and isinstance(objective.terms[0].params["gamma"], float)
    assert objective.terms[1].params == {"chunk_size": 4}
    with pytest.raises(ConfigError, match=r"^loss\.terms\.tok\.params\.chunk_size: expected int, got 2\.5"):
        build_objective(LossConfig(terms={"tok": TermConfig("filip", params={"chunk_size": 2.5})}))


def test_unknown_parameter_lists_the_ones_the_loss_takes():
    with pytest.raises(ConfigError, match=r"^loss\.terms\.t\.params\.gama: 'hn_clip' has no such parameter; it "
                                          r"takes: gamma, duplicate_threshold"):  # fmt: skip
        build_objective(LossConfig(terms={"t": TermConfig("hn_clip", params={"gama": 0.5})}))


def test_the_saturation_monitor_is_a_weight_zero_term_outside_the_loss():
    objective = build_objective(LossConfig(terms={"c": TermConfig("infonce")}))
    f = _feats(seed=3)
    out = objective(f)
    assert set(out) == {"c", "loss"} and torch.allclose(out["loss"], infonce(f["image"], f["text"], 2.0))
    monitor = objective.diagnose(f)
    assert monitor["infonce"] == pytest.approx(float(out["c"]))  # the mean per-row InfoNCE is the batch's InfoNCE
    assert 0.0 <= monitor["rows_saturated"] <= 1.0
    assert [t.weight for t in objective.terms if t.diagnostic] == [0.0]
    assert repr(objective) == "1·c[infonce]"


def test_gamma_of_the_diagnostics_is_the_configured_hn_term_s():
    objective = build_objective(LossConfig(terms={"hn": TermConfig("hn_clip", params={"gamma": 0.25})}))
    assert objective.param_of("hn_clip", "gamma") == 0.25
    assert build_objective(LossConfig(terms={"c": TermConfig("infonce")})).param_of("hn_clip", "gamma") == 0.5


@pytest.mark.parametrize(
    ("override", "key"),
    [("loss.terms.hn.weight=-1", "loss.terms.hn.weight"), ("loss.terms.hn.weight=nan", "loss.terms.hn.weight"),
     ("loss.terms.hn.weight=inf", "loss.terms.hn.weight"),
     ("loss.terms.hn.params.gamma=-1", "loss.terms.hn.params.gamma"),
     ("loss.terms.sig.params.gamma=-0.5", "loss.terms.sig.params.gamma")],
)  # fmt: skip
def test_a_negative_or_non_finite_weight_or_gamma_is_refused_naming_the_key(override, key):
    terms = "loss.terms={hn: {loss: hn_clip}, sig: {loss: sigmoid}}"
    cfg = load_config(None, [terms, override])
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: must be a finite number >= 0, got "):
        build_objective(cfg.loss)
    with pytest.raises(ConfigError, match=re.escape(key)):  # in Python too, where float('nan') needs no parsing
        value = float(override.split("=")[1])
        build_terms_with(key, value)


def build_terms_with(key: str, value: float) -> None:
    name = key.split(".")[2]
    term = TermConfig("sigmoid" if name == "sig" else "hn_clip")
    if key.endswith("weight"):
        term.weight = value
    else:
        term.params = {"gamma": value}
    build_objective(LossConfig(terms={name: term}))


@pytest.mark.parametrize("weight, params", [(float("nan"), {}), (-1.0, {}), (1.0, {"gamma": float("inf")})])
def test_a_term_built_by_hand_checks_its_weight_and_parameters(weight, params):
    from sharpclip.losses import Term, registry

    with pytest.raises(ValueError, match=r"^Term 'hn': (weight|gamma)=.* must be a finite number >= 0"):
        Term("hn", registry.get("hn_clip"), weight, params, {})


def test_a_registered_loss_may_take_bool_and_str_hyperparameters(monkeypatch):
    from sharpclip.losses import registry

    def switched(image, text, logit_scale, *, symmetric: bool = True, mode: str = "mean", gamma: float = 0.5):
        return infonce(image, text, logit_scale) * (2.0 if symmetric else 1.0) * (1.0 if mode == "mean" else 3.0)

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # the registration ends with the test
    registry.register("switched_test")(switched)
    params = {"symmetric": False, "mode": "sum", "gamma": 0.25}
    objective = build_objective(LossConfig(terms={"s": TermConfig("switched_test", params=params)}))
    feats = _feats()
    expected = 3.0 * infonce(feats["image"], feats["text"], feats["logit_scale"])
    assert torch.allclose(objective(feats)["loss"], expected)
    with pytest.raises(ConfigError, match=r"^loss\.terms\.s\.params\.symmetric: expected bool, got 'yes'"):
        build_objective(LossConfig(terms={"s": TermConfig("switched_test", params={"symmetric": "yes"})}))
    with pytest.raises(ConfigError, match=r"^loss\.terms\.s\.params\.gamma: must be a finite number >= 0"):
        build_objective(LossConfig(terms={"s": TermConfig("switched_test", params={"gamma": -1.0})}))
