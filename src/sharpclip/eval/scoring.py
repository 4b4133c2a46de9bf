"""Scoring one benchmark's set with an `Embedder`: retrieval, pair choice (by kind) and zero-shot classification.

Each protocol's arithmetic lives in its own module (eval.retrieval / eval.metrics, eval.pairs, eval.zeroshot); this
module embeds a set's images and captions and hands the similarities to the right one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from sharpclip.config import EvalConfig
from sharpclip.eval import pairs, spec_data
from sharpclip.eval.benchmarks import EvalSet
from sharpclip.eval.embed import Embedder
from sharpclip.eval.pair_data import ChoiceSet
from sharpclip.eval.retrieval import RetrievalSet, evaluate_retrieval
from sharpclip.eval.zeroshot import PROMPT_SETS, class_prompts, evaluate_zeroshot


def choice_inputs(cs: ChoiceSet) -> tuple[list[Any], list[str]]:
    """Every item's images and captions, flattened in item order."""
    return [ref for item in cs.images for ref in item], [t for item in cs.texts for t in item]


def choice_scores(embedder: Embedder, cs: ChoiceSet) -> torch.Tensor:
    """(N, n_texts, n_images): every caption of an item against every image of the same item."""
    flat_images, flat_texts = choice_inputs(cs)
    img = embedder.images(flat_images).reshape(len(cs), len(cs.images[0]), -1)
    txt = embedder.texts(flat_texts).reshape(len(cs), len(cs.texts[0]), -1)
    return torch.einsum("ntd,nid->nti", txt.float(), img.float())


def item_scores(embedder: Embedder, cs: ChoiceSet) -> list[torch.Tensor]:
    """One (n_texts, n_images) matrix per item, for sets whose items differ in size (SPEC)."""
    flat_images, flat_texts = choice_inputs(cs)
    img, txt = embedder.images(flat_images).float(), embedder.texts(flat_texts).float()
    out, i, t = [], 0, 0
    for refs, captions in zip(cs.images, cs.texts, strict=True):
        out.append(txt[t : t + len(captions)] @ img[i : i + len(refs)].T)
        i, t = i + len(refs), t + len(captions)
    return out


def _spec(embedder: Embedder, cs: ChoiceSet) -> dict[str, Any]:
    """SPEC: an image-to-text item's captions against its image (column 0), a text-to-image item's caption against
    its images (row 0)."""
    directions = cs.extra["direction"]
    _every_part_scored(cs)
    rows = [m[:, 0] if d == "i2t" else m[0] for m, d in zip(item_scores(embedder, cs), directions, strict=True)]
    out = pairs.spec_scores(rows, cs.extra["label"], cs.groups, directions)
    if cs.parts:
        out["subsets"] = list(cs.parts)
        out["subsets_left_out"] = [s for s in spec_data.SPEC_SUBSETS if s not in cs.parts]
    return out


def _every_part_scored(cs: ChoiceSet) -> None:
    """Raise ValueError when a part read (a SPEC subset) has no item left in a direction (every one skipped as bad):
    its means would silently cover fewer subsets."""
    have = set(zip(cs.groups, cs.extra["direction"], strict=True))
    for part in cs.parts:
        for direction in spec_data.SPEC_FILES:
            if (part, direction) not in have:
                raise ValueError(f"SPEC: every {direction} sample of subset {part!r} was skipped as bad, so the means "
                                 f"would leave it out; fix its {spec_data.SPEC_FILES[direction]}, or leave it out "
                                 f"with {spec_data.SUBSETS_OPTION}")  # fmt: skip


def score_choice_set(embedder: Embedder, cs: ChoiceSet) -> dict[str, Any]:
    """The metrics of a pair-choice set, by its kind's scorer in eval/pairs.py."""
    if cs.kind == "spec":
        return _spec(embedder, cs)
    s = choice_scores(embedder, cs)
    if cs.kind == "mmvp":
        qids = cs.extra.get("qids")
        return pairs.mmvp_scores(s, cs.groups, pairs.mmvp_ground_truth(qids) if qids else None)
    if cs.kind == "winoground":
        return pairs.winoground_scores(s)
    if cs.kind == "sugarcrepe":
        return pairs.sugarcrepe_report(pairs.sugarcrepe_scores(s[:, 0, 0], s[:, 1, 0], cs.groups))
    if cs.kind == "aro_relation":
        return pairs.aro_relation_scores(s[:, :, 0], cs.groups)
    if cs.kind == "aro_attribution":
        return pairs.aro_attribution_scores(s[:, :, 0], cs.groups)
    raise ValueError(f"{cs.name}: no scorer for pair-choice kind {cs.kind!r}")


def load_prompts(spec: str) -> tuple[str, ...]:
    """A named prompt set or a file with one template (containing '{}') per line."""
    if spec in PROMPT_SETS:
        return PROMPT_SETS[spec]
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"eval.prompts: {spec!r} is neither a prompt set ({', '.join(PROMPT_SETS)}) nor a file")
    return tuple(line.strip() for line in path.read_text().splitlines() if line.strip())


def set_inputs(es: EvalSet, cfg: EvalConfig) -> tuple[list[Any], list[str]]:
    """The image refs and captions `evaluate_set` embeds for `es` (eval.suite embeds them all up front)."""
    if isinstance(es, RetrievalSet):
        return list(es.images), list(es.captions)
    if isinstance(es, ChoiceSet):
        return choice_inputs(es)
    return list(es.images), class_prompts(es.classnames, load_prompts(cfg.prompts))


def evaluate_set(embedder: Embedder, es: EvalSet, cfg: EvalConfig) -> dict[str, Any]:
    """The metrics of one eval set, with a `task` key naming the protocol."""
    if isinstance(es, RetrievalSet):
        return {"task": "retrieval", **evaluate_retrieval(embedder, es, cfg.recall_k, cfg.chunk_size)}
    if isinstance(es, ChoiceSet):
        return {"task": es.kind, "items": len(es), **score_choice_set(embedder, es)}
    return {"task": "zeroshot", **evaluate_zeroshot(embedder, es, load_prompts(cfg.prompts), cfg.zeroshot_k)}
