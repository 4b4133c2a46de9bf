"""Logs a person can read: a plain line every train.log_every steps in train.log, and on stderr when it is not a
terminal; progress bars only on a terminal, for every command (sharpclip.progress, train.log_lines)."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from _support.tiny_files import write_generic
from sharpclip import progress
from sharpclip.train.log_lines import ProgressLines

SRC = Path(__file__).resolve().parents[2] / "src" / "sharpclip"
LINE = re.compile(r"step (\d+)/6 \(epoch \d+\): loss [\d.]+ \[contrastive [\d.]+\], lr [\d.e+-]+, [\d.]+ samples/s, "
                  r"data wait \d+%, ETA \d+:\d\d:\d\d$")  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_generic(tmp_path_factory.mktemp("data"), n=8)


def _cmd(data: Path, run: Path) -> list[str]:
    return [sys.executable, "-m", "sharpclip", "train", "model.name=tiny-clip", "data.format=generic",
            f"data.root={data}", "data.num_workers=0", f"train.output_dir={run}", "train.device=cpu",
            "train.batch_size=4", "train.micro_batch_size=4", "train.max_steps=6", "train.epochs=3",
            "train.eval_every=0", "train.log_every=2", "train.progress=true"]  # fmt: skip


def _steps(text: str) -> list[int]:
    return [int(m.group(1)) for line in text.splitlines() if (m := LINE.search(line))]


def test_redirected_training_writes_a_plain_line_per_log_every_and_no_bar_frames(data, tmp_path):
    run = tmp_path / "run"
    with open(tmp_path / "err.txt", "w") as err:  # a cluster job's .out: not a terminal
        proc = subprocess.run(_cmd(data, run), stdout=subprocess.DEVNULL, stderr=err, env={**os.environ}, timeout=300)
    text = (tmp_path / "err.txt").read_text()
    assert proc.returncode == 0, text[-3000:]
    assert "\r" not in text and "\x1b[" not in text  # no bar frames, no cursor codes
    assert _steps(text) == [2, 4, 6]
    assert _steps((run / "train.log").read_text()) == [2, 4, 6]


def test_on_a_terminal_the_bar_draws_and_the_lines_stay_in_train_log(data, tmp_path):
    run = tmp_path / "run"
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a new pty has 0 columns
    proc = subprocess.Popen(_cmd(data, run), stdout=subprocess.DEVNULL, stderr=follower, env={**os.environ})
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal's other end closed: the process ended
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert proc.wait(timeout=300) == 0
    shown = b"".join(chunks).decode(errors="replace")
    assert "6/6 [" in shown  # the bar
    assert _steps(shown) == []  # the lines are not drawn beside it
    assert _steps((run / "train.log").read_text()) == [2, 4, 6]


def test_a_bar_draws_only_on_a_terminal(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert progress.bar(range(3), enabled=True).disable and not progress.showing()
    monkeypatch.setattr(sys, "stderr", Terminal())
    shown = progress.bar(range(3), enabled=True, file=sys.stderr)
    assert not shown.disable and progress.showing()
    shown.close()
    assert not progress.showing()
    assert progress.bar(range(3), enabled=False).disable  # --no-progress on a terminal


def test_every_command_makes_its_bars_through_one_helper():
    """search, eval, validate-data, demo and train: a direct tqdm bar would draw frames into a redirected file."""
    direct = [f"{p.relative_to(SRC)}:{n}" for p in SRC.rglob("*.py") if p.name != "progress.py"
              for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\btqdm\(", line)]  # fmt: skip
    assert direct == []


def test_the_line_reports_rate_wait_share_and_eta():
    lines = ProgressLines(10, 100)
    lines._seen, lines._wait = 0, 2.0
    record = {"step": 10, "epoch": 0, "hn": 1.5, "tok": 0.25, "loss": 1.75, "infonce_monitor": 3.0, "lr": 1e-5,
              "logit_scale": 14.0, "seen": 400, "data_wait_s": 0.1}  # fmt: skip
    assert lines.line(record, 20.0) == ("step 10/100 (epoch 0): loss 1.7500 [hn 1.5000, tok 0.2500], lr 1.00e-05, "
                                        "20.0 samples/s, data wait 10%, ETA 0:03:00")  # fmt: skip
