"""`sharpclip analyze` is one subcommand per analysis (dynamics, sample-efficiency, geometry, near-duplicates,
feature-map), each with its own flags; the caption analyses read the data as `eval` does (recipes, data.*
overrides), so a user's own CSV works; the old flag spelling still runs, after a one-line notice naming the new one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from _support.finetuned_run import finetuned_run, init_checkpoint
from sharpclip.cli import main, old_analyze

CAPTIONS = [
    "a small red circle on a grey background",
    "a small red square on a grey background",
    "a large blue circle on a beige background",
    "a large green triangle on a beige background",
] * 2


def _own_csv(root: Path) -> Path:
    """open_clip's CSV layout (filepath,title), a train split only: what `analyze --geometry` could not read."""
    (root / "images").mkdir(parents=True)
    rows = ["filepath,title"]
    for i, caption in enumerate(CAPTIONS):
        Image.new("RGB", (24, 16), (30 * i, 90, 160)).save(root / "images" / f"{i}.jpg")
        rows.append(f"images/{i}.jpg,{caption}")
    (root / "train.csv").write_text("\n".join(rows) + "\n")
    return root


def test_analyze_geometry_and_near_duplicates_read_a_users_csv_and_a_run_directory(tmp_path: Path, capsys) -> None:
    root = _own_csv(tmp_path / "mine")
    run = tmp_path / "run"
    finetuned_run(run, init_checkpoint(tmp_path / "init"), context=None)
    data = ["data.format=generic", f"data.root={root}", "data.eval_split=train", "data.image_field=filepath",
            "data.caption_field=title", "eval.progress=false"]  # fmt: skip
    out = tmp_path / "figs"
    assert main(["analyze", "geometry", "--model", str(run), *data, "--out", str(out)]) == 0
    stats = json.loads((out / "caption_geometry_stats.json").read_text())
    assert list(stats) == ["retrieval"] and stats["retrieval"]["captions"] == len(CAPTIONS)
    assert main(["analyze", "near-duplicates", *data, "--model", str(run), "--pairs", "2", "--out", str(out)]) == 0
    pairs = json.loads((out / "near_duplicates.json").read_text())["retrieval"]
    assert pairs["same_text"] == 4 and len(pairs["most_similar"]) == 2  # each caption appears twice
    assert all(row["a"] in CAPTIONS and row["b"] in CAPTIONS for row in pairs["most_similar"])
    capsys.readouterr()
    assert main(["analyze", "geometry", "--model", str(run), "data.format=generic", f"data.root={root}",
                 "--out", str(tmp_path / "x")]) == 2  # fmt: skip
    assert "no test.jsonl, test.csv or test.tsv" in capsys.readouterr().err  # the split, named in one line


def test_old_analyze_spelling_maps_to_the_new_subcommands() -> None:
    assert old_analyze(["analyze", "runs/a", "runs/b", "--out", "f"]) == [["analyze", "dynamics", "runs/a", "runs/b",
                                                                            "--out", "f"]]  # fmt: skip
    assert old_analyze(["analyze", "--sample-efficiency", "r1", "r2"]) == [["analyze", "sample-efficiency", "r1", "r2"]]
    assert old_analyze(["analyze", "--geometry", "docci", "--model", "M", "--pairs", "3"]) == [
        ["analyze", "geometry", "--suite", "docci", "--model", "M"],
        ["analyze", "near-duplicates", "--suite", "docci", "--model", "M", "--pairs", "3"],
    ]
    assert old_analyze(["--debug", "analyze", "--feature-map=x.png", "--text", "red", "--model", "A"]) == [
        ["--debug", "analyze", "feature-map", "x.png", "--text", "red", "--model", "A"]
    ]
    assert old_analyze(["analyze", "geometry", "--suite", "docci"]) is None  # already the new spelling
    assert old_analyze(["eval", "--model", "x"]) is None and old_analyze(["analyze", "--bogus"]) is None


def test_old_analyze_spelling_runs_with_a_one_line_notice(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run_a"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"epoch": 0, "docci/t2i/R@1": 50.0}) + "\n")
    assert main(["analyze", str(run), "--out", str(tmp_path / "old")]) == 0
    err = capsys.readouterr().err.splitlines()
    notices = [line for line in err if "deprecated" in line]
    assert len(notices) == 1 and f"sharpclip analyze dynamics {run} --out {tmp_path / 'old'}" in notices[0]
    assert main(["analyze", "dynamics", str(run), "--out", str(tmp_path / "new")]) == 0
    assert "deprecated" not in capsys.readouterr().err
    assert (tmp_path / "old" / "convergence.md").read_text() == (tmp_path / "new" / "convergence.md").read_text()
    assert main(["analyze", "--out", str(tmp_path / "none")]) == 2
    assert "give an analysis: sharpclip analyze {dynamics,sample-efficiency" in capsys.readouterr().err


@pytest.mark.parametrize("analysis", ["dynamics", "sample-efficiency", "geometry", "near-duplicates", "feature-map"])
def test_each_analysis_has_its_own_help(analysis: str, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main(["analyze", analysis, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert f"usage: sharpclip analyze {analysis}" in text and "--out" in text
    assert ("CONFIG_OR_OVERRIDE" in text) == (analysis in ("geometry", "near-duplicates"))
