"""A rank that stops making progress without raising ends every rank within train.hang_timeout_min, each with one
line naming that rank and its last step (train.heartbeat through the failure watcher of train.distributed)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from _support.tiny_files import write_generic
from sharpclip.train.heartbeat import Heartbeat, verdict

LIMIT = 240  # seconds per launch; the collective timeout below is 10 minutes, so only the heartbeat ends it sooner


def _beat(step, progress, stalled):
    return {"step": step, "progress": progress, "stalled": stalled}


def test_the_verdict_names_the_rank_behind_once_a_stall_passes_the_timeout():
    # rank 1 slept after step 3; rank 0 arrived at step 4's agreement and waits for it (stalled a little less)
    beats = [_beat(3, 7, 2.5), _beat(3, 6, 2.9)]
    assert verdict(beats, 3.0) is None
    beats = [_beat(3, 7, 3.4), _beat(3, 6, 3.8)]
    assert verdict(beats, 3.0).startswith("rank 1 made no progress for 4 s after step 3 while the others waited")
    assert "every rank is inside step 4" in verdict([_beat(3, 7, 5.0), _beat(3, 7, 5.0)], 3.0)


class _Store(dict):
    def set(self, key, value):
        self[key] = value.encode()

    def check(self, keys):
        return all(k in self for k in keys)

    def get(self, key):
        return self[key]


def test_no_stall_is_published_before_the_first_step_nor_during_a_save(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("sharpclip.train.heartbeat.clock", lambda: now[0])
    store = _Store()
    other = Heartbeat(0.01, 1, 2)
    other.beat(2, arrived=True)  # rank 1 waits at step 3's agreement, not yet armed
    beat = Heartbeat(0.01, 0, 2)  # 0.6 s
    now[0] += 10
    assert beat.check(store) is None and other.check(store) is None  # neither took a step: not armed
    beat.beat(3)
    with beat.busy("save"):
        now[0] += 10
        assert beat.check(store) is None  # a save is not a hang
    now[0] += 10
    other.beat(3)
    other.beat(3, arrived=True)  # rank 1 took step 3 and waits for rank 0 at step 4's agreement
    now[0] += 0.1
    other.check(store)
    assert beat.check(store).startswith("rank 0 made no progress for 10 s after step 3")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_rank_that_sleeps_after_a_step_ends_every_rank_with_one_line_naming_it(tmp_path):
    data = write_generic(tmp_path / "data")
    args = ["-m", "sharpclip", "train", "model.name=tiny-clip", "data.format=generic", f"data.root={data}",
            "data.num_workers=0", f"train.output_dir={tmp_path / 'run'}", "train.device=cpu", "train.batch_size=4",
            "train.micro_batch_size=2", "train.max_steps=6", "train.eval_every=0", "train.progress=false",
            "train.dist_timeout_min=10", "train.hang_timeout_min=0.05"]  # fmt: skip
    port, procs, start = _free_port(), [], time.monotonic()
    for rank in (0, 1):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "SHARPCLIP_HANG": "step:3:1"}  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env))  # fmt: skip
    outputs = [p.communicate(timeout=LIMIT) for p in procs]
    assert time.monotonic() - start < LIMIT
    for rank, (p, (_out, err)) in enumerate(zip(procs, outputs, strict=True)):
        lines = [line for line in err.splitlines() if "made no progress" in line]
        assert p.returncode == 1, f"rank {rank}: {err[-3000:]}"
        assert len(lines) == 1, f"rank {rank}: {err[-3000:]}"
        assert lines[0].startswith(f"sharpclip: rank {rank} stops: rank 1 made no progress for "), lines[0]
        assert "after step 3 while the others waited for it" in lines[0]


def test_no_verdict_before_every_rank_has_taken_a_step_and_no_timeout_below_the_floor(tmp_path):
    """Matrix 6 H3: hang_timeout_min=1e-9 stopped a healthy run as hung, "0 s after step None", naming a rank that
    had not taken its first step. The floor refuses it at load; a rank with no step yet never gets a verdict."""
    from sharpclip.config import ConfigError, load_config

    assert verdict([_beat(None, -1, 0.0), _beat(2, 4, 9.0)], 3.0) is None
    assert "after step 2" in verdict([_beat(2, 4, 0.0), _beat(2, 5, 9.0)], 3.0)
    with pytest.raises(ConfigError, match=r"train.hang_timeout_min: 1e-09 is shorter than a training step"):
        load_config(None, ["train.hang_timeout_min=1e-9"])
    assert load_config(None, ["train.hang_timeout_min=0"]).train.hang_timeout_min == 0  # off
