"""`sharpclip demo`: both papers' main experiment, end to end on SynthDense, on CPU, in minutes.

1. SynthDense (data.synthdense) into the run directory: training scenes, test families of near-duplicates, edit pairs,
   MMVP-style pairs, and a validation corpus (another seed) for the convergence curves.
2. The strong initialisation (demo.stages), made as CLIP then Long-CLIP were and cached for reuse: stage A, a tiny
   CLIP pre-trained on coarse captions at 32 tokens; stage A2, stretched to 152 tokens and trained on dense captions.
   `task` picks A2's recipe (demo.plan.TASKS): `paper-geometry` (the default), true captions and detail pairs in
   its batches, so the init half-sees the details as the paper's Long-CLIP does, or `unseen-details`, every detail
   word drawn at random (the init reads them but learns not to trust them).
3. One fine-tuning run per objective (demo.plan) on the target task, the full dense captions (size and texture
   included) with test families whose near-duplicates differ exactly there: InfoNCE and HN-CLIP (eq. 2) in the
   paper's regime (micro-batches 16 × 8, the scale frozen: `Profile.scale`); `--quick` adds CLIP-IN stage 2 (eq. 8),
   and `--full` also HN-CLIP + token term (eq. 3), CLIP-IN's ablations (no edit term, no short captions), exact
   128 × 128 accumulation and HN-CLIP's ablations (frozen Ḡ, γ sweep, LoRA ± boost, learnable scale).
4. Each is measured (demo.measure), tabulated with its gain over InfoNCE and over the init, its forgetting guard's
   drop (zero-shot colour + shape classification, what stage A taught) beside it, and judged against the papers'
   claims (demo.report), under the init's regime check against HN-CLIP's caption geometry and each arm's caption
   geometry along training (demo.regime); with `--full` (and `--quick`) the InfoNCE and HN-CLIP arms are blended back
   towards the init (demo.wise_ft, WiSE-FT); report.md / report.json and the figures go into the run directory, with
   a page of the test captions whose ground-truth rank differs most between InfoNCE and HN-CLIP (demo.compare).

    run_demo(DemoOptions(out="runs/demo"))            # what `sharpclip demo` calls
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from sharpclip import owned_files
from sharpclip.config import ModelConfig
from sharpclip.data.synthdense.corpus import ensure
from sharpclip.demo import regime, report, wise_ft
from sharpclip.demo.compare import write_qualitative
from sharpclip.demo.measure import evaluate_model, training_stats
from sharpclip.demo.plan import (
    DEFAULT_TASK,
    PAPER_SPREAD_ARM,
    Arm,
    Profile,
    arms,
    at_paper_spread,
    core_arms,
    task_profile,
)
from sharpclip.demo.stages import (
    Init,
    arm_config,
    arm_validator,
    corpus,
    data_config,
    ensure_init,
    init_home,
    run_arm,
    validation_corpus,
)
from sharpclip.models.factory import create_model

WISE_ALPHAS = {False: (0.0, 0.25, 0.5, 0.75, 1.0), True: (0.0, 0.5, 1.0)}  # --full, --quick
GEOMETRY_SUMMARY = (
    "captions", "mean_pairwise", "mean_hardest", "share_negatives_at_least", "hardest_quantiles", "margin",
)  # fmt: skip


@dataclass
class DemoOptions:
    out: str = "runs/demo"
    quick: bool = False  # CI size: every arm and output, tiny model, seconds per arm
    full: bool = False  # the ablation arms as well
    seeds: int = 1
    cache: str = ""  # where the two-stage init is kept; "" = $SHARPCLIP_CACHE or ~/.cache/sharpclip
    progress: bool = True
    only: tuple[str, ...] = ()  # run only these arms (names in demo.plan); InfoNCE is always run (the baseline)
    steps: int = 0  # > 0: fine-tuning steps per arm instead of the profile's (e.g. more epochs for saturation)
    sizes: tuple[str, ...] = ()  # "field=value" changes of the profile (demo.plan.Profile), e.g. "lr=3e-4"
    task: str = DEFAULT_TASK  # the target task (demo.plan.TASKS): its Profile changes come before `sizes`


QUICK_ALSO = ("clipin",)  # --quick (the CI run) also runs CLIP-IN's arm, so both papers' objectives are covered


def select(opts: DemoOptions) -> list[Arm]:
    """The arms `opts` asks for, in table order; an unknown name is an error listing the known ones."""
    plan = arms(opts.full or bool(opts.only) or opts.quick)
    if opts.quick and not (opts.full or opts.only):
        wanted = {a.name for a in core_arms()} | set(QUICK_ALSO)
        return [a for a in plan if a.name in wanted]
    if not opts.only:
        return plan
    known = {a.name for a in plan}
    unknown = sorted(set(opts.only) - known)
    if unknown:
        raise ValueError(f"--arms: unknown {', '.join(unknown)}; known: {', '.join(a.name for a in plan)}")
    return [a for a in plan if a.name in {*opts.only, "infonce"}]


def profile_for(opts: DemoOptions) -> Profile:
    """The mode's sizes with the task's changes, `opts.steps` and `opts.sizes` applied (in that order); an unknown
    task or field or a bad value is a ValueError."""
    p = task_profile(opts.task, opts.quick)
    changes: dict[str, Any] = {"steps": opts.steps} if opts.steps else {}
    known = {f.name: f for f in fields(Profile) if f.name != "name"}
    for item in opts.sizes:
        key, sep, value = item.partition("=")
        if not sep or key not in known:
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE with FIELD one of {', '.join(known)}")
        kind = type(getattr(p, key))
        try:
            changes[key] = kind(value)
        except ValueError:
            raise ValueError(f"--set {item!r}: {key} takes a {kind.__name__}") from None
    return replace(p, **changes)


def cache_dir(option: str) -> Path:
    return Path(option or os.environ.get("SHARPCLIP_CACHE", "~/.cache/sharpclip")).expanduser()


def prepare_data(p: Profile, out: Path) -> tuple[Any, Any, float]:
    """Generate (or find) the fine-tuning and validation corpora under `out`; their DataConfigs and the seconds."""
    start = time.perf_counter()
    data = data_config(out / "synthdense", corpus(p))
    validation = data_config(out / "synthdense-val", validation_corpus(p))
    for d in (data, validation):
        ensure(d.root, d.synthdense)
    return data, validation, time.perf_counter() - start


def obtain_init(p: Profile, opts: DemoOptions) -> Init:
    cache = cache_dir(opts.cache)
    if not (init_home(p, cache) / "init.json").is_file():
        print(f"pre-training the strong initialisation (stage A: {p.init_steps} steps on coarse captions, then "
              f"stage A2: {p.a2_steps} steps stretched to {p.context_length} tokens on dense captions, "
              f"{a2_details(p)}); done once, cached under {cache}", flush=True)  # fmt: skip
    init = ensure_init(p, cache, opts.progress)
    stages = f"stage A {init.record['stage_a']['seconds']:.0f} s, A2 {init.record['stage_a2']['seconds']:.0f} s"
    if init.reused:
        print(f"reusing the cached init {init.model_dir} (pre-training took {stages})", flush=True)
    else:
        print(f"pre-training took {stages}; the next demo reuses {init.model_dir}", flush=True)
    return init


def a2_details(p: Profile) -> str:
    """What stage A2's captions say of the details and how its scale is set, in words."""
    q = p.a2_detail_random_p
    words = {1.0: "random details", 0.0: "true details"}.get(q, f"each detail word random with p {q:g}")
    pairs = f", {p.a2_detail_pairs} detail pairs" if p.a2_detail_pairs else ""
    return words + pairs + (f", scale frozen at {p.a2_scale:g}" if p.a2_scale > 0 else "")


def _slim(test: dict[str, Any]) -> dict[str, Any]:
    """Test metrics without the geometry histograms (they go to the geometry figure's JSON)."""
    out = {k: v for k, v in test.items() if k != "geometry"}
    out["geometry"] = {k: test["geometry"][k] for k in GEOMETRY_SUMMARY if k in test["geometry"]}
    return out


def run_arms(p: Profile, plan: list[Arm], init: Init, data: Any, validate: Any, opts: DemoOptions, out: Path):
    """Fine-tune and measure every arm for every seed (`validate`: stages.arm_validator); returns results, run dirs
    (first seed), geometry stats."""
    results: report.Results = {}
    run_dirs: dict[str, Path] = {}
    geometry: dict[str, dict] = {}
    jobs = [(seed, arm) for arm in plan for seed in range(opts.seeds)]  # arm by arm: a partial run has whole rows
    bar = tqdm(jobs, desc="demo", unit="run", disable=not opts.progress, dynamic_ncols=True)
    for seed, arm in bar:
        bar.set_description(f"seed {seed} {arm.label}")
        run_dir = out / "runs" / f"seed{seed}" / arm.name
        cfg = arm_config(p, arm, init.model_dir, Path(data.root), run_dir, seed, opts.progress)
        model, seconds = run_arm(cfg, validate)
        test = evaluate_model(model, data, scale=p.scale)
        entry = results.setdefault(arm.name, {"label": arm.label, "seeds": {}})
        entry["seeds"][seed] = {"test": _slim(test), "train": training_stats(run_dir), "seconds": seconds}
        if seed == 0:
            run_dirs[arm.name], geometry[arm.name] = run_dir, test["geometry"]  # short names: figure axis labels
        # what is measured survives an interrupted demo (demo.report can tabulate it: report.markdown_table)
        owned_files.write_text(out / "results.partial.json", json.dumps(results, indent=2, default=str) + "\n", "--out")
        bar.write(f"{arm.label} (seed {seed}): mean R@1 {test['mean_R@1']:.1f}, within-family "
                  f"{test['within_mean_R@1']:.1f}, MMVP {test['mmvp']:.1f}  [{seconds:.0f} s]")  # fmt: skip
    bar.close()
    return results, run_dirs, geometry


def paper_spread_plan(plan: list[Arm], init_test: dict[str, Any]) -> list[Arm]:
    """`plan` with the paper-spread arm's γ from the init's test captions (demo.plan.at_paper_spread); the margin in
    logits at γ 0.5 and at that γ printed beside the paper's."""
    margin = init_test["geometry"]["margin"]
    print(regime.margin_line(init_test), flush=True)
    gamma = margin["gamma_for_paper_spread"]
    if PAPER_SPREAD_ARM in {a.name for a in plan} and gamma is None:
        raise ValueError("the init's captions have no hardest-negative spread: the paper-spread arm has no γ")
    return at_paper_spread(plan, gamma) if gamma is not None else plan


def command_line(opts: DemoOptions) -> str:
    words = ["sharpclip demo", "--quick" * opts.quick, "--full" * opts.full, f"--seeds {opts.seeds}"]
    words += [f"--task {opts.task}" * (opts.task != DEFAULT_TASK)]
    words += [f"--arms {','.join(opts.only)}" * bool(opts.only), f"--steps {opts.steps}" * bool(opts.steps)]
    words += [f"--set {item}" for item in opts.sizes]
    return " ".join(w for w in words if w)


def run_demo(opts: DemoOptions) -> dict[str, Any]:
    """Everything of the module docstring; returns {"results", "claims", "files", "meta"}."""
    start = time.perf_counter()
    p = profile_for(opts)
    plan = select(opts)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    data, validation, data_seconds = prepare_data(p, out)
    sizes = f"{p.train_families} training scenes + {p.train_detail_pairs} detail pairs, {p.test_families} × 6 test, "
    sizes += f"{p.val_families} × 6 validation"
    print(f"SynthDense in {out}: {sizes}, {p.edits} edit pairs, MMVP pairs ({data_seconds:.0f} s)", flush=True)
    init = obtain_init(p, opts)
    validate = arm_validator(data, validation, p.micro_batch_size)
    validate_init = arm_validator(data, validation, p.micro_batch_size, math.log(p.scale))  # at the arms' scale
    inits = {}
    for name, model_dir, label, stage in (
        ("init_a", init.stage_a_dir, "stage-A init (coarse captions)", "stage_a"),
        ("init", init.model_dir, f"stage-A2 init (dense captions, {a2_details(p)}; every arm starts here)", "stage_a2"),
    ):
        model = create_model(ModelConfig(name=str(model_dir), context_length=p.context_length))
        test = evaluate_model(model, data, scale=p.scale)  # stretched as the arms start: no caption is truncated
        with torch.no_grad():
            before = validate_init(model)  # where the arms' validation curves start (the geometry verdicts' reference)
        record = {"test": test, "validation": before, "seconds": init.record[stage]["seconds"]}
        inits[name] = {"label": label, "seeds": {0: record}}
        print(f"{label}: mean R@1 {test['mean_R@1']:.1f}, within-family {test['within_mean_R@1']:.1f}", flush=True)
    plan = paper_spread_plan(plan, inits["init"]["seeds"][0]["test"])
    results, run_dirs, geometry = run_arms(p, plan, init, data, validate, opts, out)
    geometry = {"init": inits["init"]["seeds"][0]["test"]["geometry"], **geometry}
    for entry in inits.values():
        entry["seeds"][0]["test"] = _slim(entry["seeds"][0]["test"])
    results = {**inits, **results}
    figures = report.write_figures(results, run_dirs, geometry, out)
    qualitative = write_qualitative(run_dirs, data, out)  # InfoNCE vs HN-CLIP, the queries whose ranks differ most
    figures += [f for f in qualitative if f.suffix == ".png"]
    wise = {}
    if opts.full or opts.quick:  # WiSE-FT of the InfoNCE and HN-CLIP arms (seed 0) back towards the A2 init
        wise = wise_ft.curves(init.model_dir, run_dirs, data, WISE_ALPHAS[opts.quick], out)
        figures += [Path(f) for curve in wise.values() for f in curve["files"]]
    meta = {
        "command": command_line(opts),
        "task": opts.task,
        "profile": asdict(p),
        "arms": [a.name for a in plan],
        "seeds": opts.seeds,
        "init": {"dir": str(init.model_dir), "seconds": init.seconds, "reused": init.reused, **init.record},
        "data_seconds": data_seconds,
        "torch_threads": torch.get_num_threads(),
        "wall_seconds": time.perf_counter() - start,
    }
    files = report.write_report(results, meta, figures, out, wise)
    print("\n" + report.console_table(results) + "\n")
    for c in report.claims(results, wise):
        print(f"- {c['claim']}: {c['verdict']}\n    {c['measured']}")
    print(f"\nreport: {files[0]}  ({meta['wall_seconds']:.0f} s in all; figures and report.json beside it)")
    if qualitative:
        print(f"qualitative retrieval, InfoNCE vs HN-CLIP: {qualitative[0]}")
    owned_files.write_text(out / "demo_meta.json", json.dumps(meta, indent=2, default=str) + "\n", "--out")
    return {"results": results, "claims": report.claims(results, wise), "wise_ft": wise, "files": files + figures,
            "meta": meta}  # fmt: skip
