"""The index's build lock (`.sharpclip-index.lock`) is the one file sharpclip writes in place (its pid): a file of
that name that is not a lock of sharpclip's (a hard link to a user's file, a user's text) is refused in one line and
left byte-identical, never truncated."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sharpclip.analysis import index as ix
from sharpclip.owned_files import NotOurs


def test_a_lock_hard_linked_to_a_users_file_is_never_truncated(tmp_path: Path) -> None:
    thesis = tmp_path / "thesis.tex"
    thesis.write_text("years of work")
    folder = tmp_path / "idx"
    folder.mkdir()
    os.link(thesis, folder / ix.LOCK)
    with pytest.raises(NotOurs, match=r"\.sharpclip-index\.lock"), ix.BuildLock(folder):
        pass
    assert thesis.read_text() == "years of work"


def test_a_users_file_under_the_locks_name_is_never_truncated(tmp_path: Path) -> None:
    folder = tmp_path / "idx"
    folder.mkdir()
    (folder / ix.LOCK).write_text("my notes")
    with pytest.raises(NotOurs, match="not a lock sharpclip wrote"), ix.BuildLock(folder):
        pass
    assert (folder / ix.LOCK).read_text() == "my notes"


def test_sharpclips_own_lock_is_taken_again(tmp_path: Path) -> None:
    folder = tmp_path / "idx"
    folder.mkdir()
    (folder / ix.LOCK).write_text("12345\n")  # left by an earlier build
    with ix.BuildLock(folder):
        assert (folder / ix.LOCK).read_text() == f"{os.getpid()}\n"
