"""Parquet image cells (UltraEdit-style shards): shuffled access returns each row's own image, reads each (row group,
column) chunk once while it fits the per-process cache, and the cache stays within its byte and file bounds."""

from __future__ import annotations

import io
import random
from pathlib import Path

import pytest
from PIL import Image

from sharpclip.data import images
from sharpclip.data.schema import ParquetCell

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ROW_GROUPS, ROWS = 5, 3


def _png(colour: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), colour).save(buf, format="PNG")
    return buf.getvalue()


def _colour(i: int, column: str) -> tuple[int, int, int]:
    return (10 * i, 0 if column == "source_image" else 255, 7)


@pytest.fixture
def shard(tmp_path: Path) -> str:
    n = ROW_GROUPS * ROWS
    columns = {
        c: [{"bytes": _png(_colour(i, c)), "path": None} for i in range(n)] for c in ("source_image", "edited_image")
    }
    path = tmp_path / "FreeForm-00000-of-00001.parquet"
    pq.write_table(pa.table({"idx": list(range(n)), **columns}), path, row_group_size=ROWS)
    assert pq.ParquetFile(path).num_row_groups == ROW_GROUPS
    return str(path)


def _cells(shard: str, seed: int) -> list[tuple[int, ParquetCell]]:
    order = random.Random(seed).sample(range(ROW_GROUPS * ROWS), ROW_GROUPS * ROWS)
    cols = ("source_image", "edited_image")
    return [(i, ParquetCell(shard, i // ROWS, i % ROWS, c)) for i in order for c in cols]


def test_shuffled_access_returns_each_rows_image_and_reads_each_chunk_once(shard, monkeypatch) -> None:
    monkeypatch.setattr(images, "_PARQUET", images._ParquetCache(64 << 20, 4))
    for i, cell in _cells(shard, seed=0):
        assert images.load_image(cell).getpixel((0, 0)) == _colour(i, cell.column), images.describe(cell)
    assert images._PARQUET.reads == ROW_GROUPS * 2  # every (row group, column) chunk once: all fit the cache


def test_cache_is_bounded_in_bytes_and_open_files(shard, monkeypatch) -> None:
    chunk = pq.ParquetFile(shard).read_row_group(0, columns=["source_image"]).column(0).nbytes
    cache = images._ParquetCache(max_bytes=2 * chunk, max_files=1)
    monkeypatch.setattr(images, "_PARQUET", cache)
    for i, cell in _cells(shard, seed=1):
        assert images.load_image(cell).getpixel((0, 0)) == _colour(i, cell.column)
        assert cache.nbytes <= cache.max_bytes and len(cache.chunks) <= 2 and len(cache.files) <= 1
    assert cache.nbytes == sum(c.nbytes for c in cache.chunks.values())
    tiny = images._ParquetCache(max_bytes=1, max_files=1)  # a chunk larger than the budget is read, not kept
    monkeypatch.setattr(images, "_PARQUET", tiny)
    assert images.image_bytes(ParquetCell(shard, 1, 2, "edited_image")) == _png(_colour(5, "edited_image"))
    assert (tiny.reads, len(tiny.chunks), tiny.nbytes) == (1, 0, 0)


def test_row_past_the_row_group_is_a_missing_image(shard, monkeypatch) -> None:
    monkeypatch.setattr(images, "_PARQUET", images._ParquetCache(1 << 20, 1))
    with pytest.raises(images.ImageLoadError, match=r"missing file: .*row 3.* past the row group's 3 rows"):
        images.load_image(ParquetCell(shard, 0, 3, "source_image"))
