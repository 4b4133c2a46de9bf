"""SynthDense is generated only into an empty folder or over an interrupted generation of sharpclip's own: a user's
data folder given as `data.root` with `data.format=synthdense` (or a demo `--out` holding a `synthdense/` of the
user's) is refused in one line and left byte-identical, never written over or written through a link."""

from __future__ import annotations

from pathlib import Path

import pytest

from sharpclip.config import SynthDenseConfig
from sharpclip.data.synthdense import corpus

SMALL = SynthDenseConfig(train_families=4, train_family_size=1, test_families=2, test_family_size=6,
                         pretrain_scenes=2, edits=2, mmvp_pairs=1, resolution=16, workers=1)  # fmt: skip


def test_a_users_data_folder_is_never_generated_over(tmp_path: Path) -> None:
    root = tmp_path / "mydata"
    (root / "images").mkdir(parents=True)
    (root / "train.jsonl").write_text("my own records\n")
    (root / "vocab.txt").write_text("my words\n")
    with pytest.raises(ValueError, match=r"mydata: holds images, train.jsonl, vocab.txt but no SynthDense manifest"):
        corpus.ensure(root, SMALL)
    assert (root / "train.jsonl").read_text() == "my own records\n" and (root / "vocab.txt").read_text() == "my words\n"
    assert sorted(p.name for p in root.iterdir()) == ["images", "train.jsonl", "vocab.txt"]


def test_a_link_in_a_users_folder_is_never_written_through(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "synth"
    root.mkdir()
    (root / "images").symlink_to(outside)
    with pytest.raises(ValueError, match="no SynthDense manifest"):
        corpus.ensure(root, SMALL)
    assert list(outside.iterdir()) == []


def test_an_interrupted_generation_of_sharpclips_own_is_generated_again(tmp_path: Path) -> None:
    root = tmp_path / "synth"
    corpus.generate(root, SMALL)
    (root / "manifest.json").unlink()  # as if killed before the manifest: its own record of the generation is back
    corpus.owned_files.write_text(root / corpus.GENERATING, "{}\n", "data.root")
    (root / "train.jsonl").write_text("half\n")
    assert corpus.ensure(root, SMALL) == root
    assert (root / "manifest.json").is_file() and not (root / corpus.GENERATING).exists()
    assert (root / "train.jsonl").read_text() != "half\n"


def test_an_empty_or_absent_folder_is_generated(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for root in (tmp_path / "empty", tmp_path / "absent"):
        assert corpus.ensure(root, SMALL) == root and (root / "manifest.json").is_file()


def test_another_process_starting_the_same_generation_is_not_refused(tmp_path: Path) -> None:
    root = tmp_path / "synth"
    root.mkdir()
    (root / f".{corpus.GENERATING[:-5]}.99999-abcdef.tmp.json").write_text("{}")  # its marker, not yet renamed
    assert corpus.ensure(root, SMALL) == root and (root / "manifest.json").is_file()
