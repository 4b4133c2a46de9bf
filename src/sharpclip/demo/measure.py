"""The demo's numbers for one model or one finished run.

Of a model, on SynthDense's test split (a base scene and its near-duplicates per family):

- Recall@1/5/10 both directions over the whole test set (eval.metrics, as HN-CLIP Table 1 reports);
- within-family R@1: the gallery is only the query's family (the 6 near-duplicates), so it measures exactly the
  near-duplicate confusion the HN-CLIP margin targets; family-hit: the top-1 over the whole set is in the right family;
- SynthDense MMVP-style pair accuracy (eval.pairs.mmvp_scores: both statements of a pair must pick their image);
- caption geometry of the test captions under the model's text tower (analysis.geometry, HN-CLIP Table A1).

Of a run (its metrics.jsonl and diagnostics.jsonl): the saturation the paper reports (HN-CLIP §2.1: the share of
batches and of rows whose InfoNCE is below 1e-3, in the first epoch and overall; the share of measured steps whose
InfoNCE gradient is exactly zero in float32) and whether the arm's own loss kept its batches active.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from sharpclip.analysis.dynamics import read_jsonl
from sharpclip.analysis.geometry import caption_geometry
from sharpclip.config import DataConfig
from sharpclip.train.step import SATURATED

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


def hardest_is_sibling(text: Tensor, groups: Sequence[str]) -> float:
    """Share (%) of captions whose most similar other caption is a near-duplicate of the same family. text: (N, D)."""
    g = text @ text.t()
    g.fill_diagonal_(float("-inf"))
    nearest = g.argmax(1).tolist()
    return 100.0 * sum(groups[i] == groups[j] for i, j in enumerate(nearest)) / len(groups)


def evaluate_model(model: Any, data: DataConfig, batch_size: int = 128) -> dict[str, Any]:
    """Every test metric of the module docstring for `model` on SynthDense at `data.root` (generated already)."""
    from sharpclip.data import read_samples
    from sharpclip.data.transforms import model_transforms
    from sharpclip.eval.embed import ModelEmbedder
    from sharpclip.eval.metrics import pairs_from_caption_index, retrieval_metrics
    from sharpclip.eval.pair_data import read_synth_mmvp
    from sharpclip.eval.suite import score_choice_set

    samples = read_samples(data, "test")
    preprocess, tokenizer = model_transforms(model)
    embed = ModelEmbedder(model.eval(), preprocess, tokenizer, batch_size=batch_size, progress=False)
    with torch.no_grad():
        image = embed.images([s.image for s in samples]).float()
        text = embed.texts([s.caption for s in samples]).float()
    ranks = retrieval_metrics(text, image, pairs_from_caption_index(range(len(samples))), KS)
    out: dict[str, Any] = {f"{d}_R@{k}": ranks[d][f"R@{k}"] for d in ("t2i", "i2t") for k in KS}
    out["mean_R@1"] = (out["t2i_R@1"] + out["i2t_R@1"]) / 2
    groups = [s.group or s.id for s in samples]
    out.update(within_family_r1(text @ image.t(), groups))
    out["within_mean_R@1"] = (out["within_t2i_R@1"] + out["within_i2t_R@1"]) / 2
    mmvp = score_choice_set(embed, read_synth_mmvp(data.root))
    out["mmvp"], out["mmvp_pairs"] = mmvp["mean"], mmvp["pairs"]
    out["mmvp_per_pattern"] = mmvp["per_pattern"]
    geometry = caption_geometry(text)
    out["geometry"] = geometry
    out["pairwise_sim"], out["hardest_sim"] = geometry["mean_pairwise"], geometry["mean_hardest"]
    out["hardest_is_sibling"] = hardest_is_sibling(text, groups)
    out["test_pairs"] = len(samples)
    out["captions_truncated"] = embed.num_truncated
    return out


def _share(flags: list[bool]) -> float | None:
    return 100.0 * sum(flags) / len(flags) if flags else None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _saturated_share(steps: list[dict]) -> float | None:
    """Share (%) of the steps' contrastive matrices (micro-batches under per_micro_batch) with InfoNCE < 1e-3."""
    if not steps:
        return None

    def share(r: dict) -> float:  # records written before the per-matrix count: one matrix per step
        return r["saturated_monitor"] if "saturated_monitor" in r else float(r["infonce_monitor"] < SATURATED)

    matrices = [r.get("matrices_monitor", 1.0) for r in steps]
    return 100.0 * sum(share(r) * n for r, n in zip(steps, matrices, strict=True)) / sum(matrices)


def training_stats(run_dir: str | Path) -> dict[str, Any]:
    """Saturation and activity of a finished arm (shares in %), from its metrics.jsonl and diagnostics.jsonl."""
    run_dir = Path(run_dir)
    steps = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "infonce_monitor" in r]
    first = [r for r in steps if r["epoch"] == 0]
    out: dict[str, Any] = {
        "steps": len(steps),
        "steps_first_epoch": len(first),
        "sat_batches_ep1": _saturated_share(first),
        "sat_rows_ep1": None if not first else 100.0 * _mean([r["rows_saturated_monitor"] for r in first]),
        "sat_batches": _saturated_share(steps),
        "sat_rows_last": None if not steps else 100.0 * steps[-1]["rows_saturated_monitor"],
        "min_infonce": min((r["infonce_monitor"] for r in steps), default=None),
        "active_batches": _share([r["loss"] >= SATURATED for r in steps]),
        "final_loss": steps[-1]["loss"] if steps else None,
        "final_scale": steps[-1]["logit_scale"] if steps else None,
        "samples_per_s": _mean([r["samples_per_s"] for r in steps[1:]]),
    }
    third = steps[2 * len(steps) // 3 :]
    out["grad_norm_last_third"] = _mean([r["grad_norm"] for r in third])
    diag_path = run_dir / "diagnostics.jsonl"
    if diag_path.is_file():
        diag = read_jsonl(diag_path)
        out["diag_measurements"] = len(diag)
        out["zero_grad_infonce_ep1"] = _share([bool(d["grad_zero_infonce"]) for d in diag if d["epoch"] == 0])
        out["zero_grad_infonce"] = _share([bool(d["grad_zero_infonce"]) for d in diag])
        ratios = [d["grad_norm_hn"] / d["grad_norm_infonce"] for d in diag if d["grad_norm_infonce"] > 0]
        out["grad_ratio_hn_over_infonce"] = _mean(ratios)
    return out
