"""One table across models (eval.table; `sharpclip eval --model A --model B`, `sharpclip eval-table`): a row per
model with each suite's headline figures as columns, and the per-subset figures in a second table."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from sharpclip.cli import main
from sharpclip.eval.table import detail, headline, read_report, short_labels, tables, write_tables

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "data"
RETRIEVAL = {"task": "retrieval", "t2i": {"R@1": 40.0, "R@5": 80.0, "mean_rank": 3.5},
             "i2t": {"R@1": 50.0, "R@5": 90.0}, "images": 10, "captions": 10, "skipped": 0}  # fmt: skip
SPEC = {"task": "spec", "items": 28, "i2t": {"count": 25.0, "existence": 75.0}, "i2t_mean": 50.0,
        "i2t_items": {"count": 4, "existence": 4}, "t2i": {"count": 10.0, "existence": 30.0}, "t2i_mean": 20.0,
        "mean": 35.0, "skipped": 0}  # fmt: skip


def test_headline_columns_of_a_retrieval_and_a_pair_suite() -> None:
    assert headline("docci", RETRIEVAL) == {"docci T→I R@1": 40.0, "docci I→T R@1": 50.0, "docci mean R@1": 45.0}
    assert headline("spec", SPEC) == {"spec i2t_mean": 50.0, "spec t2i_mean": 20.0, "spec mean": 35.0}  # no counts
    assert detail("spec", SPEC) == {"spec i2t: count": 25.0, "spec i2t: existence": 75.0, "spec t2i: count": 10.0,
                                    "spec t2i: existence": 30.0}  # fmt: skip
    assert detail("docci", RETRIEVAL)["docci t2i: mean_rank"] == 3.5


def test_tables_put_a_row_per_model_and_leave_missing_suites_empty(tmp_path: Path) -> None:
    reports = [("hn", {"docci": RETRIEVAL, "spec": SPEC}), ("infonce", {"docci": {**RETRIEVAL, "t2i": {"R@1": 10.0},
                                                                                   "i2t": {"R@1": 20.0}}})]  # fmt: skip
    written = write_tables(reports, tmp_path / "t")
    assert [p.name for p in written] == ["eval_table.csv", "eval_table.md", "eval_table_detail.csv",
                                         "eval_table_detail.md", "eval_long.csv", "eval_grouped.csv",
                                         "eval_grouped.md"]  # fmt: skip
    rows = list(csv.DictReader(written[0].open()))
    assert [r["model"] for r in rows] == ["hn", "infonce"]
    assert float(rows[1]["docci mean R@1"]) == 15.0 and rows[1]["spec mean"] == "" and float(rows[0]["spec mean"]) == 35
    md = written[1].read_text().splitlines()
    assert md[0].startswith("| model | docci T→I R@1 |") and md[3].endswith("| 15.00 | – | – | – |")
    detail_rows = {r["metric"]: r for r in csv.DictReader(written[2].open())}
    assert detail_rows["spec i2t: count"] == {"metric": "spec i2t: count", "hn": "25.0", "infonce": ""}
    with pytest.raises(ValueError, match="same label"):
        write_tables([("a", {}), ("a", {})], tmp_path / "u")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "eval_table.csv").write_text("my own table\n")
    with pytest.raises(ValueError, match="did not write"):
        write_tables(reports, tmp_path / "mine")  # a user's file is never replaced
    assert (tmp_path / "mine" / "eval_table.csv").read_text() == "my own table\n"
    assert set(tables(reports)) == {p.name for p in written}


def test_short_labels_and_reading_a_run_directory(tmp_path: Path) -> None:
    assert short_labels(["runs/x/hn", "runs/x/infonce"]) == ["hn", "infonce"]
    assert short_labels(["s0/hn", "s1/hn"]) == ["s0/hn", "s1/hn"]
    for step in ("step-000004", "step-000010"):
        folder = tmp_path / "run" / "eval" / step
        folder.mkdir(parents=True)
        (folder / "eval_report.json").write_text(json.dumps({"spec": {**SPEC, "mean": float(step[-2:])}}))
    assert read_report(tmp_path / "run")["spec"]["mean"] == 10.0  # the newest evaluated checkpoint
    with pytest.raises(ValueError, match=r"no eval_report\.json"):
        read_report(tmp_path)


def test_cli_eval_several_models_writes_one_table(tmp_path: Path, capsys) -> None:
    out = tmp_path / "ev"
    args = ["eval", "--model", "tiny-clip", "--model", "tiny-siglip", "--suite", "spec,docci", "--data-root",
            str(FIXTURES), "--out", str(out), "eval.progress=false"]  # fmt: skip
    assert main(args) == 0
    assert "| model | spec i2t_mean | spec t2i_mean | spec mean | docci T→I R@1 |" in capsys.readouterr().out
    rows = list(csv.DictReader((out / "eval_table.csv").open()))
    assert [r["model"] for r in rows] == ["tiny-clip", "tiny-siglip"]
    for row in rows:  # each row holds that model's own report's figures
        report = json.loads((out / row["model"] / "eval_report.json").read_text())
        assert float(row["spec mean"]) == report["spec"]["mean"]
        assert float(row["docci T→I R@1"]) == report["docci"]["t2i"]["R@1"]
    detail_rows = list(csv.DictReader((out / "eval_table_detail.csv").open()))
    assert len(detail_rows) == 12 + 14  # SPEC's 6 subsets both ways; docci's 5 R@K + 2 ranks both ways
    assert main(["eval-table", str(out / "tiny-clip"), str(out / "tiny-siglip"), "--label", "A", "--label", "B",
                 "--out", str(tmp_path / "t")]) == 0  # fmt: skip
    again = list(csv.DictReader((tmp_path / "t" / "eval_table.csv").open()))
    assert [r["model"] for r in again] == ["A", "B"] and again[0]["spec mean"] == rows[0]["spec mean"]


def test_cli_eval_several_models_needs_a_folder_for_non_runs(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    args = ["eval", "--model", "tiny-clip", "--model", "tiny-siglip", "--suite", "spec", "--data-root", str(FIXTURES)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--model tiny-clip: not a run directory, so its report needs a folder: give --out DIR" in err
    assert not any(tmp_path.iterdir())  # refused before anything was evaluated or written


def _study_run(root: Path, name: str, overrides: list[str], r1: float) -> Path:
    from sharpclip.config import load_config, to_yaml

    run = root / name
    (run / "eval" / "step-000004").mkdir(parents=True)
    (run / "config.yaml").write_text(to_yaml(load_config(None, [*overrides, f"train.output_dir={run}"])))
    report = {"docci": {**RETRIEVAL, "t2i": {"R@1": r1}, "i2t": {"R@1": r1 + 10.0}}}
    (run / "eval" / "step-000004" / "eval_report.json").write_text(json.dumps(report))
    return run


def test_a_study_gives_one_long_table_with_the_runs_settings_that_pandas_pivots(tmp_path: Path) -> None:
    pd = pytest.importorskip("pandas")  # the [dev] extra
    hn = "loss.terms:={hn: {loss: hn_clip, params: {gamma: 0.5}}}"
    runs = [_study_run(tmp_path, f"{arm}_s{seed}", [*over, f"train.seed={seed}", "data.train_fraction=0.5"], r1)
            for arm, over, base in (("clip", [], 20.0), ("hn", [hn], 30.0))
            for seed, r1 in ((0, base), (1, base + 2.0))]  # fmt: skip
    assert main(["eval-table", *map(str, runs), "--out", str(tmp_path / "t")]) == 0
    long = pd.read_csv(tmp_path / "t" / "eval_long.csv")
    assert len(long) == 4 * 5  # a row per run, suite and metric: 3 headline figures + R@1 each way (the detail)
    assert set(long.columns) >= {"run", "objective", "fraction", "seed", "step", "model", "data", "recipe_sha256",
                                 "suite", "metric", "value"}  # fmt: skip
    wide = long.pivot_table(index=["objective", "fraction"], columns="metric", values="value", aggfunc="mean")
    assert wide.loc[("infonce", 0.5), "T→I R@1"] == 21.0 and wide.loc[("hn_clip γ=0.5", 0.5), "T→I R@1"] == 31.0
    assert set(long["step"]) == {4} and set(long["seed"]) == {0, 1}
    assert long.groupby("objective")["recipe_sha256"].nunique().tolist() == [1, 1]  # the seed is not in the digest
    grouped = pd.read_csv(tmp_path / "t" / "eval_grouped.csv")
    assert grouped["n"].tolist() == [2, 2] and grouped["seeds"].tolist() == ["0 1", "0 1"]
    row = grouped.set_index("objective").loc["hn_clip γ=0.5"]
    assert row["docci T→I R@1 mean"] == 31.0 and row["docci T→I R@1 std"] == pytest.approx(2**0.5)
    assert "| 31.00 ± 1.41 |" in (tmp_path / "t" / "eval_grouped.md").read_text()
