"""The search index under faults (reliability matrix 5, Q and W cases): it deletes only its own files, its identity
decides its folder, a damaged chunk or manifest is one line naming the file, a full disk is one line, two builds
take turns, and a query image or page path of the wrong kind is refused in one line."""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from _support.tiny_files import write_image_folder
from sharpclip.analysis import index as ix
from sharpclip.cli import main


@pytest.fixture
def es(tmp_path: Path) -> Path:
    return write_image_folder(tmp_path / "es")


def _search(images: Path, index: Path, *extra: str) -> int:
    argv = ["search", "--model", "tiny-clip", "--images", str(images), "--index", str(index), "eval.progress=false"]
    return main([*argv, *extra])


def _folder(index: Path) -> Path:
    (manifest,) = index.rglob(ix.MANIFEST)
    return manifest.parent


def _one_line(err: str, *words: str) -> None:
    lines = [line for line in err.splitlines() if line.startswith("sharpclip")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert all(w in lines[0] for w in words), (lines[0], words)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# -- point 1: --rebuild deletes the index's own files only (Q17, Q18) ------------------------------------------------
def test_rebuild_keeps_a_users_manifest_backup_and_notes_beside_the_index(es: Path, tmp_path: Path):
    assert _search(es, tmp_path / "idx") == 0
    folder = _folder(tmp_path / "idx")
    mine = {"manifest.json.bak": (folder / "manifest.json").read_bytes(), "manifest.json.notes": b"notes",
            "README.txt": b"read me"}  # fmt: skip
    for name, data in mine.items():
        (folder / name).write_bytes(data)
    assert _search(es, tmp_path / "idx", "--rebuild", "--text", "square 1", "-k", "1") == 0
    assert all((folder / n).read_bytes() == data for n, data in mine.items())
    assert ix.load_index(folder).image.shape[0] == 4  # rebuilt beside them


@pytest.mark.parametrize("link", [True, False], ids=["symlinked", "plain"])
@pytest.mark.parametrize("rebuild", [True, False], ids=["rebuild", "query"])
def test_a_folder_holding_another_tools_manifest_is_refused_and_nothing_in_it_deleted(
    es: Path, tmp_path: Path, capsys, link: bool, rebuild: bool
):
    assert _search(es, tmp_path / "learn") == 0
    where = tmp_path / "idx" / _folder(tmp_path / "learn").relative_to(tmp_path / "learn")
    user = tmp_path / "mine" if link else where
    user.mkdir(parents=True)
    (user / "manifest.json").write_text('{"version": 1}')
    (user / "image-00000.safetensors").write_bytes(b"their tensors")
    (user / "thesis.tex").write_text("chapter 1")
    before = _snapshot(user)
    if link:
        where.parent.mkdir(parents=True)
        where.symlink_to(user)
    capsys.readouterr()
    assert _search(es, tmp_path / "idx", *(["--rebuild"] * rebuild)) == 2
    _one_line(capsys.readouterr().err, str(where), "--index")
    assert _snapshot(user) == before


# -- point 2: the index's identity decides its folder ---------------------------------------------------------------
def test_two_folders_named_images_get_two_indexes_and_rebuilding_one_keeps_the_other(tmp_path: Path):
    a, b = write_image_folder(tmp_path / "a" / "images", 3), write_image_folder(tmp_path / "b" / "images", 5)
    assert _search(a, tmp_path / "idx") == 0 and _search(b, tmp_path / "idx") == 0
    folders = sorted(p.parent for p in (tmp_path / "idx").rglob(ix.MANIFEST))
    assert len(folders) == 2 and all(f.parent.name.startswith("images-") for f in folders)
    sizes = sorted(ix.load_index(f).image.shape[0] for f in folders)
    assert sizes == [3, 5]
    other = next(f for f in folders if ix.load_index(f).image.shape[0] == 3)
    before = _snapshot(other)
    assert _search(b, tmp_path / "idx", "--rebuild") == 0
    assert _snapshot(other) == before


def test_two_splits_of_one_dataset_get_two_indexes(tmp_path: Path):
    from _support.tiny_files import write_generic

    data = write_generic(tmp_path / "data", n=4, splits=("train", "test"))
    for split in ("train", "test"):
        argv = ["search", "--model", "tiny-clip", "data.format=generic", f"data.root={data}",
                f"data.eval_split={split}", "eval.progress=false", "--index", str(tmp_path / "idx")]  # fmt: skip
        assert main(argv) == 0
    folders = sorted(p.parent for p in (tmp_path / "idx").rglob(ix.MANIFEST))
    assert len(folders) == 2 and folders[0].parent != folders[1].parent
    splits = {json.loads((f / ix.MANIFEST).read_text())["dataset"]["spec"]["split"] for f in folders}
    assert splits == {"train", "test"}


# -- point 3 and 4: damaged chunks and manifests (Q6, Q8, Q10) -------------------------------------------------------
def _damage(chunk: Path, how: str) -> None:
    if how == "random bytes":
        chunk.write_bytes(os.urandom(chunk.stat().st_size))
    elif how == "cut to half":
        chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])
    elif how == "wrong shape":
        save_file({"embedding": torch.nn.functional.normalize(torch.randn(7, 16), dim=1)}, str(chunk))
    else:  # "same shape, other vectors" (Q8)
        rows, dim = ix.load_index(chunk.parent).image.shape
        save_file({"embedding": torch.nn.functional.normalize(torch.randn(rows, dim), dim=1)}, str(chunk))


@pytest.mark.parametrize("how", ["random bytes", "cut to half", "wrong shape", "same shape, other vectors"])
def test_a_damaged_or_replaced_chunk_is_one_line_naming_it_and_rebuild(es: Path, tmp_path: Path, capsys, how: str):
    assert _search(es, tmp_path / "idx") == 0
    chunk = _folder(tmp_path / "idx") / "image-00000.safetensors"
    _damage(chunk, how)
    capsys.readouterr()
    assert _search(es, tmp_path / "idx", "--text", "square 2") == 2
    _one_line(capsys.readouterr().err, str(chunk), "--rebuild")
    assert _search(es, tmp_path / "idx", "--text", "square 2", "--rebuild") == 0  # its own chunk: rebuilt


def _edit(manifest: Path, how: str) -> None:
    m = json.loads(manifest.read_text())
    if how == "model deleted":
        del m["model"]
    elif how == "dataset.files deleted":
        del m["dataset"]["files"]
    elif how.startswith("chunk_size"):
        m["chunk_size"] = 0 if how.endswith("0") else "1024"
    else:
        m = [m]
    manifest.write_text(json.dumps(m))


@pytest.mark.parametrize("how", ["model deleted", "dataset.files deleted", "chunk_size 0", 'chunk_size "1024"', "list"])
def test_a_hand_edited_manifest_is_one_line_and_rebuild_repairs_it(es: Path, tmp_path: Path, capsys, how: str):
    assert _search(es, tmp_path / "idx") == 0
    manifest = _folder(tmp_path / "idx") / ix.MANIFEST
    _edit(manifest, how)
    capsys.readouterr()
    assert _search(es, tmp_path / "idx", "--text", "square 2") == 2
    _one_line(capsys.readouterr().err, str(manifest), "--rebuild")
    assert _search(es, tmp_path / "idx", "--text", "square 2", "--rebuild") == 0


def test_manifest_schema_names_the_key():
    good = {"version": ix.INDEX_VERSION, "model": {"name": "m", "class": "X", "digest": "d", "preprocessing": {}},
            "dataset": {"name": "n", "spec": {}, "items": [], "captions": [], "caption_to_image": [], "files": {}},
            "chunk_size": 4, "dim": None, "complete": False, "chunks": {}}  # fmt: skip
    assert ix.manifest_error(good) is None
    assert "'chunk_size' is a bool" in ix.manifest_error({**good, "chunk_size": True})
    assert ix.manifest_error({**good, "model": {"name": "m"}}) == "key 'model.class' is missing"
    assert ix.manifest_error([good]) == "the manifest is a JSON list, not an object"
    bad_file = {**good, "dataset": {**good["dataset"], "files": {"a": {"size": "1"}}}}
    assert "size" in ix.manifest_error(bad_file)


# -- point 4: a full disk, two builds at once (Q19, Q11) --------------------------------------------------------------
@pytest.mark.parametrize("error", ["OSError", "SafetensorError"])
def test_a_full_disk_during_a_build_is_one_line_and_the_build_resumes(
    es: Path, tmp_path: Path, capsys, monkeypatch, error: str
):
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        if error == "OSError":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(ix, "save_file", full)
    assert _search(es, tmp_path / "idx") == 2
    folder = _folder(tmp_path / "idx")
    _one_line(capsys.readouterr().err, f"cannot write index chunk to {folder}: no space left on device")
    assert not [p for p in folder.iterdir() if ".tmp" in p.name]  # no temporary left behind
    monkeypatch.undo()
    assert _search(es, tmp_path / "idx", "--text", "square 1") == 0  # resumed once there is room


def _vectors(dataset) -> dict:
    keys = [*dataset.images, *dataset.captions]
    vecs = torch.nn.functional.normalize(torch.randn(len(keys), 6, generator=torch.Generator().manual_seed(0)), dim=1)
    return dict(zip(keys, vecs, strict=True))


class _Slow:
    def __init__(self, vectors: dict):
        self.vectors, self.calls = vectors, 0

    def _embed(self, items):
        self.calls += 1
        return torch.stack([self.vectors[x] for x in items])

    images = texts = _embed


def _record() -> dict:
    return {"name": "m", "class": "X", "digest": "d0", "preprocessing": {"size": 4}}


def test_a_second_build_of_one_index_waits_for_the_first_and_embeds_nothing(es: Path, tmp_path: Path, caplog):
    from sharpclip.analysis.search import image_folder

    dataset = image_folder(es)
    spec = {"images": str(es)}
    folder = tmp_path / "idx"
    folder.mkdir()
    first = ix.BuildLock(folder).__enter__()  # another process's build, holding the lock
    second = _Slow(_vectors(dataset))
    done = threading.Thread(target=ix.build_index, args=(folder, second, _record(), dataset, spec),
                            kwargs={"progress": False})  # fmt: skip
    done.start()
    deadline = time.monotonic() + 30
    while "waiting for pid" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "waiting for pid" in caplog.text and str(os.getpid()) in caplog.text
    assert second.calls == 0 and not (folder / ix.MANIFEST).exists()
    with pytest.raises(ix.IndexMismatch, match=rf"an index build is running there \(pid {os.getpid()}\)"):
        ix.build_index(folder, _Slow(_vectors(dataset)), _record(), dataset, spec, progress=False, wait=False)
    first.__exit__()
    done.join(60)
    assert not done.is_alive() and ix.load_index(folder).image.shape[0] == 4


# -- flags: -k, --image, --html (Q15, Q14, W5-W7) ----------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["search", "-k", "0"], ["search", "-k", "-5"], ["compare", "-k", "0"],
                                  ["compare", "-n", "0"], ["compare", "-n", "-1"]])  # fmt: skip
def test_a_result_count_below_one_is_refused_by_argparse_with_a_usage_line(argv: list[str], capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--model", "tiny-clip", "--text", "x"] if argv[0] == "search" else [*argv, "--model", "a"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("usage: sharpclip") and "is not >= 1" in err


def test_a_fifo_a_folder_or_a_text_file_as_the_query_image_says_what_it_is(es: Path, tmp_path: Path, capsys):
    os.mkfifo(tmp_path / "q.fifo.jpg")
    (tmp_path / "q.dir.jpg").mkdir()
    (tmp_path / "notimg.jpg").write_text("not an image")
    cases = (("q.fifo.jpg", "is a named pipe (FIFO)"), ("q.dir.jpg", "is a folder"),
             ("notimg.jpg", "not an image file PIL can read (cannot identify image file"))  # fmt: skip
    for name, said in cases:
        assert _search(es, tmp_path / "idx", "--image", str(tmp_path / name)) == 2
        _one_line(capsys.readouterr().err, f"--image {tmp_path / name}: {said}")
    assert not (tmp_path / "idx").exists()  # refused before any index is built


def test_an_index_flag_naming_a_file_is_one_line_and_the_file_is_unchanged(es: Path, tmp_path: Path, capsys):
    (tmp_path / "idxfile").write_text("mine")
    assert _search(es, tmp_path / "idxfile") == 2
    _one_line(capsys.readouterr().err, f"{tmp_path / 'idxfile'} is a file, not a folder", "--index")
    assert (tmp_path / "idxfile").read_text() == "mine"


@pytest.mark.parametrize("name", ["notes.txt", "photo.jpg"])
def test_html_onto_a_users_file_that_is_not_a_page_is_refused(es: Path, tmp_path: Path, capsys, name: str):
    (tmp_path / name).write_bytes(b"the user's " + name.encode())
    assert _search(es, tmp_path / "idx", "--text", "square", "--html", str(tmp_path / name)) == 2
    _one_line(capsys.readouterr().err, "must end in .html", "--html")
    assert (tmp_path / name).read_bytes() == b"the user's " + name.encode()
    assert not (tmp_path / f"{Path(name).stem}_files").exists()


def test_html_onto_a_folder_writes_no_thumbnails_first(es: Path, tmp_path: Path, capsys):
    (tmp_path / "userdir.html").mkdir()
    assert _search(es, tmp_path / "idx", "--text", "square", "--html", str(tmp_path / "userdir.html")) == 2
    _one_line(capsys.readouterr().err, "is a folder", "--html")
    assert not (tmp_path / "userdir_files").exists() and not (tmp_path / "idx").exists()


def test_a_page_files_folder_that_is_a_symlink_to_a_users_folder_is_refused(es: Path, tmp_path: Path, capsys):
    user = tmp_path / "realuser"
    user.mkdir()
    (user / "keep.txt").write_text("keep")
    (tmp_path / "p3_files").symlink_to(user)
    assert _search(es, tmp_path / "idx", "--text", "square", "--html", str(tmp_path / "p3.html")) == 2
    _one_line(capsys.readouterr().err, "p3_files is a symbolic link", "--html")
    assert sorted(p.name for p in user.iterdir()) == ["keep.txt"] and not (tmp_path / "p3.html").exists()


def test_a_tilde_in_index_and_html_flags_is_the_home_folder(es: Path, tmp_path: Path, monkeypatch):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    assert main(["search", "--model", "tiny-clip", f"--images={es}", "--index=~/idx", "--text", "square", "-k", "1",
                 "--html=~/p.html", "eval.progress=false"]) == 0  # fmt: skip
    assert (home / "p.html").is_file() and list((home / "idx").rglob(ix.MANIFEST))
    assert list(cwd.iterdir()) == []  # no folder named "~"


def test_a_folder_left_by_a_build_killed_as_it_started_is_built_into(es: Path, tmp_path: Path):
    assert _search(es, tmp_path / "learn") == 0
    folder = tmp_path / "idx" / _folder(tmp_path / "learn").relative_to(tmp_path / "learn")
    folder.mkdir(parents=True)
    (folder / ix.LOCK).write_text("12345\n")  # killed after taking the lock, mid-way through its first manifest
    (folder / ".manifest.12345-abcdef.tmp.json").write_text('{"version"')
    assert _search(es, tmp_path / "idx", "--text", "square 1") == 0
    assert ix.load_index(folder).image.shape[0] == 4


def test_a_page_files_name_held_by_a_file_and_a_compare_out_that_is_a_file_are_one_line(
    es: Path, tmp_path: Path, capsys
):
    (tmp_path / "p2_files").write_text("mine")
    assert _search(es, tmp_path / "idx", "--text", "square", "--html", str(tmp_path / "p2.html")) == 2
    _one_line(capsys.readouterr().err, f"{tmp_path / 'p2_files'} is a file, not a folder", "--html")
    (tmp_path / "f6file").write_text("mine too")
    argv = ["compare", "--model", "tiny-clip", "--model", "tiny-siglip", "--out", str(tmp_path / "f6file")]
    assert main(argv) == 2
    _one_line(capsys.readouterr().err, f"{tmp_path / 'f6file'} is a file, not a folder", "--out")
    assert (tmp_path / "p2_files").read_text() == "mine" and (tmp_path / "f6file").read_text() == "mine too"
    assert not (tmp_path / "p2.html").exists() and not (tmp_path / "idx").exists()


def test_a_data_level_index_folder_that_is_a_symlink_to_a_users_folder_is_refused(es: Path, tmp_path: Path, capsys):
    assert _search(es, tmp_path / "learn") == 0
    data_level = tmp_path / "idx" / _folder(tmp_path / "learn").parent.relative_to(tmp_path / "learn")
    user = tmp_path / "mine"
    user.mkdir()
    (user / "keep.txt").write_text("keep")
    data_level.parent.mkdir(parents=True)
    data_level.symlink_to(user)
    assert _search(es, tmp_path / "idx") == 2
    _one_line(capsys.readouterr().err, f"{data_level} is a symbolic link", "--index")
    assert sorted(p.name for p in user.iterdir()) == ["keep.txt"]


@pytest.mark.parametrize("kind", ["missing", "folder", "dangling-link"])
def test_a_records_unreadable_image_is_one_line_naming_it_when_the_index_fingerprints_it(tmp_path, kind):
    """compare over a data set whose record names a missing image ended with the raw "[Errno 2] No such file or
    directory: '…'" from the manifest's fingerprint of every file, naming neither the cause nor the skip setting."""
    path = tmp_path / "images" / "test-3.png"
    path.parent.mkdir()
    if kind == "folder":
        path.mkdir()
    elif kind == "dangling-link":
        path.symlink_to(tmp_path / "nowhere.png")
    with pytest.raises(ValueError, match=rf"cannot read {path} to fingerprint the index: .*data\.on_bad_sample=skip"):
        ix.file_record(path)
