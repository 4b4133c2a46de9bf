"""Two processes on gloo, each with half the batch, give one process's loss and gradients for the whole batch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _support.tiny_towers import TinyTowers, make_batch, objective
from sharpclip.train.distributed import gather_features

WORKER = Path(__file__).with_name("dist_worker.py")
OBJECTIVES = ["infonce", "hn_clip", "filip", "hnclip_eq3"]
BATCH = 32


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist") / "grads.safetensors"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*cmd, str(out), ",".join(OBJECTIVES), str(BATCH)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return load_file(out)


def _single_process(name):
    model = TinyTowers(dropout=0.0)
    terms = objective(name)({**model.encode(make_batch(BATCH, seed=1)), **model.model_inputs()})
    terms["loss"].backward()
    return terms["loss"].detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["plain", "cached"])
@pytest.mark.parametrize("name", OBJECTIVES)
def test_two_processes_equal_one(two_process_results, name, mode):
    loss, grads = _single_process(name)
    got = two_process_results
    assert torch.allclose(got[f"{name}/{mode}/loss"][0], loss, atol=1e-10)
    names = {k.split("/", 2)[2] for k in got if k.startswith(f"{name}/{mode}/") and not k.endswith("/loss")}
    assert names == set(grads)
    for pname, grad in grads.items():
        assert torch.allclose(got[f"{name}/{mode}/{pname}"], grad, atol=1e-9, rtol=0), pname


def test_gather_is_the_identity_on_one_process():
    feats = {"a": torch.ones(3, 2), "m": torch.ones(3, 4, dtype=torch.bool)}
    out = gather_features(feats)
    assert out["a"] is feats["a"] and out["m"] is feats["m"]
