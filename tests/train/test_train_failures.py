"""A failure on one rank ends every rank promptly, each with one line naming the failing rank and its error.

`sharpclip train` on 2 gloo ranks with an injected exception (SHARPCLIP_RAISE=<where>:<step>:<rank>, a
RuntimeError at that point of that rank): in rank 0's checkpoint save while rank 1 waits at the barrier after it,
in rank 1 after a step while rank 0 goes on to the next step's collectives, and in rank 0 at its epoch-end
validation. The process group's timeout is 10 minutes and each launch has far less (LIMIT), so a rank left waiting
in a collective fails the test. Launched by torchrun, and as a cluster scheduler launches ranks: two plain
processes with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in their environment, no agent.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from _support.tiny_files import write_generic
from sharpclip.config import ConfigError
from sharpclip.devices import resolve_device

LIMIT = 240  # seconds per launch: a healthy 3-step run takes a fraction; a rank left in a collective waits 600
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _train_args(data: Path, out: Path) -> list[str]:
    return ["-m", "sharpclip", "train", "model.name=tiny-clip", "data.format=generic", f"data.root={data}",
            "data.num_workers=0", f"train.output_dir={out}", "train.device=cpu", "train.batch_size=4",
            "train.micro_batch_size=2", "train.max_steps=3", "train.epochs=1", "train.eval_every=0",
            "train.checkpoint_every=1", "train.progress=false", "train.dist_timeout_min=10"]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lines(text: str, failing: int, where: str) -> list[str]:
    pattern = rf"rank {failing} failed: RuntimeError: injected fault at {where}"
    return [line for line in text.splitlines() if re.search(pattern, line)]


@pytest.mark.slow
def test_an_exception_in_rank_0s_checkpoint_ends_both_torchrun_ranks_with_one_line_each(tmp_path):
    data = write_generic(tmp_path / "data")
    env = {**ENV, "SHARPCLIP_RAISE": "checkpoint:2:0"}
    cmd = [*TORCHRUN, *_train_args(data, tmp_path / "run")]  # torchrun's -m: python -m sharpclip train ...
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=LIMIT)
    assert proc.returncode != 0
    lines = _lines(proc.stdout + proc.stderr, 0, "checkpoint 2")
    assert len(lines) == 2, proc.stderr[-3000:]  # one from each rank
    assert any(line.startswith("sharpclip: rank 0 failed") for line in lines)  # rank 0's own, before rank 1 exits
    assert any("sharpclip: rank 1 stops: rank 0 failed" in line for line in lines)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "failing", "where"),
    [("step:1:1", 1, "step 1"), ("checkpoint:2:0", 0, "checkpoint 2"), ("validation:0:0", 0, "validation 0")],
)
def test_ranks_a_scheduler_launched_without_an_agent_end_together(tmp_path, fault, failing, where):
    data = write_generic(tmp_path / "data")
    port = _free_port()
    procs = []
    for rank in (0, 1):
        env = {**ENV, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "SHARPCLIP_RAISE": fault}  # fmt: skip
        cmd = [sys.executable, *_train_args(data, tmp_path / "run")]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    outputs = [p.communicate(timeout=LIMIT) for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode != 0, f"rank {rank}"
        assert len(_lines(out + err, failing, where)) == 1, f"rank {rank}: {err[-3000:]}"


def test_an_explicit_gpu_under_several_processes_is_a_config_error(monkeypatch):
    """Every rank would take GPU 1; the error names the key (checked before CUDA is asked, so also on the CPU)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr("torch.cuda.device_count", lambda: 8)
    with pytest.raises(ConfigError, match=r"train\.device: 'cuda:1' puts all 2 processes on one GPU"):
        resolve_device("cuda:1", "train.device")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="no usable CUDA"):  # one process: the usual check
        resolve_device("cuda:1", "train.device")
