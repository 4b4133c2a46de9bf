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


def _train(
    tmp_path: Path,
    name: str,
    procs: int,
    *args: str,
    ids: str | None = None,
    signal: str | None = None,
) -> subprocess.CompletedProcess:
    """`sharpclip train` into tmp_path/name on `procs` processes, recording ids in tmp_path/ids_<ids or name>."""
    launcher = TORCHRUN if procs > 1 else [sys.executable]
    data = tmp_path / "data"
    if not data.is_dir():
        write_generic(data, n=32, splits=("train",))
    cmd = [*launcher, str(WORKER), str(tmp_path / f"ids_{ids or name}"), "train", *TINY, f"data.root={data}", *args]
    if "--resume" not in args or "auto" in args:
        cmd.append(f"train.output_dir={tmp_path / name}")
    env = {**ENV, **({"SHARPCLIP_SIGNAL": signal} if signal else {})}
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


ARGS = ["train.epochs=2", "train.checkpoint_every=3", "train.keep_last=5"]  # 4 exact steps an epoch, 8 in all
STOP = "step:2:SIGTERM:0"  # rank 0 asks for the stop after step 2: every rank ends step 3, checkpoints it, exits 75
# The attention key biases' true gradient is zero (softmax ignores a constant added to every key), so what they
# receive is rounding noise that AdamW normalises into steps; 1 against 2 processes sum in another order and these
# noise steps differ by up to 1.3e-6 (measured), every other tensor by at most 1.2e-7.
NOISE_ONLY = "self_attn.k_proj.bias"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """Uninterrupted exact runs of 8 steps: `one` on 1 process, `two` on 2 processes (train.layout=replicate)."""
    root = tmp_path_factory.mktemp("uninterrupted")
    for name, procs in (("one", 1), ("two", 2)):
        proc = _train(root, name, procs, *ARGS)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def _assert_weights_match(run: Path, reference: Path, atol: float) -> None:
    """The final weights of `run` against `reference`'s: within `atol`, the noise-only key biases within 1e-5."""
    weights = load_file(run / "checkpoints" / "step-000008" / "model.safetensors")
    expected = load_file(reference / "checkpoints" / "step-000008" / "model.safetensors")
    assert weights.keys() == expected.keys()
    for key, value in expected.items():
        bound = 1e-5 if NOISE_ONLY in key else atol
        assert (weights[key] - value).abs().max().item() <= bound, key


def _stop_and_relaunch(tmp_path: Path, stopped_on: int, relaunched_on: int, *layout: str) -> Path:
    """A run of ARGS on `stopped_on` processes stopped by SIGTERM after step 3, then the same command (--resume auto)
    on `relaunched_on` processes; its ids are in ids_stopped and ids_relaunched."""
    stopped = _train(tmp_path, "run", stopped_on, *ARGS, *layout, "--resume", "auto", ids="stopped", signal=STOP)
    assert stopped.returncode != 0 and "stopped by a signal after step 3" in stopped.stdout + stopped.stderr
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-000003"]
    relaunched = _train(tmp_path, "run", relaunched_on, *ARGS, *layout, "--resume", "auto", ids="relaunched")
    assert relaunched.returncode == 0, relaunched.stderr[-3000:]
    assert (
        f"resumed on {relaunched_on} ranks, saved on {stopped_on} (per-rank batch {8 // relaunched_on}, was "
        f"{8 // stopped_on}): epoch 0 continues after its 3 global batches done"
    ) in relaunched.stderr
    return tmp_path / "run"


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["replicate", "shard"])
def test_two_processes_stopped_mid_epoch_and_relaunched_on_one_end_at_the_uninterrupted_weights(
    tmp_path, uninterrupted, layout
):
    """Exact accumulation, 4 steps an epoch, 2 epochs. Two processes trained steps 1-3 with the 1-process run's rows
    and losses; SIGTERMed after step 3 and relaunched by the same command on 1 process (another world size), the run
    continues epoch 0 at its 4th global batch (train.reshard: the packing is global) and trains every later step with
    the 1-process run's rows. It ends at the uninterrupted 2-process run's weights to 1e-6 (measured: 1.2e-7, and
    8.6e-7 for the noise-only key biases) and at the 1-process run's to the tolerance of 1 against 2 processes.
    Under train.layout=shard the checkpoint holds the state saved from the shards, which one process loads."""
    run = _stop_and_relaunch(tmp_path, 2, 1, f"train.layout={layout}")
    one_rows = _rows(uninterrupted / "ids_one", 1)
    stopped, relaunched = _rows(tmp_path / "ids_stopped", 2), _rows(tmp_path / "ids_relaunched", 1)
    assert sorted(stopped) == [1, 2, 3] and sorted(relaunched) == [4, 5, 6, 7, 8]
    assert {**stopped, **relaunched} == one_rows  # step 4 is epoch 0's last batch
    assert _losses(run) == pytest.approx(_losses(uninterrupted / "one"), rel=1e-4, abs=1e-6)
    _assert_weights_match(run, uninterrupted / "two", atol=1e-6)
    _assert_weights_match(run, uninterrupted / "one", atol=2e-6)


@pytest.mark.slow
def test_one_process_stopped_mid_epoch_and_relaunched_on_two_sharded_ranks_ends_at_the_uninterrupted_weights(
    tmp_path, uninterrupted
):
    """The other direction: one process SIGTERMed after step 3, relaunched by the same command on 2 processes with
    train.layout=shard (DCP reshards the optimiser state onto the shards); the 2 ranks deal epoch 0's 4th global
    batch and every later one as the uninterrupted 1-process run trained them and end at its weights (measured:
    6e-8, and 1.3e-6 for the noise-only key biases)."""
    run = _stop_and_relaunch(tmp_path, 1, 2, "train.layout=shard")
    one_rows = _rows(uninterrupted / "ids_one", 1)
    stopped, relaunched = _rows(tmp_path / "ids_stopped", 1), _rows(tmp_path / "ids_relaunched", 2)
    assert sorted(stopped) == [1, 2, 3] and sorted(relaunched) == [4, 5, 6, 7, 8]
    assert {**stopped, **relaunched} == one_rows
    assert _losses(run) == pytest.approx(_losses(uninterrupted / "one"), rel=1e-4, abs=1e-6)
    _assert_weights_match(run, uninterrupted / "one", atol=1e-6)
