"""`sharpclip distill --to DIR` writes the student's checkpoint only into a new or empty folder: a folder holding
the user's files (or a checkpoint's own names: config.json, model.safetensors), a file or a link there is refused in
one line before anything is trained, and left byte-identical. Its `train.output_dir` is a run directory kept as
`sharpclip train` keeps one: a user's folder is never written into, an earlier distillation's only with --overwrite."""

from __future__ import annotations

from pathlib import Path

import pytest

import sharpclip.train.distill as distill_module
from sharpclip.cli import main


@pytest.fixture
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    def trained(*args: object, **kwargs: object) -> None:
        raise AssertionError("distill trained before refusing its --to")

    monkeypatch.setattr(distill_module, "distill", trained)


def _distill(tmp_path: Path, to: Path, *flags: str) -> int:
    captions = tmp_path / "captions.txt"
    captions.write_text("a red square\na blue circle\n")
    run = f"train.output_dir={tmp_path / 'run'}"
    return main(["distill", "--captions", str(captions), "--to", str(to), run, *flags])


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "notes.txt"])
def test_a_users_file_in_the_target_is_refused_before_training(tmp_path: Path, no_training: None, name: str, capsys):
    to = tmp_path / "student"
    to.mkdir()
    (to / name).write_text("the user's own\n")
    assert _distill(tmp_path, to) == 2
    assert name in capsys.readouterr().err and (to / name).read_text() == "the user's own\n"


def test_a_linked_target_is_refused(tmp_path: Path, no_training: None, capsys) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (tmp_path / "student").symlink_to(mine)
    assert _distill(tmp_path, tmp_path / "student") == 2
    assert "symbolic link" in capsys.readouterr().err and list(mine.iterdir()) == []


@pytest.fixture
def quick_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The distillation itself replaced by what it leaves in the run directory."""

    def run(cfg, captions, out_dir, ctx) -> str:
        (Path(cfg.train.output_dir) / "train.log").write_text("trained\n")
        return "distilled"

    monkeypatch.setattr(distill_module, "_distill_run", run)


def test_a_users_folder_as_train_output_dir_is_refused_and_left_as_it_was(tmp_path: Path, no_training: None, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("the user's own\n")
    assert _distill(tmp_path, tmp_path / "student") == 2
    assert "not a sharpclip run directory" in capsys.readouterr().err
    assert [p.name for p in run.iterdir()] == ["config.yaml"] and (
        run / "config.yaml"
    ).read_text() == "the user's own\n"


def test_an_earlier_distillation_is_replaced_only_with_overwrite(tmp_path: Path, quick_run: None, capsys) -> None:
    assert _distill(tmp_path, tmp_path / "first") == 0
    assert (tmp_path / "run" / ".sharpclip-run").is_file() and (tmp_path / "run" / "train.log").is_file()
    capsys.readouterr()
    assert _distill(tmp_path, tmp_path / "second") == 2
    refusal = capsys.readouterr().err
    assert "replace it with `--overwrite`" in refusal and "--resume" not in refusal  # distill cannot resume
    (tmp_path / "run" / "mine.txt").write_text("the user's own\n")
    assert _distill(tmp_path, tmp_path / "second", "--overwrite") == 2  # a file a run does not write: refused
    assert "mine.txt" in capsys.readouterr().err and (tmp_path / "run" / "mine.txt").is_file()
    (tmp_path / "run" / "mine.txt").unlink()
    assert _distill(tmp_path, tmp_path / "second", "--overwrite") == 0
