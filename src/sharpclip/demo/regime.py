"""Whether the demo's task is in the HN-CLIP paper's caption geometry: the init's regime check and the geometry along
training.

The margin γ·Ḡ (HN-CLIP eq. 2) behaves as the paper describes only when Ḡ has the paper's geometry: Long-CLIP-L puts
the test captions of DOCCI / DCI / Urban-1K at a mean pairwise cosine of 0.84 / 0.85 / 0.88 and each caption's
hardest negative at 0.93 / 0.92 / 0.94 (HN-CLIP Fig. 1), and already ranks many near-duplicates right. So:

- `regime_check(test)`: of the init's test metrics (demo.measure.embedding_metrics, the numbers report.md prints),
  each of mean pairwise caption cosine (target 0.80–0.90), mean hardest-negative cosine (0.90–0.96) and within-family
  R@1 (at least twice chance, at most 60 %: the init half-sees the details, with headroom), and whether it is inside;
- `regime_markdown` also prints what sets the hardest negative: the nearest caption of another family (the hardest
  the set would have without its near-duplicates), the gap ratio (1 − hardest) / (1 − pairwise) (the paper's
  0.44–0.53: how far the nearest caption sits from the rest, relative to the spread of the whole set) and the
  captions' effective dimension (analysis.geometry.effective_dimension); `hardest_line` says it in one sentence;
- `margin_line` / `margin_markdown`: the boost in the paper's units on the init's test captions, at γ 0.5 and at the
  γ that gives the paper's spread (analysis.geometry.margin_report): spread s·γ·(h̄ − p̄) and uniform part s·γ·p̄ in
  logits, and the share of captions whose hardest negative asks more margin than any unit image vector can give;
- `geometry_verdicts(results)`: per arm, the validation captions' mean pairwise and hardest cosine at the init and at
  the last validation, and whether the arm kept the init's geometry (the paper's margin presumes it) or reshaped it:
  reshaped when the mean pairwise cosine moved by more than MOVED["pairwise"] or the mean hardest by more than
  MOVED["hardest"] (mean over seeds).
"""

from __future__ import annotations

import statistics
from typing import Any

from sharpclip.analysis.geometry import PAPER_FIG1, PAPER_GAMMA, PAPER_SCALE, margin_logits, margin_table, reach
from sharpclip.demo.measure import CAPTION_HARDEST, CAPTION_PAIRWISE, SAT_PLAIN, SAT_TWIN

PAIRWISE_RANGE, HARDEST_RANGE = (0.80, 0.90), (0.90, 0.96)
WITHIN_CHANCE_FACTOR, WITHIN_MAX = 2.0, 60.0  # within-family R@1: ≥ 2 × chance, ≤ 60 %
# cosine changes of the validation captions, init -> last validation, beyond which an arm reshaped the geometry:
# pairwise, about a tenth of the way from an init that spreads its captions apart (≈ 0) to the paper's (≈ 0.85);
# hardest, half that, as it lives in the narrower band 0.9-1.0
MOVED = {"pairwise": 0.1, "hardest": 0.05}


def regime_check(test: dict[str, Any]) -> dict[str, Any]:
    """{quantity: {"value", "low", "high", "holds"}} for pairwise_sim, hardest_sim and within_mean_R@1 of a model's
    test metrics (demo.measure.embedding_metrics), "within_chance" (%) and "holds": all three inside their range."""
    chance = test["within_chance"]
    ranges = {
        "pairwise_sim": PAIRWISE_RANGE,
        "hardest_sim": HARDEST_RANGE,
        "within_mean_R@1": (WITHIN_CHANCE_FACTOR * chance, WITHIN_MAX),
    }
    out: dict[str, Any] = {}
    for key, (low, high) in ranges.items():
        value = float(test[key])
        out[key] = {"value": value, "low": low, "high": high, "holds": low <= value <= high}
    out["within_chance"] = chance
    out["holds"] = all(out[k]["holds"] for k in ranges)
    return out


def gap_ratio(pairwise: float, hardest: float) -> float:
    """(1 − hardest) / (1 − pairwise): the nearest caption's distance relative to the mean distance."""
    return (1.0 - hardest) / (1.0 - pairwise) if pairwise < 1.0 else 0.0


def _shown(value: float | None, digits: int, unit: str = "") -> str:
    """`value` to `digits` decimals with `unit`, or "–" when it was not measured."""
    return "–" if value is None else f"{value:.{digits}f}{unit}"


def _numbers(test: dict[str, Any]) -> str:
    """A measured row's cells; the diagnostic ones are "–" in results cached before they were measured."""
    pairwise, hardest = test["pairwise_sim"], test["hardest_sim"]
    cells = [f"{pairwise:.3f}", f"{hardest:.3f}", f"{test['within_mean_R@1']:.1f}"]
    cells += [_shown(test.get("nearest_other_family_sim"), 3), f"{gap_ratio(pairwise, hardest):.3f}"]
    return " | ".join([*cells, _shown(test.get("effective_dim"), 1)])


def regime_markdown(inits: dict[str, tuple[str, dict[str, Any]]], check: dict[str, Any]) -> str:
    """The regime-check table: the paper's Fig. 1 rows, each init's measured row ({name: (label, test metrics)}),
    the target ranges and whether the last init (the one the arms start from, `check` = its regime_check) is inside."""
    lines = [
        "| test captions under | mean pairwise caption cosine | mean hardest-negative cosine | within-family R@1 % "
        "| nearest other-family caption | (1 − hardest) / (1 − pairwise) | effective dimension |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, (p, h) in PAPER_FIG1.items():
        lines.append(f"| HN-CLIP Fig. 1: Long-CLIP-L, {name} | {p:.2f} | {h:.2f} | – | {h:.2f} (no families) | "
                     f"{gap_ratio(p, h):.2f} | – |")  # fmt: skip
    lines += [f"| {label} | {_numbers(test)} |" for label, test in inits.values()]
    w = check["within_mean_R@1"]
    chance = check["within_chance"]
    lines.append(
        f"| target | {PAIRWISE_RANGE[0]:.2f}–{PAIRWISE_RANGE[1]:.2f} | {HARDEST_RANGE[0]:.2f}–{HARDEST_RANGE[1]:.2f} | "
        f"{w['low']:.1f}–{w['high']:.0f} (≥ {WITHIN_CHANCE_FACTOR:g} × chance {chance:.1f}) | – | – | – |"
    )
    held = " | ".join("yes" if check[k]["holds"] else "no" for k in ("pairwise_sim", "hardest_sim", "within_mean_R@1"))
    lines.append(f"| in range (the init every arm starts from) | {held} | – | – | – |")
    return "\n".join(lines) + "\n"


def hardest_line(test: dict[str, Any]) -> str:
    """What sets the init's hardest negative, in one sentence: its share that are near-duplicates, the nearest
    other-family caption, and the gap ratio against the paper's; "" for results cached before these were measured."""
    other, dim = test.get("nearest_other_family_sim"), test.get("effective_dim")
    if other is None or dim is None:
        return ""
    low, high = HARDEST_RANGE
    where = "inside" if low <= other <= high else "above" if other > high else "below"
    paper = [gap_ratio(p, h) for p, h in PAPER_FIG1.values()]
    return (
        f"The hardest negative of {test['hardest_is_sibling']:.0f} % of the init's test captions is a near-duplicate "
        f"of its own family; the nearest caption of another family sits at {other:.3f} on average, {where} the "
        f"hardest range {low:.2f}–{high:.2f}. The gap ratio (1 − hardest) / (1 − pairwise) is "
        f"{gap_ratio(test['pairwise_sim'], test['hardest_sim']):.3f}, and {gap_ratio(test['pairwise_sim'], other):.3f} "
        f"with the nearest other-family caption as the hardest (HN-CLIP Fig. 1, whose test sets hold no families: "
        f"{min(paper):.2f}–{max(paper):.2f}); the captions vary along {dim:.1f} effective dimensions "
        "(analysis.geometry.effective_dimension)."
    )


def margin_line(test: dict[str, Any]) -> str:
    """The init's boost in the paper's units in one sentence (test: metrics with geometry["margin"]); "" without."""
    margin = test.get("geometry", {}).get("margin")
    if not margin:
        return ""
    per = margin["per_gamma"]
    at_paper = per[f"{PAPER_GAMMA:.4g}"]
    paper = {n: margin_logits(p, h, PAPER_GAMMA, PAPER_SCALE)["spread"] for n, (p, h) in PAPER_FIG1.items()}
    own = margin["gamma_for_paper_spread"]
    tail = ""
    if own is not None:
        out_of_reach = 100 * per[f"{own:.4g}"]["unreachable_share"]
        tail = f"; the paper's mean spread, {margin['paper_spread']:.2f} logits, is γ {own:.3g} here"
        tail += f", where {out_of_reach:.1f} % of hardest negatives are out of reach"
    papers = " / ".join(f"{n} {v:.1f}" for n, v in paper.items())
    return (
        f"At γ {PAPER_GAMMA:g} and s {margin['scale']:g} the init's boost spreads {at_paper['spread']:.1f} logits "
        f"(s·γ·(h̄ − p̄); the paper's, γ {PAPER_GAMMA:g}, s {PAPER_SCALE:g}: {papers}) over a uniform "
        f"{at_paper['uniform']:.1f} (s·γ·p̄; the paper's 42–44), and asks {100 * at_paper['unreachable_share']:.1f} % "
        f"of its captions' hardest negatives for a margin γ·G above √(2 − 2G), more than any image embedding can "
        f"give (the paper's mean hardest, 0.93, asks {PAPER_GAMMA * 0.93:.2f} of a reach of {reach(0.93):.2f})"
        f"{tail}."
    )


def margin_markdown(test: dict[str, Any], label: str) -> str:
    """The margin-in-logits table (analysis.geometry.margin_table) of one model's test captions; "" without."""
    geometry = test.get("geometry", {})
    if "margin" not in geometry:
        return ""
    return margin_table({label: geometry["margin"]}, {label: geometry})


def saturation_line(validation: dict[str, float]) -> str:
    """The init's probe: how many training micro-batches with and without near-twin pairs InfoNCE leaves saturated."""
    twin, plain = validation.get(SAT_TWIN), validation.get(SAT_PLAIN)
    return (
        f"At the init, InfoNCE is below 1e-3 on {_shown(twin, 0, ' %')} of the probe's training micro-batches that "
        f"hold near-twin pairs and on {_shown(plain, 0, ' %')} of those that hold none "
        "(demo.measure.probe_micro_batches)."
    )


def _last(results: dict[str, dict[str, Any]], arm: str, key: str) -> list[float]:
    curves = [s.get("train", {}).get("geometry_curve", {}) for _, s in sorted(results[arm]["seeds"].items())]
    return [c[key][-1] for c in curves if c.get(key)]


def geometry_verdicts(results: dict[str, dict[str, Any]], inits: tuple[str, ...], init: str) -> dict[str, Any]:
    """Per fine-tuned arm: {"label", "init_pairwise", "last_pairwise" (per seed), "init_hardest", "last_hardest",
    "verdict"} from the validation captions' geometry at the init (results[init]'s "validation") and at each seed's
    last validation (training_stats' "geometry_curve"). Arms without a curve are left out."""
    start = next(iter(results.get(init, {}).get("seeds", {}).values()), {}).get("validation", {})
    if CAPTION_PAIRWISE not in start:
        return {}
    out = {}
    for arm, entry in results.items():
        pairwise, hardest = _last(results, arm, "pairwise"), _last(results, arm, "hardest")
        if arm in inits or not pairwise:
            continue
        moved = {
            "pairwise": statistics.fmean(pairwise) - start[CAPTION_PAIRWISE],
            "hardest": statistics.fmean(hardest) - start[CAPTION_HARDEST],
        }
        reshaped = [k for k, d in moved.items() if abs(d) > MOVED[k]]
        verdict = "reshaped it (" + ", ".join(f"{k} {moved[k]:+.3f}" for k in reshaped) + ")" if reshaped else "kept it"
        out[arm] = {
            "label": entry["label"], "init_pairwise": start[CAPTION_PAIRWISE], "last_pairwise": pairwise,
            "init_hardest": start[CAPTION_HARDEST], "last_hardest": hardest, "moved": moved, "verdict": verdict,
        }  # fmt: skip
    return out


def geometry_markdown(verdicts: dict[str, Any]) -> str:
    """One line per arm: the validation captions' mean pairwise and hardest cosine, init -> last validation."""
    rule = f"reshaped: pairwise moved by > {MOVED['pairwise']:g} or hardest by > {MOVED['hardest']:g}"
    lines = [f"| objective | pairwise: init → last | hardest: init → last | init's geometry ({rule}) |"]
    lines.append("|---|---|---|---|")
    for v in verdicts.values():
        last_p, last_h = statistics.fmean(v["last_pairwise"]), statistics.fmean(v["last_hardest"])
        lines.append(
            f"| {v['label']} | {v['init_pairwise']:.3f} → {last_p:.3f} | {v['init_hardest']:.3f} → {last_h:.3f} | "
            f"{v['verdict']} |"
        )
    return "\n".join(lines) + "\n"
