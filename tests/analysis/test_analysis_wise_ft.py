"""`sharpclip blend --sweep`: the trade-off curve over α on a real suite, guards against α = 0, the picked α."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from _support.finetuned_run import finetuned_run, init_checkpoint
from sharpclip.analysis.wise_ft import parse_alphas
from sharpclip.cli import main
from sharpclip.config import EvalConfig
from sharpclip.eval.guards import suites_for
from sharpclip.eval.suite import run_suite

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "data"


def test_sweep_writes_curve_and_picks_a_guarded_alpha(tmp_path: Path, capsys) -> None:
    init = init_checkpoint(tmp_path / "init")
    tuned, _ = finetuned_run(tmp_path / "run", init)
    shutil.copytree(FIXTURES / "urban1k", tmp_path / "urban1k")
    out = tmp_path / "wise"
    config = [f"eval.roots.urban1k={tmp_path / 'urban1k'}", "eval.progress=false", "eval.recall_k=[1,5]"]
    base = ["blend", str(init), str(tmp_path / "run"), *config, "--sweep", "0,0.5,1"]
    guards = ["--guard", "urban1k/t2i/R@5:100", "--guard", "urban1k/i2t/mean_rank"]
    assert main([*base, "--to", str(out), "--target", "urban1k/mean_R@1", *guards]) == 0
    curve = json.loads((out / "wise_ft.json").read_text())
    assert [p["alpha"] for p in curve["points"]] == [0.0, 0.5, 1.0]
    assert all(d == 0.0 for d in curve["points"][0]["deltas"].values())  # guards are measured against α = 0
    cfg = EvalConfig(suites=["urban1k"], roots={"urban1k": str(tmp_path / "urban1k")}, recall_k=[1, 5], progress=False)
    direct = run_suite(tuned, cfg).results["urban1k"]
    assert curve["points"][-1]["target"] == pytest.approx((direct["t2i"]["R@1"] + direct["i2t"]["R@1"]) / 2)
    assert curve["points"][-1]["guards"]["urban1k/i2t/mean_rank"] == pytest.approx(direct["i2t"]["mean_rank"])
    targets = [p["target"] for p in curve["points"]]
    assert curve["best_alpha"] == curve["points"][targets.index(max(targets))]["alpha"]  # a floor of 100 holds
    assert (out / "wise_ft.png").stat().st_size > 0 and (out / "best_alpha" / "model.safetensors").is_file()
    capsys.readouterr()
    assert main([*base, "--to", str(tmp_path / "w2")]) == 2
    assert "needs --target" in capsys.readouterr().err


def test_alpha_lists_and_suites() -> None:
    assert parse_alphas("1, 0,0.5,0.5") == [0.0, 0.5, 1.0]
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        parse_alphas("0,1.2")
    with pytest.raises(ValueError, match="comma-separated"):
        parse_alphas("0;1")
    assert suites_for(["docci/mean_R@1", "zeroshot/top1", "docci/t2i/R@5"]) == ["docci", "zeroshot"]
