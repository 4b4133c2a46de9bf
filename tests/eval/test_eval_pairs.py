"""Pair-choice scorers (eval/pairs.py) against hand-computed cases."""

from __future__ import annotations

import pytest
import torch

from sharpclip.eval.pairs import (
    ARO_EXCLUDED_RELATIONS,
    aro_attribution_scores,
    aro_relation_scores,
    mmvp_categories_by_position,
    mmvp_ground_truth,
    mmvp_pair_correct,
    mmvp_scores,
    sugarcrepe_scores,
    winoground_scores,
)


def test_mmvp_both_statements_must_be_right_and_ties_go_to_image_two() -> None:
    s = torch.tensor(
        [
            [[0.9, 0.1], [0.2, 0.8]],  # both right
            [[0.9, 0.1], [0.9, 0.1]],  # second statement wrong: pair fails
            [[0.5, 0.5], [0.1, 0.9]],  # tie -> image 2 -> statement 1 wrong
            [[0.3, 0.4], [0.5, 0.5]],  # statement 1 wrong; statement 2 tie -> image 2 (right) but pair fails
        ]
    )
    assert mmvp_pair_correct(s).tolist() == [True, False, False, False]
    out = mmvp_scores(s, ["A", "A", "B", "B"])
    assert out["per_pattern"] == {"A": 50.0, "B": 0.0}
    assert out["mean"] == 25.0


def test_mmvp_ground_truth_from_qid_parity() -> None:
    assert mmvp_ground_truth([(1, 2), (4, 3)]).tolist() == [[0, 1], [1, 0]]
    s = torch.tensor([[[0.1, 0.9], [0.8, 0.2]]])  # statement of qid 4 picks image 2, of qid 3 picks image 1
    assert mmvp_pair_correct(s, mmvp_ground_truth([(4, 3)])).tolist() == [True]


def test_mmvp_categories_follow_csv_position() -> None:
    cats = mmvp_categories_by_position(135)
    assert cats[0] == cats[14] == "Orientation and Direction" and cats[15] == "Presence of Specific Features"
    assert cats[134] == "Viewpoint and Perspective"
    with pytest.raises(ValueError):
        mmvp_categories_by_position(136)


def test_winoground_text_image_group() -> None:
    s = torch.tensor(
        [
            [[0.9, 0.1], [0.2, 0.8]],  # all three right
            [[0.9, 0.8], [0.95, 0.7]],  # text: 0.9>0.95 no. image: 0.9>0.8 and 0.7>0.95 no
            [[0.6, 0.5], [0.4, 0.7]],  # text: .6>.4 & .7>.5 yes; image: .6>.5 & .7>.4 yes
            [[0.6, 0.2], [0.5, 0.3]],  # text: .6>.5 & .3>.2 yes; image: .6>.2 & .3>.5 no
        ]
    )
    out = winoground_scores(s)
    assert out == {"text": 75.0, "image": 50.0, "group": 50.0, "examples": 4}


def test_sugarcrepe_strict_per_subset() -> None:
    pos = torch.tensor([0.5, 0.4, 0.3, 0.9])
    neg = torch.tensor([0.4, 0.4, 0.6, 0.1])  # tie counts as wrong
    assert sugarcrepe_scores(pos, neg, ["add_att", "add_att", "swap_obj", "swap_obj"]) == {
        "add_att": 50.0,
        "swap_obj": 50.0,
    }


def test_aro_relation_macro_excludes_listed_relations() -> None:
    assert "next to" in ARO_EXCLUDED_RELATIONS and "on" not in ARO_EXCLUDED_RELATIONS
    assert len(ARO_EXCLUDED_RELATIONS) == 157
    scores = torch.tensor([[0.1, 0.9], [0.9, 0.1], [0.5, 0.5], [0.2, 0.3], [0.1, 0.8]])
    rel = ["on", "on", "in", "in", "next to"]  # "next to" is excluded; a tie picks the false caption
    out = aro_relation_scores(scores, rel)
    assert out["per_relation"] == {"on": 50.0, "in": 50.0}
    assert out["macro"] == 50.0 and out["micro"] == pytest.approx(60.0)


def test_aro_attribution_keeps_pairs_with_25_items() -> None:
    good = torch.tensor([[0.0, 1.0]])
    bad = torch.tensor([[1.0, 0.0]])
    scores = torch.cat([good.repeat(20, 1), bad.repeat(5, 1), bad.repeat(25, 1), good.repeat(3, 1)])
    attrs = [("white", "black")] * 25 + [("red", "wooden")] * 25 + [("small", "big")] * 3
    out = aro_attribution_scores(scores, attrs)
    assert out["per_attribute_pair"] == {"white_black": 80.0, "red_wooden": 0.0}
    assert out["macro"] == 40.0
    with pytest.raises(ValueError, match="25"):
        aro_attribution_scores(good.repeat(3, 1), [("a", "b")] * 3)
