"""One index serves its data whichever way the path reaches it: from another working directory, by an absolute
path, through `..`, or with a data section's relative `data.root`; the manifest records resolved paths, so the same
data is never refused as "items differ" (with `--rebuild` as the advice) and the index is reused, not rebuilt."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from PIL import Image

from _support.tiny_files import write_image_folder
from sharpclip.analysis import index as ix
from sharpclip.cli import main


def _generic(root: Path) -> Path:
    (root / "images").mkdir(parents=True)
    with open(root / "val.jsonl", "w") as f:
        for i in range(4):
            Image.new("RGB", (32, 32), (60 * i, 80, 120)).save(root / "images" / f"{i}.jpg")
            f.write(json.dumps({"image": f"images/{i}.jpg", "caption": f"square {i}"}) + "\n")
    return root


def _manifests(index: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(index.rglob(ix.MANIFEST))}


@pytest.fixture
def in_tmp(tmp_path: Path):
    here = os.getcwd()
    (tmp_path / "elsewhere").mkdir()
    os.chdir(tmp_path)
    yield tmp_path
    os.chdir(here)


def test_an_image_folder_index_is_the_same_from_any_working_directory_or_path_form(in_tmp: Path, capsys):
    write_image_folder(in_tmp / "es")
    query = ["--model", "tiny-clip", "--text", "square", "-k", "2", "eval.progress=false"]
    assert main(["search", "--images", "es", "--index", "idx", *query]) == 0
    built = _manifests(in_tmp / "idx")
    assert main(["search", "--images", str(in_tmp / "es"), "--index", "idx", *query]) == 0, capsys.readouterr().err
    assert main(["search", "--images", "elsewhere/../es", "--index", "idx", *query]) == 0, capsys.readouterr().err
    os.chdir(in_tmp / "elsewhere")
    assert main(["search", "--images", "../es", "--index", "../idx", *query]) == 0, capsys.readouterr().err
    assert _manifests(in_tmp / "idx") == built  # one index, reused as it was


def test_a_data_sections_relative_root_is_the_same_index_from_another_directory(in_tmp: Path, capsys):
    _generic(in_tmp / "gen")
    query = ["--model", "tiny-clip", "--text", "square", "-k", "2", "eval.progress=false", "data.format=generic",
             "data.eval_split=val"]  # fmt: skip
    assert main(["search", "data.root=gen", "--index", "idx", *query]) == 0
    built = _manifests(in_tmp / "idx")
    os.chdir(in_tmp / "elsewhere")
    assert main(["search", "data.root=../gen", "--index", "../idx", *query]) == 0, capsys.readouterr().err
    assert _manifests(in_tmp / "idx") == built
