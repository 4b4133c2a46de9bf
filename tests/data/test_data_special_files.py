"""Special files never block and broken shards are named.

Made as users make them: `os.mkfifo` for an image path, a folder and a device where an image should be, a shard cut
with `truncate` (os.truncate) at many offsets, and a shard of random bytes. Every test that could hang if the fix
broke runs under an alarm, so a regression fails in seconds instead of waiting forever in `open()`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import tarfile
from pathlib import Path

import pytest
from data_helpers import cfg_for, prep
from PIL import Image

from sharpclip.config import DataConfig
from sharpclip.data import build_loader, read_samples
from sharpclip.data.files import NotRegularFileError, open_regular, read_regular
from sharpclip.data.formats.webdataset import count_samples, shard_problem
from sharpclip.data.schema import BadSampleError, BadSampleReport
from sharpclip.data.validate import validate
from sharpclip.models.tokenizer import build_word_tokenizer

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
TOK = build_word_tokenizer(["a photo of sample number"])
PREP = prep(TOK, 8)


@contextlib.contextmanager
def no_hang(seconds: int = 20):
    """Fail (instead of waiting forever) when the body blocks: SIGALRM interrupts a blocked open()."""

    def fail(*_):
        raise TimeoutError(f"blocked for {seconds} s: a special file was opened and waited on")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _png(path: Path, shade: int) -> None:
    Image.new("RGB", (12, 10), (shade, 40, 90)).save(path)


def _pairs_with_specials(root: Path) -> Path:
    """A generic JSONL split of 3 good images plus a FIFO, a folder and a device (/dev/zero, via a symlink)."""
    (root / "images").mkdir(parents=True)
    records = []
    for i in range(3):
        _png(root / "images" / f"{i}.png", 40 * i)
        records.append({"image": f"images/{i}.png", "caption": f"a photo of sample {i}"})
    os.mkfifo(root / "images" / "fifo.png")
    (root / "images" / "folder.png").mkdir()
    (root / "images" / "zero.png").symlink_to("/dev/zero")
    records += [{"image": f"images/{n}.png", "caption": f"a photo of {n}"} for n in ("fifo", "folder", "zero")]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


def test_open_regular_refuses_every_kind_of_special_file_without_waiting(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "dir").mkdir()
    (tmp_path / "ok").write_bytes(b"bytes")
    with no_hang():
        for path, kind in ((tmp_path / "pipe", "FIFO"), (tmp_path / "dir", "directory"), ("/dev/zero", "device")):
            with pytest.raises(NotRegularFileError, match=rf"not a regular file: {path} is .*{kind}"):
                open_regular(path)
        assert read_regular(tmp_path / "ok") == b"bytes"
        with pytest.raises(FileNotFoundError):
            read_regular(tmp_path / "absent")


def test_validate_data_reports_a_fifo_a_folder_and_a_device_as_bad_samples(tmp_path):
    root = _pairs_with_specials(tmp_path / "d")
    with no_hang():
        report = validate(cfg_for("generic", root), "train")
    assert report.samples == 6 and report.error_counts == {"not a regular file": 3}, report.errors
    kinds = [e.rsplit(" is ", 1)[1] for e in report.errors]
    assert [k.split(";")[0] for k in kinds] == ["a named pipe (FIFO)", "a directory", "a character device"]
    assert "fifo.png" in report.errors[0] and "train.jsonl:4" in report.errors[0]


def test_the_training_loader_skips_and_counts_them_and_names_the_first_under_error(tmp_path):
    root = _pairs_with_specials(tmp_path / "d")
    with no_hang():
        loader = build_loader(cfg_for("generic", root, on_bad_sample="skip", shuffle=False), "train", PREP,
                              batch_size=1)  # fmt: skip
        assert sorted(i for b in loader for i in b.ids) == ["0", "1", "2"]
        assert [b.reason.split(":")[0] for b in loader.report.items] == ["not a regular file"] * 3
        with pytest.raises(BadSampleError, match=r"fifo.png is a named pipe \(FIFO\)"):
            list(build_loader(cfg_for("generic", root, shuffle=False), "train", PREP, batch_size=1))


def test_evaluation_and_the_overlap_check_refuse_a_fifo_without_waiting(tmp_path):
    from sharpclip.data.overlap import _digest
    from sharpclip.eval.embed import load_image
    from sharpclip.eval.manifest import sha256_file

    os.mkfifo(tmp_path / "x.jpg")
    with no_hang():
        with pytest.raises(FileNotFoundError, match="not a regular file"):
            load_image(tmp_path / "x.jpg")
        with pytest.raises(NotRegularFileError):
            sha256_file(tmp_path / "x.jpg")
        assert _digest(tmp_path / "x.jpg", {}) is None


def _jpeg(i: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (10, 8), (i * 7 % 256, 40, 90)).save(buf, "JPEG")
    return buf.getvalue()


def shardwriter(folder: Path, samples: int = 32, maxcount: int = 16) -> list[Path]:
    """Shards as webdataset's ShardWriter writes them (.jpg, .txt and a .json with key and status)."""
    import webdataset as wds

    folder.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(folder / "shard-%06d.tar"), maxcount=maxcount, verbose=0) as sink:
        for i in range(samples):
            meta = {"key": f"{i:06d}", "status": "success"}
            sink.write({"__key__": f"{i:06d}", "jpg": _jpeg(i), "txt": f"a photo of sample {i}", "json": meta})
    return sorted(folder.glob("*.tar"))


def _member_ends(path: Path) -> list[int]:
    with tarfile.open(path) as tar:
        return [m.offset_data + m.size for m in tar]


def test_a_shard_cut_anywhere_that_loses_data_is_reported_as_truncated(tmp_path):
    """Every cut from the first header to the last member's data, every 509 bytes (so blocks' starts, middles
    and ends are all hit): each is a bad shard; cuts inside the end-of-archive blocks lose nothing and pass."""
    (whole,) = shardwriter(tmp_path / "w", samples=8, maxcount=8)
    data, last_end = whole.read_bytes(), _member_ends(whole)[-1]
    assert shard_problem(str(whole)) is None and count_samples(str(whole)) == 8
    cut = tmp_path / "cut.tar"
    for size in [*range(1, last_end, 509), last_end - 1, last_end]:
        cut.write_bytes(data)
        os.truncate(cut, size)
        problem = shard_problem(str(cut))
        assert problem is not None and problem.startswith(("truncated shard", "unreadable shard")), (size, problem)
    cut.write_bytes(data)
    os.truncate(cut, -(-last_end // 512) * 512 + 512)  # one of the two zero blocks left: every member is whole
    assert shard_problem(str(cut)) is None


def test_validate_data_names_and_counts_a_truncated_shard_and_a_shard_that_is_not_a_tar(tmp_path):
    from sharpclip.cli import main

    shards = shardwriter(tmp_path / "w" / "train", samples=48)  # 3 shards of 16
    os.truncate(shards[1], shards[1].stat().st_size // 2 + 100)  # the matrix's cut: half the shard + 100 bytes
    shards[2].write_bytes(os.urandom(20_000))
    report_path = tmp_path / "r.json"
    assert main(["validate-data", str(tmp_path / "w"), "--no-progress", "--json", str(report_path)]) == 1
    report = json.loads(report_path.read_text())
    assert report["shards"] == {str(shards[0]): 16, str(shards[1]): 0, str(shards[2]): 0}
    assert report["error_counts"] == {"truncated shard": 1, "unreadable shard": 1}, report["errors"]
    assert str(shards[1]) in report["errors"][0] and "not a tar" in report["errors"][1]


def _stream_cfg(root: Path, **kw) -> DataConfig:
    return DataConfig(format="webdataset", root=str(root), num_workers=0, shuffle=False, **kw)


@pytest.mark.parametrize("damage", ["truncate", "random bytes"])
def test_training_stops_on_a_broken_shard_naming_it_or_skips_and_counts_it(tmp_path, damage):
    shards = shardwriter(tmp_path / "w" / "train", samples=32)
    if damage == "truncate":
        os.truncate(shards[1], shards[1].stat().st_size // 2 + 100)
    else:
        shards[1].write_bytes(os.urandom(20_000))
    with pytest.raises(BadSampleError, match=rf"{shards[1]}: record \?: (truncated|unreadable) shard"):
        build_loader(_stream_cfg(tmp_path / "w"), "train", PREP, batch_size=4)  # before the first step
    loader = build_loader(_stream_cfg(tmp_path / "w", on_bad_sample="skip"), "train", PREP, batch_size=4)
    assert len(loader) == 4 and sum(len(b.ids) for b in loader) == 16  # the whole shard only
    assert [(b.where, b.reason.split(":")[0]) for b in loader.report.items] == [
        (str(shards[1]), "truncated shard" if damage == "truncate" else "unreadable shard")
    ]
    samples = read_samples(_stream_cfg(tmp_path / "w", on_bad_sample="skip"), "train", BadSampleReport("skip"))
    assert len(samples) == 16


def test_train_prints_one_line_naming_a_shard_that_is_not_a_tar(tmp_path, capsys):
    """The CLI's one-line error, not a traceback: the shards are checked before the model is built."""
    from sharpclip.cli import main

    shards = shardwriter(tmp_path / "w" / "train", samples=32)
    shards[1].write_bytes(os.urandom(20_000))
    code = main(["train", "model.name=tiny-clip", "data.format=webdataset", f"data.root={tmp_path / 'w'}",
                 "train.batch_size=4", "train.micro_batch_size=4", "train.eval_every=0", "data.num_workers=0",
                 f"train.output_dir={tmp_path / 'run'}"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "Traceback" not in "\n".join(err)
    assert err[-1].startswith("sharpclip train: ") and f"{shards[1]}: record ?: unreadable shard: not a tar" in err[-1]


def test_a_fifo_or_folder_named_like_a_shard_is_refused_naming_it_without_waiting(tmp_path):
    from sharpclip.data.formats.webdataset import shard_urls

    shardwriter(tmp_path / "w" / "train", samples=16)
    os.mkfifo(tmp_path / "w" / "train" / "shard-000009.tar")
    with no_hang(), pytest.raises(NotRegularFileError, match=r"shard-000009.tar is a named pipe"):
        shard_urls(_stream_cfg(tmp_path / "w"), "train")
    (tmp_path / "w" / "train" / "shard-000009.tar").unlink()
    (tmp_path / "w" / "train" / "shard-000009.tar").mkdir()
    with no_hang():
        assert shard_problem(str(tmp_path / "w" / "train" / "shard-000009.tar")).endswith("is a directory")
