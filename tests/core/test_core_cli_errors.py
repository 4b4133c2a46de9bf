"""The command line's errors: sharpclip's own errors are one line on stderr and exit 2, with a
traceback only under --debug or SHARPCLIP_DEBUG=1; a full disk and a missing eval split say what to do."""

from __future__ import annotations

import errno
import os
import re

import pytest

from _support.tiny_files import write_generic
from sharpclip.cli import main


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_generic(tmp_path_factory.mktemp("data"))


def _train_args(data, out, *extra):
    return ["train", "model.name=tiny-clip", "data.format=generic", f"data.root={data}", "data.num_workers=0",
            f"train.output_dir={out}", "train.batch_size=4", "train.micro_batch_size=4", "train.max_steps=1",
            "train.progress=false", *extra]  # fmt: skip


def _one_line(err: str) -> str:
    """The error line; everything else on stderr must be the run's own log lines (HH:MM:SS LEVEL ...)."""
    lines = [line for line in err.splitlines() if not re.match(r"\d\d:\d\d:\d\d (INFO|WARNING) ", line)]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_bad_sample_is_one_line_and_exit_2_with_a_traceback_only_on_request(data, tmp_path, capsys, monkeypatch):
    (tmp_path / "d").mkdir()
    root = write_generic(tmp_path / "d")
    (root / "images" / "train-3.png").write_bytes(b"not a png")
    assert main(_train_args(root, tmp_path / "run")) == 2
    err = _one_line(capsys.readouterr().err)
    assert err.startswith("sharpclip train: ") and "train-3.png" in err and "on_bad_sample=skip" in err
    assert main(["--debug", *_train_args(root, tmp_path / "run2")]) == 2
    assert "Traceback" in capsys.readouterr().err
    monkeypatch.setenv("SHARPCLIP_DEBUG", "1")
    assert main([*_train_args(root, tmp_path / "run3")]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_a_full_disk_says_which_checkpoint_directory_could_not_be_written(data, tmp_path, capsys, monkeypatch):
    import sharpclip.models.factory as factory

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(factory, "save_weights", no_space)  # what every checkpoint's model part is written by
    assert main(_train_args(data, tmp_path / "run", "train.eval_every=0")) == 2
    err = _one_line(capsys.readouterr().err)
    assert f"cannot write checkpoint to {tmp_path / 'run' / 'checkpoints'}: no space left on device" in err
    assert not list((tmp_path / "run" / "checkpoints").glob(".step-*.tmp"))  # the partial write is cleaned up


@pytest.mark.parametrize("where", ["training state", "weights"])
def test_a_full_disk_in_torch_save_or_safetensors_is_one_line_and_leaves_no_partial_folder(
    data, tmp_path, capsys, monkeypatch, where
):
    """What a full disk really raises: torch.save a RuntimeError, safetensors a SafetensorError."""
    import shutil

    from safetensors import SafetensorError

    import sharpclip.models.factory as factory
    from sharpclip.train import checkpoint

    def torch_full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1344 vs 1232")

    def safetensors_full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    if where == "weights":
        monkeypatch.setattr(factory, "save_weights", safetensors_full)
    else:
        monkeypatch.setattr(checkpoint.torch, "save", torch_full)
        usage = shutil.disk_usage(tmp_path)
        monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: usage._replace(free=4096))  # a full disk
    assert main(_train_args(data, tmp_path / "run", "train.eval_every=0")) == 2
    err = _one_line(capsys.readouterr().err)
    assert f"cannot write checkpoint to {tmp_path / 'run' / 'checkpoints'}: no space left on device" in err
    assert not list((tmp_path / "run" / "checkpoints").glob(".step-*"))


def test_a_missing_eval_split_names_the_file_and_both_ways_out(tmp_path, capsys):
    root = write_generic(tmp_path / "d", splits=("train",))
    assert main(_train_args(root, tmp_path / "run", "data.eval_split=val")) == 2
    err = _one_line(capsys.readouterr().err)
    assert "data.eval_split='val'" in err and f"{root}: no val.jsonl" in err and "train.eval_every=0" in err


def test_a_refused_run_directory_and_a_config_error_are_one_line(data, tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / ".sharpclip-run").write_text("{}\n")  # a run directory by sharpclip's own marker
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    assert main(_train_args(data, tmp_path / "run")) == 2
    err = _one_line(capsys.readouterr().err)
    assert "not empty" in err and "--resume" in err and "--overwrite" in err
    assert main(_train_args(data, tmp_path / "run2", "train.micro_batch_size=0")) == 2
    assert "config error: train.micro_batch_size" in _one_line(capsys.readouterr().err)
    assert main(["train", "--resume", str(tmp_path / "nothing")]) == 2
    assert "not a run directory" in _one_line(capsys.readouterr().err)
