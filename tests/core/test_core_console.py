"""Logs a person reads: a log line never lands on a progress bar's line (a pseudo-terminal via `script`), the other
ranks print only what is theirs, the hub libraries' bars stay out of redirected logs, a missing tracking extra is one
line at config load, `--resume latest` points at `--resume auto`, and the demo's pre-training says where it is."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sharpclip.cli import OtherRanks, main, quiet_hub_bars
from sharpclip.config import ConfigError, load_config
from sharpclip.train.run import check_config

ROOT = Path(__file__).resolve().parents[2]


def _record(level: int, **extra) -> logging.LogRecord:
    record = logging.LogRecord("sharpclip.train", level, __file__, 1, "a message", None, None)
    record.__dict__.update(extra)
    return record


def test_other_ranks_print_errors_and_their_own_warnings_only():
    keep = OtherRanks().filter
    assert not keep(_record(logging.WARNING)) and keep(_record(logging.ERROR))
    assert keep(_record(logging.WARNING, rank_own=True))


def test_the_hub_bars_are_off_when_stderr_is_not_a_terminal(monkeypatch):
    import huggingface_hub.utils as hub_utils

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    monkeypatch.setattr("sharpclip.progress.on_terminal", lambda: False)
    was = hub_utils.are_progress_bars_disabled()
    try:
        quiet_hub_bars()
        assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1" and hub_utils.are_progress_bars_disabled()
    finally:
        if not was:
            hub_utils.enable_progress_bars()


def test_a_missing_tracking_extra_is_one_line_at_config_load(monkeypatch):
    import importlib.util

    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ConfigError, match=r"^train\.wandb: needs the wandb extra: pip install 'sharpclip\[wandb\]'"):
        check_config(load_config(None, ["train.wandb=true"]))


def test_resume_latest_points_at_resume_auto(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--resume", "latest", "model.name=tiny-clip"]) == 2
    assert "use --resume auto" in capsys.readouterr().err


def test_the_demo_pre_training_prints_where_it_is(tmp_path, capsys):
    from sharpclip.demo.stages import _heartbeat

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 7, "loss": 1.25}) + "\n")
    with _heartbeat("stage_a", metrics, 600, every=0.05):
        time.sleep(0.3)
    lines = capsys.readouterr().out.splitlines()
    assert lines and all(re.fullmatch(r"  stage_a: step 7/600, loss 1\.250 \(\d+ s\)", line) for line in lines)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("script") is None, reason="needs util-linux `script` for a pseudo-terminal")
def test_on_a_terminal_log_lines_go_above_the_bar_never_onto_its_line(tmp_path):
    """`script` gives the command a 40 × 120 pseudo-terminal; a log line written onto the bar's line would follow
    its closing `]` directly (`…data=0.027s]14:05:27 INFO epoch 0`)."""
    command = [sys.executable, "-m", "sharpclip", "train", str(ROOT / "configs" / "tiny_synthdense.yaml"),
               "train.max_steps=4", "train.epochs=2", "train.progress=true", "train.log_every=1",
               f"data.root={tmp_path / 'data'}", f"train.output_dir={tmp_path / 'run'}"]  # fmt: skip
    shell = "stty rows 40 cols 120; " + " ".join(map(str, command))  # tqdm draws nothing on a pty of 0 rows
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    typescript = tmp_path / "typescript"
    done = subprocess.run(["script", "-q", "-e", "-c", shell, str(typescript)], env=env, capture_output=True,
                          timeout=600, check=False)  # fmt: skip
    text = typescript.read_text(errors="replace")
    assert done.returncode == 0, text[-2000:]
    assert re.search(r"\d+/4 \[", text), text[-2000:]  # the bar drew (`2/4 [00:03<00:05, ...`)
    assert "INFO eval after epoch 0" in text  # and log lines reached the terminal
    assert not re.search(r"\]\d\d:\d\d:\d\d (INFO|WARNING)", text), text[-2000:]
