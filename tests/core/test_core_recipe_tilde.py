"""A recipe path given as a command's CONFIG_OR_OVERRIDE word expands `~` like every path flag, also quoted
(`sharpclip config '~/recipe.yaml'`), instead of "config file not found"."""

from __future__ import annotations

from pathlib import Path

import pytest

from sharpclip.cli import main
from sharpclip.config import split_args


def test_a_quoted_tilde_recipe_is_read_from_the_home_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "recipe.yaml").write_text("train:\n  lr: 0.000321\n")
    assert split_args(["~/recipe.yaml", "train.epochs=2"]) == ([str(tmp_path / "recipe.yaml")], ["train.epochs=2"])
    assert main(["config", "~/recipe.yaml"]) == 0
    assert "0.000321" in capsys.readouterr().out
