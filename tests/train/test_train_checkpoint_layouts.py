"""Sharded checkpoints (train.checkpoint through torch.distributed.checkpoint) load onto another layout and another
world size with every tensor equal: a model fully_shard'ed on 2 gloo ranks onto plain modules on 2 ranks and on 1
process, onto a sharded model again, and one saved by one process onto a sharded model on 2 ranks (dcp_worker.py).
Also: the model stays one safetensors file, the DCP metadata is read without unpickling anything else, and old
checkpoints (training_state.pt) still load."""

from __future__ import annotations

import importlib.util
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sharpclip.models.factory import WEIGHTS, save_weights
from sharpclip.train import checkpoint

HERE = Path(__file__).resolve().parent
_SPEC = importlib.util.spec_from_file_location("dcp_worker", HERE / "dcp_worker.py")
dcp_worker = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(dcp_worker)  # its building blocks, run here in one process
LIMIT = 300  # seconds per launch; a rank left waiting in a collective fails the test instead of hanging
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _launch(*args: str) -> str:
    done = subprocess.run([*TORCHRUN, str(HERE / "dcp_worker.py"), *args], capture_output=True, text=True, env=ENV,
                          timeout=LIMIT)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_a_sharded_checkpoint_loads_onto_other_layouts_and_world_sizes_with_equal_tensors(tmp_path):
    out = _launch("save-sharded", str(tmp_path))
    for what in ("plan", "sharded -> replicated on 2 ranks", "sharded -> sharded on 2 ranks"):
        assert f"OK {what}" in out, out
    path = tmp_path / "sharded" / checkpoint.checkpoint_name(dcp_worker.STEPS)
    assert sorted(p.name for p in path.glob("*.safetensors")) == [WEIGHTS]  # the model: one file, gathered
    assert (path / checkpoint.STATE / "__1_0.distcp").is_file()  # each rank wrote its shards
    dcp_worker.compare(path, tmp_path / "sharded.pt", False, "sharded on 2 ranks -> 1 process", 2)

    model, optimizer, scheduler = dcp_worker.build(False, seed=0)  # one process, unsharded, onto 2 sharded ranks
    dcp_worker.train(model, optimizer, scheduler)
    dcp_worker.save(tmp_path, "plain", model, optimizer, scheduler)
    assert "OK replicated on 1 rank -> sharded on 2 ranks" in _launch("load-sharded", str(tmp_path), "plain")


def _plain_checkpoint(tmp_path: Path) -> tuple[Path, torch.nn.Module, torch.optim.Optimizer, object]:
    model, optimizer, scheduler = dcp_worker.build(False, seed=0)
    dcp_worker.train(model, optimizer, scheduler)
    return dcp_worker.save(tmp_path, "run", model, optimizer, scheduler), model, optimizer, scheduler


def test_one_process_saves_and_resumes_its_optimiser_and_schedule_exactly(tmp_path):
    path, model, optimizer, scheduler = _plain_checkpoint(tmp_path)
    dcp_worker.compare(path, tmp_path / "run.pt", False, "1 -> 1", 1)
    fresh, fresh_optimizer, fresh_scheduler = dcp_worker.build(False, seed=1)
    checkpoint.load_model(fresh, checkpoint.load_weights(path))
    checkpoint.load_sharded(path, fresh, fresh_optimizer, fresh_scheduler, 1)
    dcp_worker.train(model, optimizer, scheduler)  # both go on: the same next steps, bit for bit
    dcp_worker.train(fresh, fresh_optimizer, fresh_scheduler)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_the_metadata_reader_refuses_anything_but_dcps_records(tmp_path):
    path, *_ = _plain_checkpoint(tmp_path)
    metadata = path / checkpoint.STATE / ".metadata"

    class Payload:
        def __reduce__(self):
            return (os.system, ("echo unpickled > " + str(tmp_path / "ran"),))

    metadata.write_bytes(pickle.dumps(Payload()))
    with pytest.raises(checkpoint.CorruptCheckpoint, match="posix.system is not part of a DCP checkpoint"):
        checkpoint.load(path)
    assert not (tmp_path / "ran").exists()


def test_a_pickled_object_among_the_sharded_values_is_refused(tmp_path):
    path, model, optimizer, scheduler = _plain_checkpoint(tmp_path)
    state = checkpoint.sharded_state(model, optimizer, scheduler, [checkpoint.rng_state()])
    state["scheduler"]["lr_lambdas"] = [torch.nn.Linear(1, 1)]  # an object torch.load(weights_only=True) refuses
    shutil.rmtree(path / checkpoint.STATE)
    checkpoint.write_sharded(state, path / checkpoint.STATE)
    with pytest.raises(checkpoint.CorruptCheckpoint, match="unreadable sharded state"):
        checkpoint.load_sharded(path, model, optimizer, scheduler, 1)


def test_a_checkpoint_from_before_the_dcp_folder_still_resumes(tmp_path):
    """The previous format: model.safetensors + training_state.pt (read with weights_only=True)."""
    model, optimizer, scheduler = dcp_worker.build(False, seed=0)
    dcp_worker.train(model, optimizer, scheduler)
    old = tmp_path / "step-000002"
    old.mkdir()
    save_weights(model, old)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "rng": checkpoint.rng_state(), "rank_rng": [checkpoint.rng_state()]}, old / checkpoint.TRAINING_STATE)
    (old / checkpoint.TRAINER_STATE).write_text('{"step": 2, "loader": {}}')
    assert checkpoint.is_legacy(old)
    weights, training, _ = checkpoint.load(old)
    fresh, fresh_optimizer, _ = dcp_worker.build(False, seed=1)
    checkpoint.load_model(fresh, weights)
    fresh_optimizer.load_state_dict(training["optimizer"])
    for a, b in zip(optimizer.state.values(), fresh_optimizer.state.values(), strict=True):
        assert torch.equal(a["exp_avg"], b["exp_avg"])
