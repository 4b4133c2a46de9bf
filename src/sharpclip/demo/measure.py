"""The demo's numbers for one model or one finished run.

Of a model, on SynthDense's test split (a base scene and its near-duplicates per family):

- Recall@1/5/10 both directions over the whole test set (eval.metrics, as HN-CLIP Table 1 reports);
- within-family R@1: the gallery is only the query's family (the 6 near-duplicates), so it measures exactly the
  near-duplicate confusion the HN-CLIP margin targets; family-hit: the top-1 over the whole set is in the right family;
- SynthDense MMVP-style pair accuracy (eval.pairs.mmvp_scores: both statements of a pair must pick their image);
- caption geometry of the test captions under the model's text tower (analysis.geometry, HN-CLIP Table A1);
- the forgetting guard: zero-shot colour + shape classification of single-object scenes (`zeroshot_top1`), what
  the coarse pre-training (stage A) taught and fine-tuning on dense captions may cost.

Of a run (its metrics.jsonl and diagnostics.jsonl): the saturation the paper reports (HN-CLIP §2.1: the share of
batches and of rows whose InfoNCE is below 1e-3, in the first epoch and overall; the share of measured steps whose
InfoNCE gradient is exactly zero in float32) and whether the arm's own loss kept its batches active.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from sharpclip.analysis.dynamics import read_jsonl
from sharpclip.analysis.geometry import PAPER_GAMMA, caption_geometry
from sharpclip.config import DataConfig
from sharpclip.data import read_samples
from sharpclip.data.synthdense.corpus import ZEROSHOT_PROMPTS
from sharpclip.devices import resolve_device
from sharpclip.eval.evaluator import model_embedder
from sharpclip.eval.metrics import pairs_from_caption_index, retrieval_metrics
from sharpclip.eval.pair_data import read_synth_mmvp
from sharpclip.eval.scoring import choice_scores, score_choice_set
from sharpclip.eval.zeroshot import evaluate_zeroshot, read_image_folder
from sharpclip.losses.monitors import (
    INFONCE_MONITOR,
    MATRICES_MONITOR,
    ROWS_SATURATED_MONITOR,
    SATURATED,
    SATURATED_MONITOR,
    per_row_infonce,
)
from sharpclip.train.diagnostics import (
    GRAD_NORM_HN,
    GRAD_NORM_INFONCE,
    GRAD_ZERO_INFONCE,
    LOSS_HN,
    LOSS_INFONCE,
    MICRO_GRAD_ZERO_INFONCE,
    MICRO_LOSS_HN,
    MICRO_LOSS_INFONCE,
)

KS = (1, 5, 10)


def within_family_r1(sim: Tensor, groups: Sequence[str]) -> dict[str, float]:
    """R@1 (%) with each query's gallery restricted to its own family, and the whole-set top-1 family-hit rate (%).

    sim: (N, N) text × image similarities of N pairs, pair i = (caption i, image i); groups: (N,) family of pair i.
    A tie with a sibling counts as a miss (the positive must be strictly best), as eval.metrics ranks ties.
    """
    codes = {g: i for i, g in enumerate(dict.fromkeys(groups))}
    fam = torch.tensor([codes[g] for g in groups])
    same = fam[:, None] == fam[None, :]
    out = {}
    for direction, s in (("t2i", sim), ("i2t", sim.t())):
        masked = s.masked_fill(~same, float("-inf"))
        own = s.diagonal()
        beaten = ((masked > own[:, None]) | ((masked == own[:, None]) & ~torch.eye(len(s), dtype=torch.bool))).any(1)
        out[f"within_{direction}_R@1"] = 100.0 * float((~beaten).double().mean())
        out[f"family_hit_{direction}"] = 100.0 * float(same[torch.arange(len(s)), s.argmax(1)].double().mean())
    return out


def family_r1(sim: Tensor, groups: Sequence[str]) -> dict[str, list[float]]:
    """Per family (in order of first appearance): its mean R@1 (%) over both directions, whole-set and within-family.

    The demo's noise bar (demo.report.paired_noise) resamples these: the errors of one family's near-duplicates are
    not independent, so the family, not the pair, is the unit of the test set. sim: (N, N) text × image."""
    codes = {g: i for i, g in enumerate(dict.fromkeys(groups))}
    fam = torch.tensor([codes[g] for g in groups])
    same = fam[:, None] == fam[None, :]
    eye = torch.eye(len(sim), dtype=torch.bool)
    out: dict[str, list[float]] = {}
    for name, gallery in (("family_r1", torch.ones_like(same)), ("family_within", same)):
        hits = []
        for s in (sim, sim.t()):
            masked = s.masked_fill(~gallery, float("-inf"))
            own = s.diagonal()[:, None]
            hits.append(~((masked > own) | ((masked == own) & ~eye)).any(1))
        per_query = torch.stack(hits).double().mean(0)  # (N,): mean of the two directions
        sums = torch.zeros(len(codes), dtype=torch.float64).index_add_(0, fam, per_query)
        counts = torch.zeros(len(codes), dtype=torch.float64).index_add_(
            0, fam, torch.ones(len(fam), dtype=torch.float64)
        )
        out[name] = (100.0 * sums / counts).tolist()
    return out


def mmvp_breakdown(scores: Tensor, statement_cos: Tensor, patterns: Sequence[str]) -> dict[str, Any]:
    """Why MMVP-style pair accuracy can sit below 25 %: how often both statements pick the same image.

    scores: (P, 2 statements, 2 images), statement k true of image k; statement_cos: (P,) cosine of the two
    statements' embeddings. A pair is right only when the statements pick different images the right way round; when
    the two statements embed almost alike (they differ in one word), both prefer the same image and the pair is lost
    whatever the images show. `chance` is the accuracy of a model that keeps these picks but whose image preference is
    unrelated to the truth: half the pairs whose statements pick different images (25 % only if the two picks were
    independent coins). Ties (equal scores) count as picking image b, as the scorer does."""
    pick = torch.where(scores[:, :, 0] > scores[:, :, 1], 0, 1)  # (P, 2): image chosen by statement 0 / 1
    right = (pick[:, 0] == 0) & (pick[:, 1] == 1)
    same = pick[:, 0] == pick[:, 1]
    ties = (scores[:, :, 0] == scores[:, :, 1]).any(1)
    pct = lambda x: 100.0 * float(x.double().mean()) if len(x) else 0.0  # noqa: E731
    per = {}
    for pattern in dict.fromkeys(patterns):
        idx = torch.tensor([i for i, q in enumerate(patterns) if q == pattern])
        per[pattern] = {
            "right": pct(right[idx]),
            "same_image": pct(same[idx]),
            "both_pick_b": pct((pick[idx] == 1).all(1)),
        }
    return {
        "right": pct(right), "same_image": pct(same), "both_pick_a": pct((pick == 0).all(1)),
        "both_pick_b": pct((pick == 1).all(1)), "ties": pct(ties), "chance": pct(~same) / 2,
        "statement_cos": float(statement_cos.mean()), "per_pattern": per,
    }  # fmt: skip


def hardest_is_sibling(text: Tensor, groups: Sequence[str]) -> float:
    """Share (%) of captions whose most similar other caption is a near-duplicate of the same family. text: (N, D)."""
    g = text @ text.t()
    g.fill_diagonal_(float("-inf"))
    nearest = g.argmax(1).tolist()
    return 100.0 * sum(groups[i] == groups[j] for i, j in enumerate(nearest)) / len(groups)


def nearest_other_family(text: Tensor, groups: Sequence[str]) -> float | None:
    """Mean over captions of the cosine of the most similar caption of another family: the hardest negative the set
    would have without its near-duplicates; None for a single family. text: (N, D) L2-normalised."""
    codes = {g: i for i, g in enumerate(dict.fromkeys(groups))}
    if len(codes) < 2:
        return None
    family = torch.tensor([codes[g] for g in groups])
    g = (text @ text.t()).masked_fill(family[:, None] == family[None, :], float("-inf"))
    return float(g.max(1).values.double().mean())


def within_chance(groups: Sequence[str]) -> float:
    """Within-family R@1 (%) of a random ranking: the mean over the pairs of 1 / the size of their family."""
    sizes = Counter(groups)
    return 100.0 * sum(1.0 / sizes[g] for g in groups) / len(groups)


def embedding_metrics(text: Tensor, image: Tensor, groups: Sequence[str], scale: float | None = None) -> dict[str, Any]:
    """What the test embeddings alone give: recall, within-family R@1 and its chance, per-family R@1, caption
    geometry (the regime check's numbers: demo.report.regime_check; with `scale`, the boost in logits at the paper's
    γ and spread: analysis.geometry.margin_report). text, image: (N, D) L2-normalised, pair i = (caption i,
    image i); groups: (N,) family of pair i."""
    ranks = retrieval_metrics(text, image, pairs_from_caption_index(range(len(text))), KS)
    out: dict[str, Any] = {f"{d}_R@{k}": ranks[d][f"R@{k}"] for d in ("t2i", "i2t") for k in KS}
    out["mean_R@1"] = (out["t2i_R@1"] + out["i2t_R@1"]) / 2
    out.update(within_family_r1(text @ image.t(), groups))
    out["within_mean_R@1"] = (out["within_t2i_R@1"] + out["within_i2t_R@1"]) / 2
    out["within_chance"] = within_chance(groups)
    out.update(family_r1(text @ image.t(), groups))
    geometry = caption_geometry(text, gammas=(PAPER_GAMMA,), scale=scale)
    out["geometry"] = geometry
    out["pairwise_sim"], out["hardest_sim"] = geometry["mean_pairwise"], geometry["mean_hardest"]
    out["hardest_is_sibling"] = hardest_is_sibling(text, groups)
    out["nearest_other_family_sim"] = nearest_other_family(text, groups)
    out["effective_dim"] = geometry["effective_dim"]
    out["test_pairs"] = len(text)
    return out


def evaluate_model(model: Any, data: DataConfig, batch_size: int = 128, scale: float | None = None) -> dict[str, Any]:
    """Every test metric of the module docstring for `model` on SynthDense at `data.root` (generated already);
    `scale`: the logit scale the margin's logits are counted at (embedding_metrics)."""
    samples = read_samples(data, "test")
    # on the GPU when there is one, with the model's own preprocessing (eval.evaluator, as training's validation)
    embed = model_embedder(model.eval(), batch_size=batch_size, device=resolve_device("auto", "eval.device"))
    with torch.no_grad():
        image = embed.images([s.image for s in samples]).float().cpu()
        text = embed.texts([s.caption for s in samples]).float().cpu()
    out = embedding_metrics(text, image, [s.group or s.id for s in samples], scale)
    pairs = read_synth_mmvp(data.root)
    mmvp = score_choice_set(embed, pairs)
    out["mmvp"], out["mmvp_pairs"] = mmvp["mean"], mmvp["pairs"]
    out["mmvp_per_pattern"] = mmvp["per_pattern"]
    with torch.no_grad():
        statements = embed.texts([t for item in pairs.texts for t in item]).float().reshape(len(pairs), 2, -1)
    cos = torch.nn.functional.cosine_similarity(statements[:, 0], statements[:, 1], dim=-1)
    out["mmvp_breakdown"] = mmvp_breakdown(choice_scores(embed, pairs), cos, pairs.groups)
    out["mmvp_chance"] = out["mmvp_breakdown"]["chance"]
    out.update(zeroshot_guard(embed, Path(data.root)))
    out["captions_truncated"] = embed.num_truncated
    return out


# -- along training: what the demo's validation adds to retrieval, at every validation of every arm --------------
PROBE_MICRO_BATCHES = 8  # of each kind: with near-twin pairs, without
# the keys of those numbers under `eval/` in an arm's metrics.jsonl (the trainer prefixes what `evaluate` returns)
CAPTION_PAIRWISE, CAPTION_HARDEST = "caption_pairwise", "caption_hardest"
SAT_TWIN, SAT_PLAIN = "sat_micro_twin", "sat_micro_plain"


def probe_micro_batches(groups: Sequence[str], size: int, count: int, seed: int = 0) -> dict[str, list[list[int]]]:
    """Fixed micro-batches of `size` training rows (indices into `groups`), composed as the group sampler composes
    them: "twin", up to `count` micro-batches of size // 2 near-twin pairs (two rows of one group each; the detail
    pairs), and "plain", up to `count` micro-batches of `size` rows from distinct groups none of which has a twin in
    the micro-batch (one row of a group each). Seeded: the same micro-batches at every validation."""
    members: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(groups):
        members[g].append(i)
    rng = random.Random(seed)
    twins = [m[:2] for m in members.values() if len(m) >= 2]
    ones = [m[0] for m in members.values() if len(m) == 1] or [m[0] for m in members.values()]
    rng.shuffle(twins)
    rng.shuffle(ones)
    half = size // 2
    twin = [[i for pair in twins[k * half : (k + 1) * half] for i in pair] for k in range(len(twins) // half)]
    plain = [ones[k * size : (k + 1) * size] for k in range(len(ones) // size)]
    return {"twin": twin[:count], "plain": plain[:count]}


def micro_saturation(image: Tensor, text: Tensor, log_scale: Tensor, batches: list[list[int]]) -> float | None:
    """Share (%) of `batches` (row indices into image, text: (N, D) L2-normalised) whose own InfoNCE at the scale
    exp(log_scale) is below 1e-3 (HN-CLIP §2.1's saturated batch; losses.monitors)."""
    return _share([float(per_row_infonce(image[b], text[b], log_scale).mean()) < SATURATED for b in batches])


def along_training(
    captions: Sequence[str],
    probe: Sequence[Any],
    batches: dict[str, list[list[int]]],
    alpha: str,
    log_scale: float | None = None,
):
    """A validation add-on: model -> {CAPTION_PAIRWISE, CAPTION_HARDEST: the mean pairwise and mean hardest cosine of
    `captions` (the validation captions; analysis.geometry), SAT_TWIN, SAT_PLAIN: the saturated share (%) of the
    probe's micro-batches with and without near-twin pairs}. probe: the training samples `batches` index. The
    probe's InfoNCE is at the scale exp(log_scale), or at the model's own when None (an arm's, as it trains; an init
    is probed at the scale the arms start from, not at the one its own pre-training ended with)."""

    def measure(model: Any) -> dict[str, float]:
        embed = model_embedder(model, alpha)
        with torch.no_grad():
            geometry = caption_geometry(embed.texts(list(captions)).float().cpu(), bins=2)
            text = embed.texts([s.caption for s in probe]).float().cpu()
            image = embed.images([s.image for s in probe]).float().cpu()
        scale = model.logit_scale.detach().float().cpu() if log_scale is None else torch.tensor(log_scale)
        out = {CAPTION_PAIRWISE: geometry["mean_pairwise"], CAPTION_HARDEST: geometry["mean_hardest"]}
        for key, kind in ((SAT_TWIN, "twin"), (SAT_PLAIN, "plain")):
            share = micro_saturation(image, text, scale, batches[kind])
            if share is not None:  # a split without detail pairs has no twin micro-batch
                out[key] = share
        return out

    return measure


def with_measures(validate: Callable[[Any], dict[str, float]], *extra: Callable[[Any], dict[str, float]]):
    """A Trainer's `evaluate`: `validate`'s metrics and every `extra`'s, of the same model."""

    def evaluate(model: Any) -> dict[str, float]:
        out = dict(validate(model))
        for measure in extra:
            out.update(measure(model))
        return out

    return evaluate


def along_training_stats(records: list[dict]) -> dict[str, Any]:
    """From an arm's metrics.jsonl: the caption geometry at every validation ({"epoch", "pairwise", "hardest"}) and
    the probe's saturated shares at the first validation (after epoch 1), with and without near-twin pairs."""
    evals = [r for r in records if f"eval/{CAPTION_PAIRWISE}" in r]
    curve = {"epoch": [r["epoch"] for r in evals]}
    curve["pairwise"] = [r[f"eval/{CAPTION_PAIRWISE}"] for r in evals]
    curve["hardest"] = [r[f"eval/{CAPTION_HARDEST}"] for r in evals]
    first = evals[0] if evals else {}
    return {"geometry_curve": curve, "sat_twin_ep1": first.get(f"eval/{SAT_TWIN}"),
            "sat_plain_ep1": first.get(f"eval/{SAT_PLAIN}")}  # fmt: skip


def zeroshot_guard(embed: Any, root: Path) -> dict[str, float]:
    """The demo's forgetting guard: zero-shot colour + shape top-1 (%) on SynthDense's single-object classes with the
    coarse captions' prompt, what stage A taught (`zeroshot_top1`); nothing when the corpus has no zero-shot split."""
    folder = root / "images" / "zeroshot"
    if not folder.is_dir() or not any(folder.iterdir()):
        return {}
    templates = (root / ZEROSHOT_PROMPTS).read_text(encoding="utf-8").splitlines()
    with torch.no_grad():
        scores = evaluate_zeroshot(embed, read_image_folder(folder, "zeroshot"), templates, (1,))
    return {"zeroshot_top1": scores["top1"], "zeroshot_images": scores["images"]}


def _share(flags: list[bool]) -> float | None:
    return 100.0 * sum(flags) / len(flags) if flags else None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _saturated_share(steps: list[dict]) -> float | None:
    """Share (%) of the steps' contrastive matrices (micro-batches under per_micro_batch) with InfoNCE < 1e-3."""
    if not steps:
        return None

    def share(r: dict) -> float:  # records written before the per-matrix count: one matrix per step
        return r[SATURATED_MONITOR] if SATURATED_MONITOR in r else float(r[INFONCE_MONITOR] < SATURATED)

    matrices = [r.get(MATRICES_MONITOR, 1.0) for r in steps]
    return 100.0 * sum(share(r) * n for r, n in zip(steps, matrices, strict=True)) / sum(matrices)


def _micro_zero_grads(diag: list[dict]) -> dict[str, float | None]:
    """Exact-zero fp32 InfoNCE gradients per measured contrastive matrix: of all, and of the saturated ones (loss <
    1e-3). Per micro-batch under per_micro_batch (train.diagnostics), else one matrix per measured step."""
    losses = _per_matrix(diag, MICRO_LOSS_INFONCE, LOSS_INFONCE)
    pairs = list(zip(losses, _per_matrix(diag, MICRO_GRAD_ZERO_INFONCE, GRAD_ZERO_INFONCE), strict=True))
    return {
        "zero_grad_micro": _share([bool(z) for _, z in pairs]),
        "zero_grad_saturated": _share([bool(z) for loss, z in pairs if loss < SATURATED]),
        "saturated_measured": float(sum(loss < SATURATED for loss, _ in pairs)),
        "zero_loss_micro": _share([loss == 0.0 for loss, _ in pairs]),  # exactly 0 in fp32 (its gradient need not be)
    }


def _micro_saturation(diag: list[dict]) -> dict[str, float | None]:
    """Fig. 4's contrast on the same measured contrastive matrices: the share (%) below 1e-3 under InfoNCE and under
    HN-CLIP's boosted loss (per micro-batch under per_micro_batch, else one matrix per measured step)."""

    return {
        "diag_sat_infonce": _share([x < SATURATED for x in _per_matrix(diag, MICRO_LOSS_INFONCE, LOSS_INFONCE)]),
        "diag_sat_hn": _share([x < SATURATED for x in _per_matrix(diag, MICRO_LOSS_HN, LOSS_HN)]),
    }


def _per_matrix(diag: list[dict], micro_key: str, key: str) -> list[float]:
    """One value per measured contrastive matrix: the micro-batch list where recorded, else the step's value."""
    return [x for d in diag for x in (d[micro_key] if micro_key in d else [d[key]])]


def training_stats(run_dir: str | Path) -> dict[str, Any]:
    """Saturation and activity of a finished arm (shares in %), from its metrics.jsonl and diagnostics.jsonl."""
    run_dir = Path(run_dir)
    records = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in records if INFONCE_MONITOR in r]
    first = [r for r in steps if r["epoch"] == 0]
    out: dict[str, Any] = {
        "steps": len(steps),
        "steps_first_epoch": len(first),
        "sat_batches_ep1": _saturated_share(first),
        "sat_rows_ep1": None if not first else 100.0 * _mean([r[ROWS_SATURATED_MONITOR] for r in first]),
        "sat_batches": _saturated_share(steps),
        "sat_rows_last": None if not steps else 100.0 * steps[-1][ROWS_SATURATED_MONITOR],
        "min_infonce": min((r[INFONCE_MONITOR] for r in steps), default=None),
        "active_batches": _share([r["loss"] >= SATURATED for r in steps]),
        "final_loss": steps[-1]["loss"] if steps else None,
        "final_scale": steps[-1]["logit_scale"] if steps else None,
        "samples_per_s": _mean([r["samples_per_s"] for r in steps[1:]]),
    }
    out.update(along_training_stats(records))
    third = steps[2 * len(steps) // 3 :]
    out["grad_norm_last_third"] = _mean([r["grad_norm"] for r in third])
    diag_path = run_dir / "diagnostics.jsonl"
    if diag_path.is_file():
        diag = read_jsonl(diag_path)
        out["diag_measurements"] = len(diag)
        out["zero_grad_infonce_ep1"] = _share([bool(d[GRAD_ZERO_INFONCE]) for d in diag if d["epoch"] == 0])
        out["zero_grad_infonce"] = _share([bool(d[GRAD_ZERO_INFONCE]) for d in diag])
        ratios = [d[GRAD_NORM_HN] / d[GRAD_NORM_INFONCE] for d in diag if d[GRAD_NORM_INFONCE] > 0]
        out["grad_ratio_hn_over_infonce"] = _mean(ratios)
        out.update(_micro_zero_grads(diag))
        out.update(_micro_saturation(diag))
    return out
