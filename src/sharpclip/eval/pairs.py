"""Pair-choice benchmarks scored exactly as their original scripts (pure functions of similarity scores).

References (the benchmarks' own scripts):

- MMVP-VLM (tsb0601/MMVP `scripts/evaluate_vlm.py`): two images, two statements. For each statement the script takes
  the softmax over the two images of `logits_per_text` and predicts image 1 iff p(image 1) > 0.5, so image 2 wins a
  tie. Since softmax([a, b])[0] > 0.5 ⇔ a > b for any positive logit scale, we compare the similarities directly.
  A pair scores only if **both** statements pick their own image. Accuracy per visual pattern (percent) and the mean
  over patterns (what papers report; the script prints only the per-pattern values).
- Winoground (run_winoground.py): text = s(c0,i0) > s(c1,i0) ∧ s(c1,i1) > s(c0,i1); image = s(c0,i0) > s(c0,i1) ∧
  s(c1,i1) > s(c1,i0); group = text ∧ image. Means over examples, in percent.
- SugarCrepe (`main_eval.py:text_retrieval`): correct iff s(img, positive) > s(img, negative), per subset file;
  reported per subset and per family (replace, swap, add), as the paper's table.
- ARO VG-Relation / VG-Attribution (`dataset_zoo/aro_datasets.py`, notebook "Replicate ARO!"): caption options are
  [false, true]; correct iff argmax == 1 (numpy argmax gives a tie to the false caption). VG-Relation: macro accuracy
  over relations after excluding `ARO_EXCLUDED_RELATIONS`; VG-Attribution: macro accuracy over attribute pairs
  ("a_b") with at least 25 items. The bbox crop is a data step (eval/pair_data.py).
- SPEC (wjpoom/SPEC `spec/models/clip_wrapper.py`, `spec/eval.py`): each sample is one query against its K
  candidates (image→text: one image, K captions; text→image: one caption, K images), scored by cosine; the
  prediction is torch's argmax (a tie goes to the first candidate), right iff it equals the label. Accuracy per
  subset and direction, and per direction the unweighted mean over the subsets (not over items).

Scores are cosine similarities; all accuracies are percentages (the ARO notebook prints fractions).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import Tensor

MMVP_CATEGORIES = (
    "Orientation and Direction",
    "Presence of Specific Features",
    "State and Condition",
    "Quantity and Count",
    "Positional and Relational Context",
    "Color and Appearance",
    "Structural Characteristics",
    "Texts",
    "Viewpoint and Perspective",
)
MMVP_PAIRS_PER_CATEGORY = 15
ARO_MIN_ATTRIBUTE_COUNT = 25
# The relations the ARO authors exclude from VG-Relation's macro accuracy (their replication notebook), as data.
ARO_EXCLUDED_RELATIONS = frozenset(
    [
        "adjusting",
        "attached to",
        "between",
        "bigger than",
        "biting",
        "boarding",
        "brushing",
        "chewing",
        "cleaning",
        "climbing",
        "close to",
        "coming from",
        "coming out of",
        "contain",
        "crossing",
        "dragging",
        "draped over",
        "drinking",
        "drinking from",
        "driving",
        "driving down",
        "driving on",
        "eating from",
        "eating in",
        "enclosing",
        "exiting",
        "facing",
        "filled with",
        "floating in",
        "floating on",
        "flying",
        "flying above",
        "flying in",
        "flying over",
        "flying through",
        "full of",
        "going down",
        "going into",
        "going through",
        "grazing in",
        "growing in",
        "growing on",
        "guiding",
        "hanging from",
        "hanging in",
        "hanging off",
        "hanging over",
        "higher than",
        "holding onto",
        "hugging",
        "in between",
        "jumping off",
        "jumping on",
        "jumping over",
        "kept in",
        "larger than",
        "leading",
        "leaning over",
        "leaving",
        "licking",
        "longer than",
        "looking in",
        "looking into",
        "looking out",
        "looking over",
        "looking through",
        "lying next to",
        "lying on top of",
        "making",
        "mixed with",
        "mounted on",
        "moving",
        "on the back of",
        "on the edge of",
        "on the front of",
        "on the other side of",
        "opening",
        "painted on",
        "parked at",
        "parked beside",
        "parked by",
        "parked in",
        "parked in front of",
        "parked near",
        "parked next to",
        "perched on",
        "petting",
        "piled on",
        "playing",
        "playing in",
        "playing on",
        "playing with",
        "pouring",
        "reaching for",
        "reading",
        "reflected on",
        "riding on",
        "running in",
        "running on",
        "running through",
        "seen through",
        "sitting behind",
        "sitting beside",
        "sitting by",
        "sitting in front of",
        "sitting near",
        "sitting next to",
        "sitting under",
        "skiing down",
        "skiing on",
        "sleeping in",
        "sleeping on",
        "smiling at",
        "sniffing",
        "splashing",
        "sprinkled on",
        "stacked on",
        "standing against",
        "standing around",
        "standing behind",
        "standing beside",
        "standing in front of",
        "standing near",
        "standing next to",
        "staring at",
        "stuck in",
        "surrounding",
        "swimming in",
        "swinging",
        "talking to",
        "topped with",
        "touching",
        "traveling down",
        "traveling on",
        "tying",
        "typing on",
        "underneath",
        "wading in",
        "waiting for",
        "walking across",
        "walking by",
        "walking down",
        "walking next to",
        "walking through",
        "working in",
        "working on",
        "worn on",
        "wrapped around",
        "wrapped in",
        "by",
        "of",
        "near",
        "next to",
        "with",
        "beside",
        "on the side of",
        "around",
    ]
)


def _pct(mask: Tensor) -> float:
    return 100.0 * float(mask.double().mean())


def _by_group(correct: Tensor, groups: Sequence[str]) -> dict[str, float]:
    """Accuracy (percent) per group label, in first-seen order. correct: (N,) bool."""
    if len(groups) != correct.numel():
        raise ValueError(f"{len(groups)} group labels for {correct.numel()} items")
    members: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(groups):
        members[g].append(i)
    return {g: _pct(correct[idx]) for g, idx in members.items()}


def mmvp_ground_truth(qids: Sequence[tuple[int, int]]) -> Tensor:
    """(P, 2): for each statement of a pair, its image (0 = image of qid1, 1 = image of qid2): 0 if qid odd, else 1."""
    return torch.tensor([[0 if q % 2 == 1 else 1 for q in pair] for pair in qids], dtype=torch.long)


def mmvp_categories_by_position(n_pairs: int) -> list[str]:
    """The script's category of pair k: `categories[k // 15]` (CSV order, not the `Type` column)."""
    if n_pairs > len(MMVP_CATEGORIES) * MMVP_PAIRS_PER_CATEGORY:
        raise ValueError(f"MMVP-VLM has at most 135 pairs; got {n_pairs}")
    return [MMVP_CATEGORIES[k // MMVP_PAIRS_PER_CATEGORY] for k in range(n_pairs)]


def mmvp_pair_correct(scores: Tensor, truth: Tensor | None = None) -> Tensor:
    """scores: (P, 2 statements, 2 images). truth: (P, 2) image index per statement (default [[0, 1]]).

    A statement predicts image 0 iff its score for image 0 is strictly higher (a tie goes to image 1, as p > 0.5 does).
    Returns (P,) bool: both statements right.
    """
    if scores.ndim != 3 or scores.shape[1:] != (2, 2):
        raise ValueError(f"MMVP scores must be (P, 2, 2) (pair, statement, image); got {tuple(scores.shape)}")
    if truth is None:
        truth = torch.tensor([[0, 1]]).expand(scores.shape[0], 2)
    pred = torch.where(scores[:, :, 0] > scores[:, :, 1], 0, 1)
    return (pred == truth).all(dim=1)


def mmvp_scores(scores: Tensor, patterns: Sequence[str], truth: Tensor | None = None) -> dict[str, object]:
    """MMVP-VLM: {"per_pattern": {pattern: %}, "mean": mean over patterns, "pairs": P}. Same for SynthDense pairs."""
    per = _by_group(mmvp_pair_correct(scores, truth), patterns)
    return {"per_pattern": per, "mean": sum(per.values()) / len(per), "pairs": int(scores.shape[0])}


def winoground_scores(scores: Tensor) -> dict[str, float]:
    """scores: (N, 2 captions, 2 images), scores[n, c, i] = s(c_c, i_i). Returns text, image, group in percent."""
    if scores.ndim != 3 or scores.shape[1:] != (2, 2):
        raise ValueError(f"Winoground scores must be (N, 2, 2) (example, caption, image); got {tuple(scores.shape)}")
    s = scores
    text = (s[:, 0, 0] > s[:, 1, 0]) & (s[:, 1, 1] > s[:, 0, 1])
    image = (s[:, 0, 0] > s[:, 0, 1]) & (s[:, 1, 1] > s[:, 1, 0])
    return {"text": _pct(text), "image": _pct(image), "group": _pct(text & image), "examples": int(s.shape[0])}


def sugarcrepe_scores(positive: Tensor, negative: Tensor, subsets: Sequence[str]) -> dict[str, float]:
    """positive, negative: (N,) s(img, caption). Accuracy per subset (percent), correct iff positive > negative."""
    if positive.shape != negative.shape or positive.ndim != 1:
        raise ValueError(f"positive and negative must be equal (N,) vectors; got {positive.shape}, {negative.shape}")
    return _by_group(positive > negative, subsets)


SUGARCREPE_FAMILIES = {  # the paper's table: replace-obj/att/rel, swap-obj/att, add-obj/att
    "replace": ("replace_obj", "replace_att", "replace_rel"),
    "swap": ("swap_obj", "swap_att"),
    "add": ("add_obj", "add_att"),
}


def sugarcrepe_report(per_subset: dict[str, float]) -> dict[str, object]:
    """The numbers the SugarCrepe paper reports: accuracy per subset (its 7 files), the average within each family
    present (replace, swap, add: the unweighted mean of its subsets), and `mean_of_subsets`, the unweighted mean of
    every subset present (not a number the paper reports; kept under a name that says what it is)."""
    families = {
        family: sum(per_subset[m] for m in members if m in per_subset) / sum(m in per_subset for m in members)
        for family, members in SUGARCREPE_FAMILIES.items()
        if any(m in per_subset for m in members)
    }
    return {
        "per_subset": dict(per_subset),
        "per_family": families,
        "mean_of_subsets": sum(per_subset.values()) / len(per_subset),
    }


def _aro_correct(scores: Tensor) -> Tensor:
    if scores.ndim != 2 or scores.shape[1] != 2:
        raise ValueError(f"ARO scores must be (N, 2) over [false caption, true caption]; got {tuple(scores.shape)}")
    return scores.argmax(dim=1) == 1  # torch argmax, like numpy's, returns the first maximum: a tie is wrong


def aro_relation_scores(scores: Tensor, relations: Sequence[str]) -> dict[str, object]:
    """VG-Relation. scores: (N, 2) [false, true]. Macro accuracy over relations not in ARO_EXCLUDED_RELATIONS."""
    correct = _aro_correct(scores)
    per = _by_group(correct, relations)
    kept = {r: a for r, a in per.items() if r not in ARO_EXCLUDED_RELATIONS}
    if not kept:
        raise ValueError("VG-Relation: every relation is in the excluded (symmetric) list; nothing to average")
    return {"macro": sum(kept.values()) / len(kept), "micro": _pct(correct), "per_relation": kept}


def aro_attribution_scores(scores: Tensor, attributes: Sequence[tuple[str, str]]) -> dict[str, object]:
    """VG-Attribution. scores: (N, 2) [false, true]. Macro accuracy over attribute pairs with >= 25 items."""
    correct = _aro_correct(scores)
    keys = [f"{a}_{b}" for a, b in attributes]
    counts: dict[str, int] = defaultdict(int)
    for k in keys:
        counts[k] += 1
    per = {k: a for k, a in _by_group(correct, keys).items() if counts[k] >= ARO_MIN_ATTRIBUTE_COUNT}
    if not per:
        raise ValueError(f"VG-Attribution: no attribute pair has >= {ARO_MIN_ATTRIBUTE_COUNT} items")
    return {"macro": sum(per.values()) / len(per), "micro": _pct(correct), "per_attribute_pair": per}


def spec_scores(
    scores: Sequence[Tensor], labels: Sequence[int], subsets: Sequence[str], directions: Sequence[str]
) -> dict[str, object]:
    """SPEC. scores: one (K,) vector per sample (its query against its candidates; K may differ between samples),
    labels: the true candidate's index, subsets / directions ("i2t" | "t2i"): per sample.

    Returns, per direction, {subset: accuracy %}, `<direction>_mean` (the unweighted mean over its subsets, the
    reference's "average all subset" line), `<direction>_items` {subset: samples}, and `mean`, the average of the
    two directions' means (CLIP-IN Table 3's "Avg") when both are present.
    """
    if not len(scores) == len(labels) == len(subsets) == len(directions):
        raise ValueError(f"SPEC: {len(scores)} score rows, {len(labels)} labels, {len(subsets)} subsets, "
                         f"{len(directions)} directions")  # fmt: skip
    # torch argmax returns the first maximal index, as the reference's `scores.argmax(dim=-1)` does on a tie
    correct = torch.tensor([int(s.argmax()) == int(y) for s, y in zip(scores, labels, strict=True)])
    out: dict[str, object] = {}
    means = []
    for direction in ("i2t", "t2i"):
        idx = [i for i, d in enumerate(directions) if d == direction]
        if not idx:
            continue
        groups = [subsets[i] for i in idx]
        per = _by_group(correct[idx], groups)
        out[direction] = per
        out[f"{direction}_mean"] = sum(per.values()) / len(per)
        out[f"{direction}_items"] = {g: groups.count(g) for g in per}
        means.append(out[f"{direction}_mean"])
    if len(means) == 2:
        out["mean"] = sum(means) / 2
    return out
