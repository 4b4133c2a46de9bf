"""Hugging Face datasets on disk: save_to_disk folders and hub-layout parquet, read lazily; format detection."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
from data_helpers import prep
from PIL import Image

from sharpclip.cli import main
from sharpclip.config import DataConfig
from sharpclip.data import build_loader, read_samples
from sharpclip.data.images import load_image
from sharpclip.data.schema import ArrowCell, ParquetCell
from sharpclip.data.validate import config_for, detect_format
from sharpclip.models.tokenizer import build_word_tokenizer

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
TOK = build_word_tokenizer(["a photo of row number short"])


def _png(i: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (6 + i, 5), (20 * i, 0, 0)).save(buf, "PNG")
    return buf.getvalue()


IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])  # the HF Image feature's storage


def table(n: int, start: int = 0) -> pa.Table:
    images = [{"bytes": _png(i), "path": f"{i}.png"} for i in range(start, start + n)]
    return pa.table({
        "image": pa.array(images, type=IMAGE),
        "text": [f"a photo of row {i}" for i in range(start, start + n)],
        "short": ["short"] * n,
    })  # fmt: skip


def hub_parquet(root: Path) -> Path:
    """The layout `huggingface_hub` downloads: data/<split>-0000x-of-0000y-<hash>.parquet beside README.md."""
    (root / "data").mkdir(parents=True)
    (root / "README.md").write_text("---\ndataset_info:\n  features:\n  - name: image\n    dtype: image\n---\n")
    pq.write_table(table(3), root / "data" / "train-00000-of-00002-0a1b2c.parquet", row_group_size=2)
    pq.write_table(table(2, 3), root / "data" / "train-00001-of-00002-3d4e5f.parquet")
    pq.write_table(table(1, 9), root / "data" / "test-00000-of-00001-777777.parquet")
    return root


def save_to_disk(root: Path) -> Path:
    """`DatasetDict.save_to_disk`: dataset_dict.json + <split>/{state.json, dataset_info.json, data-*.arrow}."""
    (root / "dataset_dict.json").parent.mkdir(parents=True, exist_ok=True)
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    split = root / "train"
    split.mkdir()
    t = table(3)
    images = t.column("image").to_pylist()
    images[1] = {"bytes": None, "path": str(root / "on_disk.png")}  # an Image cast from a path: no bytes kept
    (root / "on_disk.png").write_bytes(_png(7))
    t = t.set_column(0, "image", pa.array(images, type=IMAGE))
    with pa.OSFile(str(split / "data-00000-of-00001.arrow"), "wb") as sink, pa.ipc.new_stream(sink, t.schema) as w:
        w.write_table(t)
    (split / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (split / "dataset_info.json").write_text(json.dumps({"features": {"image": {"_type": "Image"}}}))
    return root


def cfg(root: Path, **kw) -> DataConfig:
    return DataConfig(format="hf", root=str(root), caption_field="text", short_caption_field="short",
                      **{"num_workers": 0, **kw})  # fmt: skip


def test_hub_parquet_reads_every_shard_of_the_split_lazily(tmp_path):
    root = hub_parquet(tmp_path / "hub")
    samples = read_samples(cfg(root), "train")
    assert [s.caption for s in samples] == [f"a photo of row {i}" for i in range(5)]
    assert [s.id for s in samples] == ["0", "1", "2", "3", "4"] and samples[0].short_caption == "short"
    assert all(isinstance(s.image, ParquetCell) for s in samples)  # nothing decoded, nothing copied yet
    assert samples[2].image.row_group == 1 and load_image(samples[4].image).size == (10, 5)
    assert [s.caption for s in read_samples(cfg(root), "test")] == ["a photo of row 9"]


def test_save_to_disk_folder_memory_maps_and_falls_back_to_the_path(tmp_path):
    root = save_to_disk(tmp_path / "saved")
    samples = read_samples(cfg(root), "train")
    assert isinstance(samples[0].image, ArrowCell) and isinstance(samples[1].image, Path)
    assert [load_image(s.image).size for s in samples] == [(6, 5), (13, 5), (8, 5)]
    batch = next(iter(build_loader(cfg(root), "train", prep(TOK, 8), batch_size=3, train=False)))
    assert batch.pixel_values.shape == (3, 3, 8, 8) and batch.short_input_ids is not None
    with pytest.raises(ValueError, match="split 'test' not in this DatasetDict"):
        read_samples(cfg(root), "test")


def test_a_single_saved_dataset_is_only_its_own_split(tmp_path):
    root = save_to_disk(tmp_path / "saved") / "train"  # a Dataset (not a DatasetDict) saved from split train
    state = json.loads((root / "state.json").read_text())
    (root / "state.json").write_text(json.dumps({**state, "_split": "train"}))
    assert len(read_samples(cfg(root), "train")) == 3
    with pytest.raises(ValueError, match="holds split 'train', not 'test'"):
        read_samples(cfg(root), "test")


def test_missing_columns_name_the_config_keys(tmp_path):
    root = hub_parquet(tmp_path / "hub")
    with pytest.raises(ValueError, match=r"no column 'caption'.*data.caption_field"):
        read_samples(DataConfig(format="hf", root=str(root)), "train")


def test_hub_cache_folder_resolves_to_its_snapshot(tmp_path):
    snapshot = tmp_path / "datasets--someone--pairs" / "snapshots" / "abc123"
    hub_parquet(snapshot)
    assert len(read_samples(cfg(tmp_path / "datasets--someone--pairs"), "train")) == 5


def test_detection_tells_hub_parquet_from_ultraedit_and_finds_save_to_disk(tmp_path):
    from data_helpers import FIXTURES

    assert detect_format(hub_parquet(tmp_path / "hub")) == "hf"  # was taken for a malformed UltraEdit shard
    assert detect_format(save_to_disk(tmp_path / "saved")) == "hf"
    assert detect_format(FIXTURES / "ultraedit") == "ultraedit"


def test_validate_data_on_a_path_honours_overrides(tmp_path, capsys):
    root = hub_parquet(tmp_path / "hub")
    assert config_for(str(root), ["data.caption_field=text", "shuffle=false"]).shuffle is False
    assert main(["validate-data", str(root), "data.caption_field=text", "--json", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["samples"] == 5
    assert main(["validate-data", str(root)]) == 2  # the default caption column is absent: a one-line error
    assert "data.caption_field" in capsys.readouterr().err


# the layouts datasets.load_dataset(folder) reads from a folder of parquet files, as `Dataset.to_parquet` writes them
LAYOUTS = {
    "flat": {"train.parquet": (4, 0), "test.parquet": (2, 10)},
    "data-folder": {"data/train.parquet": (4, 0), "data/test.parquet": (2, 10)},
    "hub-shards": {"data/train-00000-of-00002.parquet": (2, 0), "data/train-00001-of-00002.parquet": (2, 2),
                   "data/test-00000-of-00001.parquet": (2, 10)},
    "numbered-files": {"train-0.parquet": (2, 0), "train-1.parquet": (2, 2), "test_0.parquet": (2, 10)},
    "split-folders": {"training/part-0.parquet": (4, 0), "eval/part-0.parquet": (2, 10)},
}  # fmt: skip


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_parquet_layouts_datasets_reads_are_read_by_split(tmp_path, layout):
    root = tmp_path / layout
    for name, (n, start) in LAYOUTS[layout].items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table(n, start), root / name)
    assert [s.caption for s in read_samples(cfg(root), "train")] == [f"a photo of row {i}" for i in range(4)]
    assert [s.caption for s in read_samples(cfg(root), "test")] == ["a photo of row 10", "a photo of row 11"]
    with pytest.raises(FileNotFoundError, match=r"no Hugging Face dataset for split 'validation'"):
        read_samples(cfg(root), "validation")


def test_parquet_files_whose_names_say_no_split_are_the_train_split(tmp_path):
    pq.write_table(table(2), tmp_path / "part-a.parquet")
    pq.write_table(table(1, 2), tmp_path / "part-b.parquet")
    assert len(read_samples(cfg(tmp_path), "train")) == 3
    with pytest.raises(FileNotFoundError, match="split 'test'"):
        read_samples(cfg(tmp_path), "test")


def test_the_eval_manifest_counts_images_inside_parquet(tmp_path):
    from sharpclip.eval.manifest import dataset_record

    root = hub_parquet(tmp_path / "hub")
    samples = read_samples(cfg(root), "train")
    record = dataset_record([], [s.image for s in samples], hash_images=True)["images"]
    assert record["count"] == record["embedded"] == 5 and record["bytes"] == 0
    other = dataset_record([], [s.image for s in samples[:4]], hash_images=True)["images"]
    assert other["sha256_of_sorted_list"] != record["sha256_of_sorted_list"]


def test_validate_data_shows_a_bar_over_the_images(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("sharpclip.progress.on_terminal", lambda: True)  # bars draw on a terminal only
    root = hub_parquet(tmp_path / "hub")
    assert main(["validate-data", str(root), "data.caption_field=text", "--json", str(tmp_path / "r.json")]) == 0
    assert re.search(r"decode images: 100%.*5/5", capsys.readouterr().err)
