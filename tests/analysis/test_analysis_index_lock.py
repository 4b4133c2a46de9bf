"""The index folder's files that are not chunks: the build lock (`.sharpclip-index.lock`) is the one file sharpclip
writes in place (its pid), so a file of that name that is not a lock of sharpclip's (a hard link to a user's file, a
user's text) is refused in one line and left byte-identical, never truncated; `--rebuild` checks every file before it
deletes the first (a linked chunk refuses it whole); a linked manifest and a damaged `.sharpclip-files.json` are
named for what they are."""

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


def _built(tmp_path: Path) -> Path:
    from PIL import Image

    from sharpclip.cli import main

    images = tmp_path / "es"
    images.mkdir()
    for i in range(3):
        Image.new("RGB", (32, 32), (60 * i, 80, 120)).save(images / f"{i}.jpg")
        (images / f"{i}.txt").write_text(f"square {i}")
    assert main(["search", "--model", "tiny-clip", "--images", str(images), "--index", str(tmp_path / "idx"),
                 "eval.progress=false"]) == 0  # fmt: skip
    (manifest,) = (tmp_path / "idx").rglob(ix.MANIFEST)
    return manifest.parent


def test_a_refused_rebuild_deletes_nothing_and_a_linked_manifest_is_named_a_link(tmp_path: Path, capsys) -> None:
    from sharpclip.cli import main

    folder = _built(tmp_path)
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes((folder / "image-00000.safetensors").read_bytes())
    (folder / "image-00000.safetensors").unlink()
    (folder / "image-00000.safetensors").symlink_to(copy)
    before = sorted(p.name for p in folder.iterdir())
    argv = ["search", "--model", "tiny-clip", "--images", str(tmp_path / "es"), "--index", str(tmp_path / "idx")]
    capsys.readouterr()
    assert main([*argv, "--rebuild"]) == 2
    err = capsys.readouterr().err
    assert "symbolic link" in err and "another --index" in err
    assert sorted(p.name for p in folder.iterdir()) == before  # the manifest is still there: nothing deleted
    (folder / "image-00000.safetensors").unlink()
    (folder / "image-00000.safetensors").write_bytes(copy.read_bytes())
    (folder / ix.MANIFEST).rename(tmp_path / "manifest.json")
    (folder / ix.MANIFEST).symlink_to(tmp_path / "manifest.json")
    assert main([*argv, "--text", "square"]) == 2
    assert "manifest.json is a symbolic link" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["garbage", "folder"])
def test_a_damaged_record_is_named_by_a_query_and_by_rebuild(tmp_path: Path, damage: str, capsys) -> None:
    from sharpclip.cli import main
    from sharpclip.owned_files import REGISTRY

    folder = _built(tmp_path)
    (folder / REGISTRY).unlink()
    (folder / REGISTRY).mkdir() if damage == "folder" else (folder / REGISTRY).write_text("garbage{")
    before = sorted(p.name for p in folder.iterdir())
    argv = ["search", "--model", "tiny-clip", "--images", str(tmp_path / "es"), "--index", str(tmp_path / "idx")]
    capsys.readouterr()
    for extra in (["--text", "square"], ["--rebuild"]):
        assert main([*argv, *extra]) == 2
        err = capsys.readouterr().err
        assert f"{REGISTRY}: not sharpclip's record of its files" in err and err.count("\n") == 1, err
    assert sorted(p.name for p in folder.iterdir()) == before
