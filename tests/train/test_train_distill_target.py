"""`sharpclip distill --to DIR` writes the student's checkpoint only into a new or empty folder: a folder holding
the user's files (or a checkpoint's own names: config.json, model.safetensors), a file or a link there is refused in
one line before anything is trained, and left byte-identical."""

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


def _distill(tmp_path: Path, to: Path) -> int:
    captions = tmp_path / "captions.txt"
    captions.write_text("a red square\na blue circle\n")
    return main(["distill", "--captions", str(captions), "--to", str(to), f"train.output_dir={tmp_path / 'run'}"])


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
