"""Bad samples: missing file, corrupt image bytes, empty caption, malformed record — an error naming file and
record, or (on_bad_sample: skip) skipped, counted and reported at the end of the epoch. Never silent."""

from __future__ import annotations

import json
import logging

import pytest
from data_helpers import cfg_for, copy_fixture, prep

from sharpclip.data import BadSampleError, build_loader, read_samples
from sharpclip.models.tokenizer import build_word_tokenizer

TOK = build_word_tokenizer(["a close-up of a red mailbox number on wooden post daytime"])


def _docci_line(root, n: int, **change) -> None:
    path = root / "docci_descriptions.jsonlines"
    lines = path.read_text().splitlines()
    rec = json.loads(lines[n])
    rec.update(change)
    lines[n] = json.dumps(rec)
    path.write_text("\n".join(lines) + "\n")


def _epoch(cfg, split="train"):
    loader = build_loader(cfg, split, prep(TOK), batch_size=2, train=False)
    batches = list(loader)
    return loader, [i for b in batches for i in b.ids]


def test_missing_image_raises_naming_file_line_and_record(tmp_path):
    root = copy_fixture("docci", tmp_path)
    (root / "images" / "train_00001.jpg").unlink()
    with pytest.raises(BadSampleError, match=r"docci_descriptions.jsonlines:5: record train_00001: missing file"):
        _epoch(cfg_for("docci", root))


def test_corrupt_image_bytes_raise_and_skip(tmp_path, caplog):
    root = copy_fixture("docci", tmp_path)
    path = root / "images" / "train_00000.jpg"
    path.write_bytes(path.read_bytes()[:40])  # truncated JPEG
    with pytest.raises(BadSampleError, match=r"record train_00000: unreadable image"):
        _epoch(cfg_for("docci", root))
    with caplog.at_level(logging.WARNING, logger="sharpclip.data"):
        loader, seen = _epoch(cfg_for("docci", root, on_bad_sample="skip"))
    assert seen == ["train_00001"]
    assert [(b.record, b.reason.split(":")[0]) for b in loader.report.items] == [("train_00000", "unreadable image")]
    assert "skipped 1 bad samples (1 unreadable image)" in caplog.text


def test_corrupt_parquet_image_bytes_in_an_edit_drop_the_whole_pair(tmp_path):
    import pyarrow.parquet as pq

    root = copy_fixture("ultraedit", tmp_path)
    path = root / "data" / "FreeForm_0-00000-of-00001.parquet"
    table = pq.read_table(path).to_pydict()
    table["edited_image"][1] = {"bytes": b"not an image", "path": None}
    import pyarrow as pa

    pq.write_table(pa.table(table), path, row_group_size=2)
    with pytest.raises(BadSampleError, match=r"FreeForm_0/1/edited: unreadable image"):
        _epoch(cfg_for("ultraedit", root), "FreeForm_0")
    loader, seen = _epoch(cfg_for("ultraedit", root, on_bad_sample="skip"), "FreeForm_0")
    assert "FreeForm_0/1/edited" not in seen and len(loader.report.items) == 1
    for batch in loader:
        assert all(batch.ids[s].endswith("/source") for s in batch.edit_source.tolist())
        assert "FreeForm_0/1/source" not in [batch.ids[s] for s in batch.edit_source.tolist()]


def test_empty_caption_raises_and_skip_counts_it(tmp_path):
    root = copy_fixture("docci", tmp_path)
    _docci_line(root, 4, description="   ")
    with pytest.raises(BadSampleError, match=r"docci_descriptions.jsonlines:5: record train_00001: empty caption"):
        read_samples(cfg_for("docci", root), "train")
    loader, seen = _epoch(cfg_for("docci", root, on_bad_sample="skip"))
    assert seen == ["train_00000"]
    assert [str(b).split(": ", 1)[1] for b in loader.report.items] == ["record train_00001: empty caption"]


def test_malformed_json_line_and_missing_field(tmp_path):
    root = copy_fixture("docci", tmp_path)
    path = root / "docci_descriptions.jsonlines"
    path.write_text(path.read_text() + '{"example_id": "train_00009", "split": "train"\n')
    with pytest.raises(BadSampleError, match=r"jsonlines:7: record \?: malformed record: not valid JSON"):
        read_samples(cfg_for("docci", root), "train")
    _docci_line(root, 0, image_file=None)
    path.write_text("\n".join(path.read_text().splitlines()[:6]) + "\n")
    with pytest.raises(
        BadSampleError, match=r"jsonlines:1: record train_00000: malformed record: missing .*image_file"
    ):
        read_samples(cfg_for("docci", root), "train")
    cfg = cfg_for("docci", root, on_bad_sample="skip")
    assert [s.id for s in read_samples(cfg, "train")] == ["train_00001"]


def test_malformed_dci_annotation_file_names_the_file(tmp_path):
    root = copy_fixture("dci", tmp_path)
    (root / "densely_captioned_images" / "annotations" / "104-data.json").write_text("{not json")
    with pytest.raises(BadSampleError, match=r"104-data.json: record 104-data: malformed record: .*line 1"):
        read_samples(cfg_for("dci", root), "all")


def test_generic_folder_reports_an_image_without_caption(tmp_path):
    root = copy_fixture("generic", tmp_path)
    (root / "folder" / "y.txt").unlink()
    with pytest.raises(BadSampleError, match=r"y.jpg: record y: empty caption: no y.txt"):
        read_samples(cfg_for("generic", root), "folder")


def test_a_batch_whose_every_sample_is_bad_is_skipped_and_counted_not_yielded_empty(tmp_path):
    """Under on_bad_sample: skip a batch of only bad samples is skipped and counted (it used to stop the epoch with a
    RuntimeError)."""
    root = copy_fixture("docci", tmp_path)
    for name in ("train_00000.jpg", "train_00001.jpg"):
        (root / "images" / name).unlink()
    loader, ids = _epoch(cfg_for("docci", root, on_bad_sample="skip"))
    assert ids == []  # the fixture's one training batch held only these two
    assert loader.batches_skipped == 1 and len(loader.report.items) == 2


def test_a_bad_image_skipped_every_epoch_is_reported_once(tmp_path, caplog):
    root = copy_fixture("docci", tmp_path)
    path = root / "images" / "train_00000.jpg"
    path.write_bytes(path.read_bytes()[:40])
    loader = build_loader(cfg_for("docci", root, on_bad_sample="skip"), "train", prep(TOK), batch_size=2, train=False)
    with caplog.at_level(logging.WARNING, logger="sharpclip.data"):
        for epoch in range(3):
            loader.set_epoch(epoch)
            assert [i for b in loader for i in b.ids] == ["train_00001"]
    assert [b.record for b in loader.report.items] == ["train_00000"]
    assert loader.report.summary().startswith("skipped 1 bad samples (1 unreadable image)")
    assert list(loader.times_skipped.values()) == [3]
    assert caplog.text.count("skipped 1 bad samples") == 1  # logged when first met, not again each epoch
