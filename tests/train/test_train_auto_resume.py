"""`sharpclip train RECIPE --resume auto`: starts an empty train.output_dir, continues the run it holds with the
refusals of `--resume`, starts over a run stopped before its first checkpoint, exits 0 on a finished run, and a run
stopped by a signal exits 75 (train.auto_resume, train.stop)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from _support.tiny_files import write_generic
from sharpclip.cli import main
from sharpclip.train import checkpoint, run_dir
from sharpclip.train.stop import STOPPED_EXIT


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_generic(tmp_path_factory.mktemp("data"))


def _args(data: Path, run: Path, *extra: str) -> list[str]:
    return ["train", "--resume", "auto", "model.name=tiny-clip", "data.format=generic", f"data.root={data}",
            "data.num_workers=0", f"train.output_dir={run}", "train.batch_size=4", "train.micro_batch_size=4",
            "train.max_steps=3", "train.epochs=1", "train.lr=1e-3", "train.eval_every=0", "train.progress=false",
            "train.log_every=0", *extra]  # fmt: skip


def _steps(run: Path) -> list[int]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if "loss" in r]


def test_auto_starts_continues_after_a_stop_signal_and_then_says_finished(data, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setenv("SHARPCLIP_SIGNAL", "step:1:SIGTERM")
    assert main(_args(data, run)) == STOPPED_EXIT  # started: the directory did not exist
    assert "stopped by a signal after step 2; checkpoint step-000002 written" in capsys.readouterr().out
    assert [p.name for p in checkpoint.all_checkpoints(run / "checkpoints")] == ["step-000002"]
    monkeypatch.delenv("SHARPCLIP_SIGNAL")
    assert main(_args(data, run)) == 0  # the same command continues it
    assert "trained 3 steps" in capsys.readouterr().out
    assert _steps(run) == [1, 2, 3]
    assert json.loads((run / "resumes.jsonl").read_text())["checkpoint"] == "step-000002"
    assert main(_args(data, run)) == 0  # and once more: finished, nothing written
    assert f"{run} already finished at step 3" in capsys.readouterr().out
    assert len((run / "resumes.jsonl").read_text().splitlines()) == 1


def test_auto_refuses_a_run_of_another_config_as_resume_does(data, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(_args(data, run, "train.max_steps=1")) == 0
    capsys.readouterr()
    assert main(_args(data, run, "train.max_steps=1", "train.seed=7")) == 2
    assert "these settings cannot change on resume (train.seed: 0 → 7)" in capsys.readouterr().err


def test_auto_starts_over_a_run_that_stopped_before_its_first_checkpoint(data, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    run_dir.write_marker(run)  # killed during start-up: the marker, no config.yaml, no checkpoint
    (run / "train.log").write_text("the killed start\n")
    assert main(_args(data, run, "train.max_steps=1")) == 0
    assert "starting it over" in capsys.readouterr().err
    assert "the killed start" not in (run / "train.log").read_text()


def test_auto_leaves_a_folder_that_is_not_a_run_alone(data, tmp_path, capsys):
    run = tmp_path / "mine"
    run.mkdir()
    (run / "notes.txt").write_text("mine\n")
    assert main(_args(data, run)) == 2
    assert "is not a sharpclip run directory" in capsys.readouterr().err
    assert (run / "notes.txt").read_text() == "mine\n"


def test_auto_refuses_a_run_whose_checkpoints_are_gone_and_never_empties_it(data, tmp_path, capsys):
    """Matrix 6 A5: a finished run whose checkpoints were archived was taken for one "stopped before its first
    checkpoint" and retrained from scratch, deleting its metrics and logs."""
    run = tmp_path / "run"
    assert main(_args(data, run, "train.max_steps=2", "train.checkpoint_every=1")) == 0
    for step in (run / "checkpoints").glob("step-*"):
        shutil.rmtree(step)  # moved to archive storage
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(_args(data, run, "train.max_steps=2", "train.checkpoint_every=1")) == 2
    err = capsys.readouterr().err
    assert "checkpoint step-000002 written" in err and "metrics.jsonl records 2 steps" in err, err
    assert "starting it over" not in err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_auto_refuses_a_run_whose_checkpoints_are_all_marked_diverged_naming_them(data, tmp_path, capsys):
    """A run whose only checkpoint made training fail (marked diverged) was told its checkpoints "were moved or
    deleted"; it is told which checkpoint is there and why it is not resumed, and nothing changes."""
    run = tmp_path / "run"
    assert main(_args(data, run, "train.max_steps=2", "train.checkpoint_every=2", "train.keep_last=1")) == 0
    checkpoint.mark_diverged(run / "checkpoints" / "step-000002", "every step after the update of step 2 failed")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(_args(data, run, "train.max_steps=2", "train.checkpoint_every=2", "train.keep_last=1")) == 2
    err = capsys.readouterr().err
    assert "step-000002 is marked diverged" in err and "moved or deleted" not in err, err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
