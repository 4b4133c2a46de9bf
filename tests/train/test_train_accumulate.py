"""Exact cached-gradient accumulation: 8 micro-batches of 16 give the gradients of one batch of 128."""

from __future__ import annotations

import re

import pytest
import torch

from _support.tiny_towers import OBJECTIVES, TinyTowers, make_batch, objective, split_batch
from sharpclip.train.accumulate import cached_gradient_step, concat_features


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_grads(expected, got):
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.allclose(expected[key], got[key], atol=1e-6, rtol=0), key


def _full_batch_grads(model, objective_fn, batch, seed):
    model.zero_grad()
    torch.manual_seed(seed)
    terms = objective_fn({**model.encode(batch), **model.model_inputs()})
    terms["loss"].backward()
    return terms["loss"].detach(), _grads(model)


def _cached_grads(model, objective_fn, batch, seed, micro=16):
    model.zero_grad()
    torch.manual_seed(seed)
    terms = cached_gradient_step(
        model.encode, split_batch(batch, micro), lambda f: objective_fn({**f, **model.model_inputs()})
    )
    return terms["loss"], _grads(model)


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_cached_accumulation_equals_full_batch(name):
    model = TinyTowers(dropout=0.0)
    batch = make_batch(128, seed=1)
    loss_full, grads_full = _full_batch_grads(model, objective(name), batch, seed=0)
    loss_acc, grads_acc = _cached_grads(model, objective(name), batch, seed=0)
    assert torch.allclose(loss_full, loss_acc, atol=1e-10)
    _assert_same_grads(grads_full, grads_acc)


def test_logit_scale_gradient_is_counted_once():
    model = TinyTowers(dropout=0.0)
    batch = make_batch(128, seed=2)
    _, full = _full_batch_grads(model, objective("hn_clip"), batch, seed=0)
    _, acc = _cached_grads(model, objective("hn_clip"), batch, seed=0)
    assert full["logit_scale"].abs() > 1e-3  # a real gradient, so a k-fold error could not hide
    assert torch.allclose(full["logit_scale"], acc["logit_scale"], atol=1e-9)


def test_dropout_model_matches_with_rng_replay():
    """With dropout on, the full-batch reference uses the masks the micro-batches drew: replay makes them agree."""
    model = TinyTowers(dropout=0.3)
    batch = make_batch(128, seed=3)
    micro = split_batch(batch, 16)
    obj = objective("hnclip_eq3")
    # reference: the same micro-batch encodes (same RNG sequence), one loss over the concatenation, one backward
    model.zero_grad()
    torch.manual_seed(5)
    feats = concat_features([model.encode(mb) for mb in micro])
    ref_loss = obj({**feats, **model.model_inputs()})["loss"]
    ref_loss.backward()
    ref = _grads(model)
    loss, acc = _cached_grads(model, obj, batch, seed=5)
    assert torch.allclose(ref_loss.detach(), loss, atol=1e-10)
    _assert_same_grads(ref, acc)


def test_without_replay_dropout_would_not_match():
    """The RNG replay is load-bearing: re-drawing dropout in the replay gives different gradients."""
    model = TinyTowers(dropout=0.3)
    batch = make_batch(64, seed=4)
    _, with_replay = _cached_grads(model, objective("infonce"), batch, seed=7)

    from sharpclip.train import accumulate

    original = accumulate.RngState.replay
    try:
        accumulate.RngState.replay = lambda self: torch.random.fork_rng(devices=[])  # no state restored
        _, without = _cached_grads(model, objective("infonce"), batch, seed=7)
    finally:
        accumulate.RngState.replay = original
    assert not torch.allclose(with_replay["patch.weight"], without["patch.weight"], atol=1e-6)


def test_per_micro_batch_is_the_mean_of_small_losses():
    """Ordinary accumulation (train.step.micro_batch_pass): each micro-batch its own loss, their mean the step's."""
    from _support.tiny_run import ToyLoader, toy_model
    from sharpclip.config import LossConfig, TermConfig
    from sharpclip.train.features import FeatureEncoder, build_objective
    from sharpclip.train.step import objective_inputs, run_step, split_rows

    model = toy_model()
    batch = next(iter(ToyLoader(model.tokenizer, n=16, batch_size=16)))
    obj = build_objective(LossConfig(terms={"c": TermConfig("infonce")}))
    encoder = FeatureEncoder(model, obj.feature_keys)
    micro = split_rows(batch, 4)
    model.zero_grad()
    result = run_step(encoder, obj, batch, 4, "per_micro_batch").read()
    per_micro = model.hf_model.text_projection.weight.grad.clone()
    with torch.no_grad():
        expected = sum(float(obj(objective_inputs(encoder, encoder(mb), mb))["loss"]) for mb in micro) / 4
    assert result.terms["loss"] == pytest.approx(expected, rel=1e-6)
    model.zero_grad()
    run_step(encoder, obj, batch, 16, "exact")  # one matrix of 16
    # a different objective (4 negatives, not 16), so the gradients must differ from the full batch's
    assert not torch.allclose(model.hf_model.text_projection.weight.grad, per_micro, atol=1e-6)


@pytest.mark.parametrize("terms", [{"c": "infonce"}, {"hn": "hn_clip", "tok": "filip"}])
def test_encoding_several_micro_batches_a_pass_changes_nothing_but_speed(terms):
    """train.encode_batch_size: micro-batches of 4 encoded 8 or 16 rows a pass keep their own matrices, so the loss,
    the monitor and every gradient equal one pass per micro-batch."""
    from _support.tiny_run import ToyLoader, toy_model
    from sharpclip.config import LossConfig, TermConfig
    from sharpclip.train.features import FeatureEncoder, build_objective
    from sharpclip.train.step import run_step

    model = toy_model()
    batch = next(iter(ToyLoader(model.tokenizer, n=16, batch_size=16)))
    obj = build_objective(LossConfig(terms={k: TermConfig(v) for k, v in terms.items()}))
    encoder = FeatureEncoder(model, obj.feature_keys)
    runs = {}
    for encode in (0, 8, 16):
        model.zero_grad()
        result = run_step(encoder, obj, batch, 4, "per_micro_batch", encode_batch_size=encode).read()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        runs[encode] = result, grads
    base, base_grads = runs[0]
    assert base.monitor["matrices_monitor"] == 4
    for encode in (8, 16):
        result, grads = runs[encode]
        assert result.terms == pytest.approx(base.terms, rel=1e-5)
        assert result.monitor == pytest.approx(base.monitor, rel=1e-5)
        assert result.rows == base.rows == 16
        assert grads.keys() == base_grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, base_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    model.zero_grad()
    run_step(encoder, obj, batch, 16, "per_micro_batch")  # one matrix of 16: a different objective, must differ
    assert not torch.allclose(model.hf_model.text_projection.weight.grad, base_grads["backbone.text_projection.weight"])


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ({"encode_batch_size": 32}, "per_micro_batch only"),
        ({"accumulation": "per_micro_batch", "encode_batch_size": 24}, "multiple of train.micro_batch_size (16)"),
        ({"accumulation": "per_micro_batch", "encode_batch_size": 48}, "divides train.batch_size (128)"),
        ({"accumulation": "per_micro_batch", "encode_batch_size": -16}, "train.encode_batch_size"),
    ],
)
def test_encode_batch_size_is_checked(values, says):
    from sharpclip.config import ConfigError, TrainConfig

    with pytest.raises(ConfigError, match=re.escape(says)):
        TrainConfig(batch_size=128, micro_batch_size=16, **values)


def test_exact_with_one_micro_batch_skips_the_cache_and_matches_it(monkeypatch):
    """A batch that is one micro-batch is encoded once (no cached replay), with the gradients of the cached path."""
    from _support.tiny_run import ToyLoader, toy_model
    from sharpclip.config import LossConfig, TermConfig
    from sharpclip.train import step
    from sharpclip.train.features import FeatureEncoder, build_objective

    model = toy_model()
    batch = next(iter(ToyLoader(model.tokenizer, n=16, batch_size=16)))
    obj = build_objective(LossConfig(terms={"hn": TermConfig("hn_clip")}))
    encoder = FeatureEncoder(model, obj.feature_keys)
    model.zero_grad()
    cached = step.run_step(encoder, obj, batch, 4, "exact").read()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    built = []
    monkeypatch.setattr(step, "CachedFeatures", lambda *a: built.append(a) or pytest.fail("cached"))
    model.zero_grad()
    whole = step.run_step(encoder, obj, batch, 16, "exact").read()
    assert not built
    assert whole.terms == pytest.approx(cached.terms, rel=1e-5) and whole.rows == cached.rows == 16
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)
