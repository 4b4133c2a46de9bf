"""Hand-computed small cases for every registered loss (values worked out with pen, paper and math.log)."""

from __future__ import annotations

import math

import pytest
import torch

from sharpclip.losses import distill_cosine, edit_negatives, filip, hn_clip, infonce, registry, sigmoid

LOG1 = torch.tensor(0.0)  # logit_scale = ln 1, so logits are the raw cosines


def _t(rows):
    return torch.tensor(rows, dtype=torch.float64)


def _lse(*xs: float) -> float:
    return math.log(sum(math.exp(x) for x in xs))


def test_every_paper_objective_is_registered():
    assert set(registry.names()) >= {"infonce", "hn_clip", "filip", "edit_negatives", "distill_cosine", "sigmoid"}


def test_infonce_2x2_orthogonal_pairs():
    # S = I: each row is [1, 0] -> CE = log(e + 1) - 1, the same in both directions
    img = txt = _t([[1, 0], [0, 1]])
    expected = math.log(math.e + 1) - 1
    assert infonce(img, txt, LOG1).item() == pytest.approx(expected, abs=1e-12)


def test_infonce_scale_and_bias():
    img = _t([[1, 0], [0, 1]])
    txt = _t([[0.6, 0.8], [0, 1]])
    # S = [[0.6, 0], [0.8, 1]] ; s = 2, b = -1 -> logits = [[0.2, -1], [0.6, 1]]
    rows = (_lse(0.2, -1) - 0.2) + (_lse(0.6, 1) - 1)
    cols = (_lse(0.2, 0.6) - 0.2) + (_lse(-1, 1) - 1)
    expected = 0.5 * (rows / 2 + cols / 2)
    got = infonce(img, txt, torch.tensor(math.log(2.0)), torch.tensor(-1.0))
    assert got.item() == pytest.approx(expected, abs=1e-12)


def test_hn_clip_2x2_margin_from_caption_similarity():
    # captions t0, t1 with cosine 0.8; images equal to their captions
    t = _t([[1, 0], [0.8, 0.6]])
    # S = T T^T = [[1, .8], [.8, 1]], G-bar = [[0, .8], [.8, 0]], gamma = .5 -> logits [[1, 1.2], [1.2, 1]]
    expected = _lse(1, 1.2) - 1  # every row and column alike
    assert hn_clip(t, t, LOG1, gamma=0.5).item() == pytest.approx(expected, abs=1e-12)


def test_hn_clip_3x3_with_frozen_reference_and_duplicates():
    img = txt = _t([[1, 0], [0, 1], [0.6, 0.8]])
    ref = _t([[1, 0], [1, 0], [0, 1]])  # reference captions 0 and 1 are identical: a duplicate pair
    # G-bar(ref) = [[0,1,0],[1,0,0],[0,0,0]]; S = [[1,0,.6],[0,1,.8],[.6,.8,1]]
    # with duplicate_threshold .99 entries (0,1) and (1,0) leave the softmax; the boost is 0 elsewhere
    row0 = _lse(1, 0.6) - 1
    row1 = _lse(1, 0.8) - 1
    row2 = _lse(0.6, 0.8, 1) - 1
    expected = (row0 + row1 + row2) / 3  # S symmetric, so columns equal rows
    got = hn_clip(img, txt, LOG1, reference_text=ref, gamma=0.5, duplicate_threshold=0.99)
    assert got.item() == pytest.approx(expected, abs=1e-12)
    # without the threshold the same pair is boosted by gamma * 1 instead
    row0b, row1b = _lse(1, 0.5, 0.6) - 1, _lse(0.5, 1, 0.8) - 1
    got_boost = hn_clip(img, txt, LOG1, reference_text=ref, gamma=0.5)
    assert got_boost.item() == pytest.approx((row0b + row1b + row2) / 3, abs=1e-12)


def test_filip_2x2_directions_differ():
    # image 0: patches e0, e1; image 1: patches e1, -e0 ; text 0: tokens e0 (+ pad); text 1: tokens e1, -e1
    e0, e1 = [1.0, 0.0], [0.0, 1.0]
    img_tok = _t([[e0, e1], [e1, [-1.0, 0.0]]])
    txt_tok = _t([[e0, [9.0, 9.0]], [e1, [0.0, -1.0]]])
    txt_mask = torch.tensor([[True, False], [True, True]])
    # s^I (patch -> best word, mean over patches): i0t0 (1+0)/2=.5, i0t1 (0+1)/2=.5, i1t0 (0-1)/2=-.5, i1t1 (1+0)/2=.5
    # s^T (word -> best patch, mean over words):   i0t0 1,         i0t1 (1+0)/2=.5, i1t0 0,          i1t1 (1+0)/2=.5
    i2t = (_lse(0.5, 0.5) - 0.5 + _lse(-0.5, 0.5) - 0.5) / 2
    t2i = (_lse(1, 0) - 1 + _lse(0.5, 0.5) - 0.5) / 2
    got = filip(img_tok, txt_tok, LOG1, text_token_mask=txt_mask)
    assert got.item() == pytest.approx((i2t + t2i) / 2, abs=1e-12)


def test_edit_negatives_2_pairs():
    src_img = _t([[1, 0], [0, 1]])
    tgt_img = _t([[0.8, 0.6], [0.6, 0.8]])
    src_txt = src_img.clone()
    tgt_txt = tgt_img.clone()

    def neg_cl(anchor, pos, neg):
        total = 0.0
        for i in range(2):
            cols = [float(anchor[i] @ pos[k]) for k in range(2)] + [float(anchor[i] @ neg[m]) for m in range(2)]
            total += _lse(*cols) - cols[i]
        return total / 2

    expected = (
        neg_cl(src_img, src_txt, tgt_txt)
        + neg_cl(tgt_img, tgt_txt, src_txt)
        + neg_cl(src_txt, src_img, tgt_img)
        + neg_cl(tgt_txt, tgt_img, src_img)
    )
    # spot-check one hand value: anchor I^s_0 = e0 against [e0, e1 | (.8,.6), (.6,.8)] -> lse(1,0,.8,.6) - 1
    assert neg_cl(src_img, src_txt, tgt_txt) == pytest.approx(
        ((_lse(1, 0, 0.8, 0.6) - 1) + (_lse(0, 1, 0.6, 0.8) - 1)) / 2
    )
    assert edit_negatives(src_img, tgt_img, src_txt, tgt_txt, LOG1).item() == pytest.approx(expected, abs=1e-12)


def test_distill_cosine_hand_case():
    teacher = _t([[1, 0], [0, 2]])
    student = _t([[1, 1], [0, -3]])  # cosines: 1/sqrt(2) and -1
    expected = 1 - (1 / math.sqrt(2) - 1) / 2
    assert distill_cosine(teacher, student).item() == pytest.approx(expected, abs=1e-12)


def test_sigmoid_2x2_with_bias_and_margin():
    t = _t([[1, 0], [0.8, 0.6]])  # S = [[1, .8], [.8, 1]]
    bias = torch.tensor(-1.0)

    def nls(x):  # -log sigmoid(x)
        return math.log1p(math.exp(-x))

    # positives: 1 - 1 = 0 ; negatives: -(0.8 - 1) = 0.2 ; loss = (2*nls(0) + 2*nls(0.2)) / B
    assert sigmoid(t, t, LOG1, bias).item() == pytest.approx((2 * nls(0) + 2 * nls(0.2)) / 2, abs=1e-12)
    # margin gamma=.5 raises negatives to 0.8 + 0.4 - 1 = 0.2 -> -(0.2) ; positives untouched
    got = sigmoid(t, t, LOG1, bias, gamma=0.5)
    assert got.item() == pytest.approx((2 * nls(0) + 2 * nls(-0.2)) / 2, abs=1e-12)
