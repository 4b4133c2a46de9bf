"""The names a figure writer derives from a run's folder keep every part of it: a run folder with a dot in its name
(`lr1e-4.seed0`) gets figures of its own name, and two such runs never share (and overwrite) one figure."""

from __future__ import annotations

import json
from pathlib import Path

from sharpclip.analysis import plots
from sharpclip.analysis.run import analyze_runs


def _diagnostics(run: Path) -> None:
    run.mkdir(parents=True)
    rows = [{"step": 5 * k, "epoch": k // 2, "loss_infonce": 0.01, "loss_hn": 0.05, "grad_norm_infonce": 1e-3,
             "grad_norm_hn": 0.1, "grad_cosine": 0.5, "grad_zero_infonce": 0.0, "gbar_mean": 0.8}
            for k in range(4)]  # fmt: skip
    (run / "diagnostics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_figure_stem_with_a_dot_keeps_its_whole_name() -> None:
    assert plots.outputs("out/lr1e-4.seed0_gradient_dynamics") == [
        Path("out/lr1e-4.seed0_gradient_dynamics.png"),
        Path("out/lr1e-4.seed0_gradient_dynamics.json"),
    ]
    assert plots.outputs("out/convergence.png") == [Path("out/convergence.png"), Path("out/convergence.json")]


def test_two_runs_with_dotted_names_get_a_figure_each(tmp_path: Path) -> None:
    runs = [tmp_path / "lr.1", tmp_path / "lr.2"]
    for run in runs:
        _diagnostics(run)
    written = analyze_runs(runs, tmp_path / "out")
    names = sorted(p.name for p in written)
    assert names == ["lr.1_gradient_dynamics.json", "lr.1_gradient_dynamics.png", "lr.2_gradient_dynamics.json",
                     "lr.2_gradient_dynamics.png"]  # fmt: skip
    assert all(p.is_file() for p in written)
