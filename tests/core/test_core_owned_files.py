"""owned_files: sharpclip replaces or deletes only the files it wrote (its registry), never through a link."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sharpclip import owned_files as of


def test_a_file_sharpclip_wrote_is_replaced_and_a_users_file_is_refused(tmp_path: Path):
    page = of.write_text(tmp_path / "p.html", "one", "--html")
    assert of.is_ours(page) and of.record(page)["size"] == 3
    of.write_text(page, "two", "--html")  # ours: replaced
    assert page.read_text() == "two"
    (tmp_path / "notes.txt").write_text("my notes")
    with pytest.raises(of.NotOurs, match=r"notes.txt exists and sharpclip did not write it.*choose another --html"):
        of.write_text(tmp_path / "notes.txt", "page", "--html")
    assert (tmp_path / "notes.txt").read_text() == "my notes"


def test_a_file_edited_since_sharpclip_wrote_it_is_not_replaced(tmp_path: Path):
    path = of.write_text(tmp_path / "r.json", "{}", "--out")
    path.write_text('{"mine": 1}')
    os.utime(path, ns=(1, 1))
    with pytest.raises(of.NotOurs, match="changed since sharpclip wrote it"):
        of.write_text(path, "{}", "--out")
    with pytest.raises(of.NotOurs):
        of.remove(path, "--out")
    assert path.read_text() == '{"mine": 1}'


def test_a_symlink_is_never_written_or_deleted_through(tmp_path: Path):
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "a.png").symlink_to(outside)
    with pytest.raises(of.NotOurs, match="symbolic link"):
        of.write_bytes(tmp_path / "out" / "a.png", b"png", "--out")
    with pytest.raises(of.NotOurs, match="symbolic link"):
        of.remove(tmp_path / "out" / "a.png", "--out")
    (tmp_path / "user").mkdir()
    (tmp_path / "p_files").symlink_to(tmp_path / "user")
    with pytest.raises(of.NotOurs, match="symbolic link"):
        of.folder(tmp_path / "p_files", "--html", derived=True)
    assert outside.read_text() == "keep" and list((tmp_path / "user").iterdir()) == []


def test_a_foreign_registry_makes_nothing_in_its_folder_ours(tmp_path: Path):
    (tmp_path / of.REGISTRY).write_text('{"files": {"a.txt": {}}}')
    (tmp_path / "a.txt").write_text("theirs")
    with pytest.raises(of.NotOurs, match="not sharpclip's record"):
        of.write_text(tmp_path / "a.txt", "x", "--out")
    assert not of.is_ours(tmp_path / "a.txt") and (tmp_path / "a.txt").read_text() == "theirs"


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path):
    path = of.write_text(tmp_path / "f.md", "old", "--out")
    with pytest.raises(OSError), of.writing(path, "--out") as tmp:
        tmp.write_text("half")
        raise OSError(28, "No space left on device")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == [of.REGISTRY, "f.md"]


def test_remove_deletes_only_its_own_file_and_forgets_it(tmp_path: Path):
    path = of.write_text(tmp_path / "x.json", "{}", "--out")
    of.remove(path, "--out")
    assert not path.exists() and of.record(path) is None
    of.remove(path, "--out")  # absent: nothing to do


def test_check_refuses_a_folder_where_a_file_goes_and_a_file_where_a_folder_goes(tmp_path: Path):
    (tmp_path / "d.html").mkdir()
    with pytest.raises(of.NotOurs, match="is a folder"):
        of.check([tmp_path / "d.html"], "--html")
    (tmp_path / "f").write_text("x")
    with pytest.raises(of.NotOurs, match="is a file, not a folder"):
        of.check([tmp_path / "f" / "a.png"], "--out")
    with pytest.raises(of.NotOurs, match="is a file, not a folder"):
        of.folder(tmp_path / "f", "--out")


@pytest.mark.parametrize("when", ["before the rename", "after the rename"])
def test_a_kill_around_the_rename_leaves_the_file_sharpclips_own(tmp_path: Path, monkeypatch, when: str):
    path = of.write_text(tmp_path / "image-00000.safetensors", "old", "--index")
    real_update, real_replace = of._update, os.replace
    updates: list[dict] = []

    def update(folder, changes, flag):
        updates.append(changes)
        if when == "after the rename" and len(updates) == 2:
            raise KeyboardInterrupt  # SIGINT between the rename and the final record
        real_update(folder, changes, flag)

    def replace(src, dst):
        if when == "before the rename" and Path(dst) == path:
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(of, "_update", update)
    monkeypatch.setattr(of.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        of.write_text(path, "new", "--index")
    monkeypatch.undo()
    assert path.read_text() == ("old" if when == "before the rename" else "new") and of.is_ours(path)
    of.write_text(path, "newer", "--index")  # still its own to replace
    assert path.read_text() == "newer" and isinstance(of.record(path), dict)


def test_a_record_that_is_a_symlink_is_not_sharpclips_record(tmp_path: Path):
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text('{"kind": "sharpclip written files", "files": {}}')
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / of.REGISTRY).symlink_to(elsewhere)
    with pytest.raises(of.NotOurs, match="symbolic link, not sharpclip's record"):
        of.write_text(tmp_path / "out" / "a.json", "{}", "--out")
    assert not (tmp_path / "out" / "a.json").exists()
    assert elsewhere.read_text() == '{"kind": "sharpclip written files", "files": {}}'


def test_no_writer_follows_a_link_at_the_folder_it_writes_into(tmp_path: Path):
    """Matrix 6 V5: `compare --out` a link to the user's folder wrote compare.html/.json/.png into it."""
    from sharpclip.analysis.compare import check_outputs

    users = tmp_path / "userdir"
    users.mkdir()
    (tmp_path / "link").symlink_to(users, target_is_directory=True)
    for refused in (lambda: of.check([tmp_path / "link" / "report.json"], "--out"),
                    lambda: of.folder(tmp_path / "link", "--out"),
                    lambda: check_outputs(tmp_path / "link")):  # fmt: skip
        with pytest.raises(of.NotOurs, match=f"{tmp_path / 'link'} is a symbolic link"):
            refused()
    assert list(users.iterdir()) == []
