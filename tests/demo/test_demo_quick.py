"""End to end: `sharpclip demo --quick` completes on CPU and its report has a row for every objective.

This is the CI run of the demo (the quick sizes take about a minute on 2 cores, pre-training included); it asserts
completion and the report's shape, and that the seed-0 figures are the pinned ones (tests/fixtures/demo_headline.json):
not because they mean anything at this size, but so that a change of the demo's outcome is seen and the docs' figures
rerun with it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _support.html_pages import check_page
from sharpclip.cli import main
from sharpclip.demo import DemoOptions, profile_for, select
from sharpclip.demo.stages import ensure_init

PINNED = Path(__file__).resolve().parents[1] / "fixtures" / "demo_headline.json"


def check_pinned(report: dict) -> None:
    """The quick demo's seed-0 figures are the pinned ones (tests/fixtures/demo_headline.json, within tolerances that
    float noise does not cross): a change that moves them changes the demo's outcome, and the docs' figures with it."""
    pinned = json.loads(PINNED.read_text())
    quick, tol = pinned["quick"], pinned["quick"]["tolerance"]
    rerun = f"the demo's outcome changed: {pinned['about'].split('. Then ', 1)[1]}"
    got = {"stage_a_final_loss": report["meta"]["init"]["stage_a"]["final_loss"]}
    want = {"stage_a_final_loss": quick["stage_a_final_loss"]}
    for arm, figures in quick["figures"].items():
        seed = report["results"][arm]["seeds"]["0"]
        for key, value in figures.items():
            got[f"{arm} {key}"] = seed["train" if key == "final_loss" else "test"][key]
            want[f"{arm} {key}"] = value
    for key, value in want.items():
        if key.endswith("final_loss"):
            close = got[key] == pytest.approx(value, rel=tol["final_loss_rel"])
        else:
            close = got[key] == pytest.approx(value, abs=tol["pairwise_sim_abs" if "sim" in key else "recall_abs"])
        assert close, f"{key}: {got[key]!r}, pinned {value!r}; {rerun}"


@pytest.mark.slow
def test_demo_quick_writes_every_row(tmp_path, capsys):
    out, cache = tmp_path / "demo", tmp_path / "cache"
    assert main(["demo", "--quick", "--out", str(out), "--cache", str(cache), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "pre-training the strong initialisation" in printed
    assert "  stage_a: training 24 steps" in printed and "  stage_a2: done in " in printed  # a line per stage
    report = json.loads((out / "report.json").read_text())
    check_pinned(report)
    markdown = (out / "report.md").read_text()
    for arm in select(DemoOptions(quick=True)):  # both papers' objectives: InfoNCE, HN-CLIP, CLIP-IN
        assert arm.name in report["results"], arm.name
        assert f"| {arm.label} |" in markdown, arm.label
        assert arm.label in printed
        # a line as each arm starts and as it ends, even without the bar (--no-progress, a redirected stdout)
        assert f"{arm.label} (seed 0): training " in printed and f"{arm.label} (seed 0): done, mean R@1" in printed
        seed = report["results"][arm.name]["seeds"]["0"]
        assert {"t2i_R@1", "i2t_R@10", "within_mean_R@1", "mmvp", "pairwise_sim"} <= set(seed["test"])
        assert 0 <= seed["test"]["zeroshot_top1"] <= 100 and seed["test"]["zeroshot_images"] == 64  # the guard
    assert len(report["claims"]) >= 8
    # WiSE-FT of the InfoNCE and HN-CLIP arms: α = 1 is the fine-tuned arm itself, α = 0 the init
    for arm in ("infonce", "hn"):
        curve = report["wise_ft"][arm]
        assert [p["alpha"] for p in curve["points"]] == [0.0, 0.5, 1.0]
        end = report["results"][arm]["seeds"]["0"]["test"]
        assert curve["points"][-1]["target"] == pytest.approx(end["mean_R@1"], abs=1e-6)
        assert curve["points"][-1]["guards"]["zeroshot/top1"] == pytest.approx(end["zeroshot_top1"], abs=1e-6)
        assert curve["points"][0]["deltas"]["zeroshot/top1"] == 0.0
        assert (out / f"wise_ft_{arm}" / "wise_ft.png").stat().st_size > 0
        assert f"wise_ft_{arm}/wise_ft.png" in markdown
    # the qualitative page, InfoNCE vs HN-CLIP: self-contained, its figure linked from report.md
    page = check_page(out / "compare_infonce_hn" / "compare.html")
    assert page.title == "Qualitative retrieval: InfoNCE vs HN-CLIP on SynthDense test" and page.images
    assert "compare_infonce_hn/compare.png" in markdown and "compare_infonce_hn" in printed
    for figure in ("gradient_dynamics", "convergence", "geometry", "caption_similarity", "geometry_along_training"):
        assert (out / f"{figure}.png").stat().st_size > 0, figure
    # the regime check of the init and the geometry along training, per arm, in both report files
    assert "## Regime check" in markdown and "| HN-CLIP Fig. 1: Long-CLIP-L, DOCCI | 0.84 | 0.93 | – |" in markdown
    # the boost in the paper's units at the arms' scale, printed before the arms run and in the regime check
    assert "the init's boost spreads" in markdown and "the init's boost spreads" in printed
    margin = report["results"]["init"]["seeds"]["0"]["test"]["geometry"]["margin"]
    assert margin["scale"] == report["meta"]["profile"]["scale"] and "0.5" in margin["per_gamma"]
    check = report["regime_check"]
    assert {"sat_micro_twin", "sat_micro_plain", "caption_pairwise"} <= set(
        report["results"]["init"]["seeds"]["0"]["validation"]
    )
    assert check["pairwise_sim"]["value"] == report["results"]["init"]["seeds"]["0"]["test"]["pairwise_sim"]
    for arm in ("infonce", "hn"):
        train = report["results"][arm]["seeds"]["0"]["train"]
        assert len(train["geometry_curve"]["pairwise"]) == len(train["geometry_curve"]["epoch"]) >= 1
        assert report["geometry_along_training"][arm]["verdict"].startswith(("kept", "reshaped"))
        assert 0 <= train["sat_twin_ep1"] <= 100 and 0 <= train["sat_plain_ep1"] <= 100
    # a second demo finds the cached initialisation instead of pre-training again
    init = ensure_init(profile_for(DemoOptions(quick=True)), cache, progress=False)  # the default task
    assert init.reused and init.model_dir.is_dir() and init.seconds == report["meta"]["init"]["seconds"]
