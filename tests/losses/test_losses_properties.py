"""Properties of the losses: parity with references written from the formulas, invariances, the stop-gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sharpclip.losses import edit_negatives, filip, hn_clip, infonce, registry, sigmoid, token_similarities
from sharpclip.train.features import FEATURES


def _unit(*shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(*shape, generator=g, dtype=dtype), dim=-1)


def _reference_hn(img, txt, logit_scale, gamma):
    """HN-CLIP eq. 2 written out per row with explicit log-sum-exp, Ḡ as a constant tensor."""
    s = logit_scale.exp()
    g = (txt @ txt.t()).detach().clone()
    b = img.shape[0]
    total = 0.0
    for i in range(b):
        row = torch.stack([s * (img[i] @ txt[j] + (gamma * g[i, j] if j != i else 0.0)) for j in range(b)])
        col = torch.stack([s * (img[j] @ txt[i] + (gamma * g[j, i] if j != i else 0.0)) for j in range(b)])
        total = total + (torch.logsumexp(row, 0) - row[i]) + (torch.logsumexp(col, 0) - col[i])
    return total / (2 * b)


@pytest.mark.parametrize(("b", "d", "gamma"), [(2, 3, 0.5), (5, 8, 0.25), (9, 4, 1.0), (16, 32, 0.75)])
def test_hn_clip_matches_reference(b, d, gamma):
    img, txt = _unit(b, d, seed=b), _unit(b, d, seed=b + 100)
    scale = torch.tensor(2.3, dtype=torch.float64)
    assert hn_clip(img, txt, scale, gamma=gamma).item() == pytest.approx(
        _reference_hn(img, txt, scale, gamma).item(), abs=1e-10
    )


def test_hn_clip_gamma_zero_is_infonce():
    img, txt = _unit(12, 16, seed=1), _unit(12, 16, seed=2)
    scale = torch.tensor(3.0, dtype=torch.float64)
    assert torch.allclose(hn_clip(img, txt, scale, gamma=0.0), infonce(img, txt, scale), atol=1e-12)


@pytest.mark.parametrize("path", ["fused", "reference", "threshold"])
def test_no_gradient_reaches_the_margin(path):
    """The gradient equals InfoNCE's on logits shifted by a constant γḠ: nothing flows back through Ḡ."""
    img = _unit(8, 6, seed=3).requires_grad_()
    txt = _unit(8, 6, seed=4).requires_grad_()
    scale = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    kwargs = {"gamma": 0.7}
    if path == "reference":
        kwargs["reference_text"] = txt  # the same tensor, with grad: still must not be differentiated through
    if path == "threshold":
        kwargs["duplicate_threshold"] = 2.0  # never reached, but takes the materialised path
    grads = torch.autograd.grad(hn_clip(img, txt, scale, **kwargs), (img, txt, scale))

    constant = (txt @ txt.t()).detach().fill_diagonal_(0.0)
    logits = scale.exp() * (img @ txt.t() + 0.7 * constant)
    labels = torch.arange(8)
    expected = 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels))
    expected_grads = torch.autograd.grad(expected, (img, txt, scale))
    for got, want in zip(grads, expected_grads, strict=True):
        assert torch.allclose(got, want, atol=1e-12)


def test_fused_boost_equals_materialised_margin():
    img, txt = _unit(10, 7, seed=5), _unit(10, 7, seed=6)
    scale = torch.tensor(1.5, dtype=torch.float64)
    fused = hn_clip(img, txt, scale, gamma=0.5)
    materialised = hn_clip(img, txt, scale, reference_text=txt, gamma=0.5)
    assert torch.allclose(fused, materialised, atol=1e-12)


SIZES = {"D": 6, "P": 5, "L": 4}  # the feature table's axes; B and E (edit pairs) are the batch


def _inputs(b, seed=0):
    """One tensor per feature of the feature table, of its declared shape, for a batch of b (and b edit pairs),
    plus the model's scale and bias."""
    feats = {}
    for k, feature in enumerate(f for f in FEATURES.values() if f.kind in ("row", "edit")):
        dims = [b if d in ("B", "E") else SIZES[d] for d in feature.dims]
        if feature.mask:  # real tokens first, then padding
            feats[feature.name] = torch.arange(dims[1])[None, :] < torch.randint(1, dims[1] + 1, (b, 1))
        else:
            feats[feature.name] = _unit(*dims, seed=seed + k)
    f64 = torch.float64
    model = {"logit_scale": torch.tensor(2.5, dtype=f64), "logit_bias": torch.tensor(-1.0, dtype=f64)}
    return feats, model


def _call(name, feats, model, **params):
    spec = registry.get(name)
    args = {k: v for k, v in {**feats, **model}.items() if k in spec.inputs + spec.optional_inputs}
    return spec.fn(**args, **params)


@pytest.mark.parametrize("name", registry.names())
def test_permuting_the_batch_leaves_every_loss_unchanged(name):
    feats, model = _inputs(7)
    perm = torch.randperm(7, generator=torch.Generator().manual_seed(0))
    permuted = {k: v[perm] for k, v in feats.items()}
    assert torch.allclose(_call(name, feats, model), _call(name, permuted, model), atol=1e-12)


@pytest.mark.parametrize("name", registry.names())
def test_every_loss_is_finite_and_differentiable(name):
    feats, model = _inputs(5, seed=11)
    feats = {k: v.requires_grad_() if v.is_floating_point() else v for k, v in feats.items()}
    loss = _call(name, feats, model)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    assert any(v.grad is not None and v.grad.abs().sum() > 0 for v in feats.values() if v.is_floating_point())


def test_filip_padding_tokens_do_not_change_the_loss():
    feats, model = _inputs(6, seed=20)
    base = filip(feats["image_tokens"], feats["text_tokens"], model["logit_scale"], None, feats["text_token_mask"])
    # append 3 padding tokens with large random values to every caption, and 2 masked-out patches to every image
    g = torch.Generator().manual_seed(1)
    txt = torch.cat([feats["text_tokens"], 50 * torch.randn(6, 3, 6, generator=g, dtype=torch.float64)], dim=1)
    txt_mask = torch.cat([feats["text_token_mask"], torch.zeros(6, 3, dtype=torch.bool)], dim=1)
    img = torch.cat([feats["image_tokens"], 50 * torch.randn(6, 2, 6, generator=g, dtype=torch.float64)], dim=1)
    img_mask = torch.cat([torch.ones(6, 5, dtype=torch.bool), torch.zeros(6, 2, dtype=torch.bool)], dim=1)
    padded = filip(img, txt, model["logit_scale"], img_mask, txt_mask)
    assert torch.allclose(base, padded, atol=1e-12)


def test_filip_chunking_is_exact():
    feats, _ = _inputs(9, seed=30)
    full = token_similarities(feats["image_tokens"], feats["text_tokens"], None, feats["text_token_mask"], 9)
    chunked = token_similarities(feats["image_tokens"], feats["text_tokens"], None, feats["text_token_mask"], 2)
    for a, b in zip(full, chunked, strict=True):
        assert torch.allclose(a, b, atol=1e-14)


def test_filip_matches_a_loop_reference():
    feats, model = _inputs(4, seed=40)
    it, tt, tm = feats["image_tokens"], feats["text_tokens"], feats["text_token_mask"]
    s_img = torch.zeros(4, 4, dtype=torch.float64)
    s_txt = torch.zeros(4, 4, dtype=torch.float64)
    for i in range(4):
        for j in range(4):
            words = tt[j][tm[j]]
            sim = it[i] @ words.t()  # (P, valid L)
            s_img[i, j] = sim.max(dim=1).values.mean()
            s_txt[i, j] = sim.max(dim=0).values.mean()
    scale, labels = model["logit_scale"].exp(), torch.arange(4)
    expected = 0.5 * (F.cross_entropy(scale * s_img, labels) + F.cross_entropy(scale * s_txt.t(), labels))
    assert torch.allclose(filip(it, tt, model["logit_scale"], None, tm), expected, atol=1e-12)


def test_edit_negatives_swapping_source_and_target_is_symmetric():
    feats, _ = _inputs(5, seed=50)
    a = edit_negatives(feats["source_image"], feats["target_image"], feats["source_text"], feats["target_text"], 2.0)
    b = edit_negatives(feats["target_image"], feats["source_image"], feats["target_text"], feats["source_text"], 2.0)
    assert torch.allclose(a, b, atol=1e-12)


def test_sigmoid_matches_reference_and_margin_only_touches_negatives():
    feats, model = _inputs(6, seed=60)
    img, txt, s, b = feats["image"], feats["text"], model["logit_scale"], model["logit_bias"]
    logits = s.exp() * img @ txt.t() + b
    labels = 2 * torch.eye(6, dtype=torch.float64) - 1
    expected = F.binary_cross_entropy_with_logits(logits, (labels + 1) / 2, reduction="sum") / 6
    assert torch.allclose(sigmoid(img, txt, s, b), expected, atol=1e-12)
    # with the margin, a batch whose captions are all orthogonal gets no boost at all
    eye = torch.eye(6, dtype=torch.float64)
    assert torch.allclose(sigmoid(img, eye, s, b, gamma=0.9), sigmoid(img, eye, s, b), atol=1e-12)


def test_a_logit_scale_above_100_is_used_as_given():
    # SigLIP SO400M's own scale is exp(4.7215) ≈ 112: a loss that cut it to 100 would differ from the reference's
    img, txt = _unit(4, 3, seed=70), _unit(4, 3, seed=71)
    s = torch.tensor(4.7215, dtype=torch.float64)
    logits = s.exp() * img @ txt.t()
    labels = torch.arange(4)
    expected = 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels))
    assert torch.allclose(infonce(img, txt, s), expected, atol=1e-12)
    assert not torch.allclose(infonce(img, txt, s), infonce(img, txt, torch.tensor(100.0, dtype=torch.float64).log()))
