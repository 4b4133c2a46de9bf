"""W processes give one process's step: 2 and 4 gloo ranks, each with its rows of one global batch of 16, through
the real training step (train.step.run_step), against one process holding the whole batch (the ranks' rows
concatenated in rank order), in float64: equal loss terms, monitor and every gradient.

- exact, uneven rows per rank (10 + 6; 6 + 4 + 2 + 4): each rank computes its rows against all 16 columns (local
  loss), and the sum of the ranks' shares is the 16 × 16 matrix's loss;
- per_micro_batch, each rank's batch from the training sampler (data.sampling): every matrix has
  `micro_batch_size` rows at every world size (no gather), and the gradient is the mean over all W·k matrices,
  the one-process gradient of the same micro-batches;
- gathered: every rank the whole matrix from gathered features (the gradient diagnostics' path).

The NCCL twin runs the same worker on two GPUs.
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

from _support.tiny_dual import CASES, LAYOUT_CASES, MICRO, rows_for, run_case, run_diagnostics, tiny_batch
from sharpclip.collectives import gather, gather_features
from sharpclip.config import ConfigError
from sharpclip.train.step import check_batch_split

WORKER = Path(__file__).with_name("dist_worker.py")


def _launch(tmp: Path, procs: int, backend: str) -> tuple[dict, dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs), str(WORKER)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*cmd, str(tmp), backend], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((tmp / "records.json").read_text()), load_file(tmp / "grads.safetensors")


@pytest.fixture(scope="module")
def on_ranks(tmp_path_factory):
    """The worker's results on 2 and 4 gloo ranks (launched once per world size, when a test first asks)."""
    runs: dict[int, tuple[dict, dict]] = {}

    def get(world: int) -> tuple[dict, dict]:
        if world not in runs:
            runs[world] = _launch(tmp_path_factory.mktemp(f"gloo{world}"), world, "gloo")
        return runs[world]

    return get


def _rows(mode: str, world: int) -> list[int]:
    """The one-process batch equivalent to `world` ranks: their rows concatenated in rank order."""
    return [row for rows in rows_for(mode, world) for row in rows]


def _one_process(name: str, mode: str, world: int):
    return run_case(name, mode, tiny_batch(_rows(mode, world), edits=mode != "per_micro_batch"))


def _expected_calls(mode: str, world: int) -> list[list[list]]:
    """Each rank's objective calls: (columns, query rows); None rows: the whole matrix. `world` 1: one process."""
    sizes = [len(rows) for rows in rows_for(mode, world)] if world > 1 else [16]
    if mode == "per_micro_batch":
        return [[[MICRO[mode], None]] * (n // MICRO[mode]) for n in sizes]
    if mode == "gathered" or world == 1:
        return [[[16, None]] for _ in sizes]
    return [[[16, n]] for n in sizes]


def _assert_same(got_terms, got_grads, key, result, grads):
    assert got_terms.keys() == result.terms.keys()
    for term, value in result.terms.items():
        assert abs(got_terms[term] - value) < 1e-10, (key, term)
    names = {k.split("/", 2)[2] for k in got_grads if k.startswith(f"{key}/")}
    assert names == set(grads)
    for pname, grad in grads.items():
        assert torch.allclose(got_grads[f"{key}/{pname}"], grad, atol=1e-10, rtol=0), (key, pname)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("name", "mode"), CASES)
def test_ranks_give_the_step_of_one_process(on_ranks, world, name, mode):
    records, grads_on_ranks = on_ranks(world)
    key = f"{name}/{mode}"
    result, grads, calls = _one_process(name, mode, world)
    assert [list(map(list, calls))] == _expected_calls(mode, 1)
    got = records[key]
    assert got["calls"] == _expected_calls(mode, world)  # the matrix sizes each rank built
    _assert_same(got["terms"], grads_on_ranks, key, result, grads)
    if mode != "gathered":
        assert got["rows"] == result.rows == 16
        assert got["monitor"].keys() == result.monitor.keys() and result.monitor
        for k, v in result.monitor.items():
            assert abs(got["monitor"][k] - v) < 1e-10, k


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", ["shard", "hybrid"])
@pytest.mark.parametrize(("name", "mode"), LAYOUT_CASES)
def test_sharded_layouts_give_the_step_of_one_process(on_ranks, world, layout, name, mode):
    """The same step with parameters sharded over all ranks (shard) and within nodes of 2 processes (hybrid: on 4
    ranks a 2 × 2 mesh): both modes, LoRA, a frozen tower, SigLIP's bias."""
    records, grads_on_ranks = on_ranks(world)
    key = f"{layout}:{name}/{mode}"
    result, grads, _ = _one_process(name, mode, world)
    assert records[key]["calls"] == _expected_calls(mode, world)
    _assert_same(records[key]["terms"], grads_on_ranks, key, result, grads)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("accumulation", ["exact", "per_micro_batch"])
def test_ranks_give_the_gradient_diagnostics_of_one_process(on_ranks, world, accumulation):
    """HN-CLIP Fig. 4's record: under per_micro_batch every rank's micro-batches of 4, listed in rank order (the
    one-process micro-batches), their mean gradient; under exact the 16 × 16 matrix. The encoder of the
    diagnostics computes in float32, so sums in another order agree to float32 rounding."""
    got = on_ranks(world)[0][f"diagnostics/{accumulation}"]
    expected = run_diagnostics(accumulation, tiny_batch(_rows(accumulation, world), edits=False))
    assert got.keys() == expected.keys()
    if accumulation == "per_micro_batch":
        assert len(got["micro_loss_infonce"]) == 4
    assert got["batch_rows"] == expected["batch_rows"] == 16
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two CUDA devices (one per rank)")
def test_two_gpus_on_nccl_give_the_step_of_one_process(tmp_path):
    """The gloo test's worker on NCCL, one GPU per rank, against one process on the CPU (float64)."""
    records, grads_on_ranks = _launch(tmp_path, 2, "nccl")
    for name, mode in CASES:
        key = f"{name}/{mode}"
        result, grads, _ = _one_process(name, mode, 2)
        assert records[key]["calls"] == _expected_calls(mode, 2), key
        _assert_same(records[key]["terms"], grads_on_ranks, key, result, grads)


def test_gather_is_the_identity_on_one_process():
    feats = {"a": torch.ones(3, 2), "m": torch.ones(3, 4, dtype=torch.bool)}
    out = gather_features(feats)
    assert out["a"] is feats["a"] and out["m"] is feats["m"]
    assert gather(feats)[1] == {"a": slice(0, 3), "m": slice(0, 3)}


@pytest.mark.parametrize(("batch", "micro", "world", "ok"), [(16, 4, 4, True), (16, 4, 2, True), (16, 8, 4, False),
                                                             (24, 4, 4, False), (16, 16, 1, True)])  # fmt: skip
def test_per_micro_batch_refuses_a_batch_that_does_not_split_over_the_ranks(batch, micro, world, ok):
    check_batch_split(batch, micro, "exact", world)  # exact needs no whole micro-batches per rank
    if ok:
        check_batch_split(batch, micro, "per_micro_batch", world)
        return
    with pytest.raises(ConfigError, match=r"train\.batch_size .* train\.micro_batch_size"):
        check_batch_split(batch, micro, "per_micro_batch", world)


def test_a_per_sample_objective_splits_its_micro_batch_over_ranks_in_equal_shares():
    """CLIP-IN's distillation (one micro-batch of 160, a per-sample loss) on 8 processes: 20 rows a rank, whose
    mean over ranks is the micro-batch's mean; a share that does not divide the micro-batch is still refused."""
    check_batch_split(160, 160, "per_micro_batch", 8, per_sample=True)
    check_batch_split(160, 80, "per_micro_batch", 8, per_sample=True)
    with pytest.raises(ConfigError, match="whole micro-batches"):
        check_batch_split(160, 160, "per_micro_batch", 8)  # a contrastive matrix cannot span ranks
    with pytest.raises(ConfigError, match="whole micro-batches"):
        check_batch_split(160, 48, "per_micro_batch", 8, per_sample=True)  # 20-row shares do not make 48


def test_a_refused_split_names_the_nearest_settings_that_run():
    """HN-CLIP's 128 as 8 micro-batches of 16 on 16 processes: 8 processes, a batch of 256, or exact all run."""
    with pytest.raises(ConfigError) as err:
        check_batch_split(128, 16, "per_micro_batch", 16)
    message = str(err.value)
    assert "8 processes" in message and "train.batch_size=256" in message and "train.accumulation=exact" in message
    check_batch_split(128, 16, "per_micro_batch", 8)
    check_batch_split(256, 16, "per_micro_batch", 16)
    check_batch_split(128, 16, "exact", 16)
    with pytest.raises(ConfigError) as err:
        check_batch_split(48, 16, "per_micro_batch", 5)  # no smaller count of processes fits either
    assert "train.batch_size=80" in str(err.value)
