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


@pytest.mark.parametrize("lr", ["train.lr=1e38", "train.module_lr={backbone.text_model: 1e38}", "train.lr=3.5e38"])
def test_an_lr_beyond_the_ceiling_is_one_line_from_train_and_config(data, tmp_path, capsys, lr):
    """An lr AdamW cannot even hold (its step size overflows fp32) is refused at load, naming the key."""
    key = lr.split("=")[0].split("{")[0]
    assert main(_train_args(data, tmp_path / "run", lr)) == 2
    err = _one_line(capsys.readouterr().err)
    assert err.startswith("sharpclip train: ") and key in err and "<= 1e+06" in err, err
    assert not (tmp_path / "run").exists()
    assert main(["config", lr]) == 2
    assert key in _one_line(capsys.readouterr().err)


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


# --- what users type: overrides after flags, brace patterns, the same validation in `config` as in `train` ---------


@pytest.mark.parametrize(
    ("argv", "dest", "want"),
    [
        (["train", "a.b=1", "--overwrite", "train.output_dir=X"], "config_args", ["a.b=1", "train.output_dir=X"]),
        (["train", "--resume", "RUN", "train.epochs=3", "train.lr=1"], "config_args", ["train.epochs=3", "train.lr=1"]),
        (["eval", "--model", "M", "model.kind=open_clip", "--suite", "retrieval", "data.format=hf"], "config_args",
         ["model.kind=open_clip", "data.format=hf"]),
        (["validate-data", "DIR", "--format", "webdataset", "data.shards=[x]"], "overrides", ["data.shards=[x]"]),
        (["config", "r.yaml", "--debug", "train.lr=2"], "config_args", ["r.yaml", "train.lr=2"]),
    ],
)  # fmt: skip
def test_overrides_parse_after_flags_in_the_order_typed(argv, dest, want) -> None:
    from sharpclip.cli import build_parser, parse_args

    args = parse_args(build_parser(), argv)
    assert getattr(args, dest) == want
    if "--resume" in argv:
        assert args.resume == "RUN"


def test_an_unknown_flag_is_still_refused(capsys) -> None:
    from sharpclip.cli import build_parser, parse_args

    with pytest.raises(SystemExit) as exit_:
        parse_args(build_parser(), ["train", "a.b=1", "--bogus", "c.d=2"])
    assert exit_.value.code == 2 and "unrecognized arguments: --bogus c.d=2" in capsys.readouterr().err


def test_config_prints_overrides_given_after_a_flag(capsys) -> None:
    assert main(["config", "--debug", "train.lr=0.5", "data.shards=[x-{0..3}.tar, y-{a,b}.tar]"]) == 0
    out = capsys.readouterr().out
    assert "lr: 0.5" in out and "- x-{0..3}.tar\n" in out and "- y-{a,b}.tar\n" in out


@pytest.mark.parametrize(
    ("words", "expect"),
    [
        (["data.shards=[x-0.tar]", "data.shards=[x-1.tar]", "data.shards=[x-2.tar]"], "given 3 times in a row"),
        (["data.root=[x"], "override 'data.root=[x': the value is not valid YAML"),
    ],
)
def test_a_shell_expanded_or_broken_override_is_one_line(capsys, words, expect) -> None:
    assert main(["config", *words]) == 2
    assert expect in _one_line(capsys.readouterr().err)


def test_a_run_config_yaml_that_does_not_parse_is_one_line_naming_it(tmp_path, capsys) -> None:
    """A parser's message spans four lines (problem, mark, problem, mark): `analyze --sample-efficiency` over a run
    whose config.yaml is damaged printed them all."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("garbage: [unclosed\n")
    assert main(["analyze", "sample-efficiency", str(run), "--out", str(tmp_path / "se")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "config.yaml: not valid YAML" in err and "line 2" in err, err


def test_config_runs_trains_validation(tmp_path, capsys) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("loss:\n  terms:\n    hn:\n      loss: hn_clip\n      params:\n        gamma: high\n")
    assert main(["config", str(recipe)]) == 2
    assert "loss.terms.hn.params.gamma: expected float, got 'high'" in _one_line(capsys.readouterr().err)
    assert main(["config", "data.format=webdatset"]) == 2
    assert "data.format: unknown format 'webdatset'" in _one_line(capsys.readouterr().err)


def test_data_layer_messages_reach_the_console_and_train_log(data, tmp_path, capsys) -> None:
    """The preload line is INFO on the `sharpclip.data` logger: before, no command had a handler for it."""
    import logging

    assert main(_train_args(data, tmp_path / "run", "data.preload=true", "train.eval_every=0")) == 0
    err = capsys.readouterr().err
    assert re.search(r"\d\d:\d\d:\d\d INFO data: preloaded the \d+ images of 'train'", err), err
    assert "data: preloaded the" in (tmp_path / "run" / "train.log").read_text()
    assert err.count("data: preloaded the") == 1  # one console handler, not the command's and the run's
    assert "requires torchvision" not in err  # transformers' backend notice is silenced (see sharpclip.models)
    assert not logging.getLogger("sharpclip").handlers  # removed after the command


@pytest.mark.parametrize(
    "argv, hint",
    [
        (["train", "--batch-size", "8"], "did you mean train.batch_size=8"),  # open_clip's habit
        (["train", "r.yaml", "--batch_size=8", "train.lr=1e-4"], "did you mean train.batch_size=8"),
        (["train", "--lr", "1e-4"], "did you mean train.lr=1e-4"),
        (["train", "--learning-rate", "1e-4"], "did you mean train.lr=1e-4"),  # transformers' name
        (["train", "--epochs", "3"], "did you mean train.epochs=3"),
        (["train", "--grad-checkpointing", "train.lr=1e-4"], "did you mean train.grad_checkpointing=true"),
        (["eval", "--batch-size", "8"], "did you mean eval.batch_size=8"),  # the command's own section first
        (["config", "--warmup", "10"], "did you mean train.warmup_steps=10"),
    ],
)
def test_a_flag_from_another_tool_suggests_the_setting(argv, hint, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "unrecognized arguments" in err and hint in err


def test_a_near_miss_key_on_the_command_line_is_one_line_naming_the_real_key(capsys) -> None:
    assert main(["config", "train.learning_rate=1e-4"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "'train.learning_rate' is not a setting; did you mean train.lr?" in line


def test_eval_of_a_mistyped_local_run_says_the_path_does_not_exist(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "runs" / "csv").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    for model, says in (("runs/cvs", "did you mean runs/csv?"), ("./runs/cvs", "did you mean runs/csv?"),
                        ("~/nothing", f"the nearest folder that exists is {tmp_path}"),
                        ("runs/exp/cvs", "the nearest folder that exists is runs")):  # fmt: skip
        assert main(["eval", "--model", model, "--suite", "retrieval"]) == 2
        line = _one_line(capsys.readouterr().err)
        assert "no such file or folder (a local path, not a hub id)" in line and says in line, line
        assert "hf download" not in line


def test_a_name_that_is_a_path_or_a_hub_id_names_the_missing_local_path_first(tmp_path, monkeypatch, capsys) -> None:
    """`runs/typo` with no `runs` folder could be a hub id (org/name): the line says no local path holds it before
    any download advice, and where it looked."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    assert main(["eval", "--model", "runs/typo", "--suite", "retrieval"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.index("no such local folder or file") < line.index("hf download"), line
    assert str(tmp_path) in line and "A run or export: check the path" in line


def test_a_config_error_under_torchrun_is_printed_by_rank_0_only(capsys, monkeypatch) -> None:
    monkeypatch.setenv("RANK", "1")
    assert main(["train", "train.learning_rate=1e-4"]) == 2
    assert capsys.readouterr().err == ""  # rank 1 exits non-zero quietly: the same error as rank 0's
    with pytest.raises(SystemExit):
        main(["train", "--batch-size", "8"])
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert main(["train", "train.learning_rate=1e-4"]) == 2
    assert "did you mean train.lr" in _one_line(capsys.readouterr().err)


@pytest.mark.slow
def test_torchrun_prints_a_config_error_once(tmp_path) -> None:
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "sharpclip",
           "train", "train.learning_rate=1e-4", f"train.output_dir={tmp_path / 'run'}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    assert proc.stderr.count("'train.learning_rate' is not a setting; did you mean train.lr?") == 1, proc.stderr


def test_a_tilde_output_dir_in_a_recipe_writes_under_home_not_a_folder_named_tilde(data, tmp_path, monkeypatch, capsys):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    recipe = cwd / "m2.yaml"
    recipe.write_text("train:\n  output_dir: ~/r4runs/x\n")
    args = [a for a in _train_args(data, "unused") if not a.startswith("train.output_dir")]
    assert main([args[0], str(recipe), *args[1:]]) == 0
    assert (home / "r4runs" / "x" / "config.yaml").is_file() and not (cwd / "~").exists()
    assert f"run directory: {home / 'r4runs' / 'x'}" in capsys.readouterr().out
