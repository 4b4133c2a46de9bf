"""The same rows at every world size: a 2-process run's step t trains the rows and the loss of the 1-process step t.

Indexed (map-style) data are packed into global batches once, from the seed, and dealt to the ranks
(data.sampling); these runs launch the CLI under torchrun on 2 gloo processes (tests/train/rank_worker.py records
the ids each rank trains on) and compare with one process on the same generic data.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _support.tiny_files import write_generic

HERE = Path(__file__).parent
WORKER = HERE / "rank_worker.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
LIMIT = 300  # seconds for one subprocess: far above a healthy run, far below a hang left to the CI's own timeout
TINY = ["model.name=tiny-clip", "data.num_workers=0", "train.device=cpu", "train.eval_every=0", "train.progress=false",
        "train.dist_timeout_min=0.5", "train.lr=1e-3", "train.warmup_steps=0", "data.format=generic",
        "train.batch_size=8", "train.micro_batch_size=2"]  # fmt: skip


def _train(tmp_path: Path, name: str, procs: int, *args: str, fault: str | None = None) -> subprocess.CompletedProcess:
    launcher = TORCHRUN if procs > 1 else [sys.executable]
    data = tmp_path / "data"
    if not data.is_dir():
        write_generic(data, n=32, splits=("train",))
    cmd = [*launcher, str(WORKER), str(tmp_path / f"ids_{name}"), "train", *TINY, f"data.root={data}", *args]
    if "--resume" not in args:
        cmd.append(f"train.output_dir={tmp_path / name}")
    env = {**ENV, **({"SHARPCLIP_FAULT": fault} if fault else {})}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=LIMIT)


def _losses(run: Path) -> dict[int, float]:
    records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _rows(ids_dir: Path, procs: int) -> dict[int, tuple[int, list[str]]]:
    """step -> (epoch, the ids every rank trained on, in rank order); a replayed step keeps its last record."""
    per_rank = []
    for rank in range(procs):
        lines = map(json.loads, (ids_dir / f"rank{rank}.jsonl").read_text().splitlines())
        per_rank.append({r["step"]: (r["epoch"], r["ids"]) for r in lines})
    return {step: (per_rank[0][step][0], [i for ranks in per_rank for i in ranks[step][1]]) for step in per_rank[0]}


@pytest.mark.slow
def test_per_micro_batch_on_two_processes_trains_the_rows_and_losses_of_one(tmp_path):
    """32 rows, global batch 8 of micro-batches of 2 (each its own matrix): before the global packing the step-1
    loss differed (0.8316 on 1 process, 0.8599 on 2), as each rank packed its own rows."""
    args = ["train.accumulation=per_micro_batch", "train.max_steps=3"]
    for name, procs in (("one", 1), ("two", 2)):
        proc = _train(tmp_path, name, procs, *args)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert _rows(tmp_path / "ids_two", 2) == _rows(tmp_path / "ids_one", 1)
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert list(one) == list(two) == [1, 2, 3]
    assert two == pytest.approx(one, rel=1e-5, abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["replicate", "shard"])
def test_exact_on_two_processes_matches_one_and_resumes_mid_epoch_on_one_process(tmp_path, layout):
    """Exact accumulation, 4 steps an epoch, 2 epochs. Two processes killed after the checkpoint of step 3 trained
    steps 1-3 with the 1-process run's rows and losses; resumed on 1 process (another world size) it continues
    epoch 0 at its 4th global batch (train.reshard: the packing is global) and trains every later step with the
    1-process run's rows, ending with its weights (to the tolerance of 1 against 2 processes). Under
    train.layout=shard the checkpoint holds the state saved from the shards, which one process loads."""
    args = ["train.epochs=2", "train.checkpoint_every=3", "train.keep_last=5"]
    ref = _train(tmp_path, "one", 1, *args)
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = _train(tmp_path, "two", 2, *args, f"train.layout={layout}", fault="step:3")
    assert killed.returncode != 0 and (tmp_path / "two" / "checkpoints" / "step-000003").is_dir()
    one_rows, two_rows = _rows(tmp_path / "ids_one", 1), _rows(tmp_path / "ids_two", 2)
    assert [two_rows[s] for s in (1, 2, 3)] == [one_rows[s] for s in (1, 2, 3)]
    one = _losses(tmp_path / "one")
    assert [_losses(tmp_path / "two")[s] for s in (1, 2, 3)] == pytest.approx([one[s] for s in (1, 2, 3)], rel=1e-5)
    resumed = _train(tmp_path, "resumed", 1, "--resume", str(tmp_path / "two"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed on 1 ranks, saved on 2 (per-rank batch 8, was 4): epoch 0 continues after its 3 global" in (
        resumed.stderr
    )
    after = _rows(tmp_path / "ids_resumed", 1)
    assert sorted(after) == [4, 5, 6, 7, 8]
    assert {s: after[s] for s in after} == {s: one_rows[s] for s in after}  # step 4 is epoch 0's last batch
    assert _losses(tmp_path / "two") == pytest.approx(one, rel=1e-4, abs=1e-6)
    weights = load_file(tmp_path / "two" / "checkpoints" / "step-000008" / "model.safetensors")
    for key, value in load_file(tmp_path / "one" / "checkpoints" / "step-000008" / "model.safetensors").items():
        assert torch.allclose(weights[key], value, atol=2e-5, rtol=1e-4), key
