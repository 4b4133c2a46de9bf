"""Sharded checkpoints (train.checkpoint through torch.distributed.checkpoint) load onto another layout and another
world size with every tensor equal: a model fully_shard'ed on 2 gloo ranks onto plain modules on 2 ranks and on 1
process, onto a sharded model again, and one saved by one process onto a sharded model on 2 ranks (dcp_worker.py).
Also: the model stays one safetensors file, the DCP metadata is read without unpickling anything else, and old
checkpoints (training_state.pt) still load."""

from __future__ import annotations

import importlib.util
import json
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
    for what in ("plan", "sharded -> replicated on 2 ranks", "sharded -> sharded on 2 ranks",
                 "asynchronous sharded save -> replicated"):  # fmt: skip
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
    with pytest.raises(checkpoint.CorruptCheckpoint, match="when it was written"):  # its recorded size, first
        checkpoint.load(path)
    record = path / checkpoint.TRAINER_STATE  # rewritten too (or a checkpoint from before the record): unpickled safely
    record.write_text(json.dumps({k: v for k, v in json.loads(record.read_text()).items() if k != "files"}))
    with pytest.raises(checkpoint.CorruptCheckpoint, match=r"posix\.system is not part of a DCP checkpoint"):
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
    torch.save(
        {
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": checkpoint.rng_state(),
            "rank_rng": [checkpoint.rng_state()],
        },
        old / checkpoint.TRAINING_STATE,
    )
    (old / checkpoint.TRAINER_STATE).write_text('{"step": 2, "loader": {}}')
    assert checkpoint.is_legacy(old)
    weights, training, _ = checkpoint.load(old)
    fresh, fresh_optimizer, _ = dcp_worker.build(False, seed=1)
    checkpoint.load_model(fresh, weights)
    fresh_optimizer.load_state_dict(training["optimizer"])
    for a, b in zip(optimizer.state.values(), fresh_optimizer.state.values(), strict=True):
        assert torch.equal(a["exp_avg"], b["exp_avg"])


def test_the_trainer_resumes_an_older_checkpoint_as_it_resumes_a_sharded_one(tmp_path):
    """A run's checkpoint rewritten in the previous format (training_state.pt) resumes to the same optimiser state,
    schedule and weights as the checkpoint itself."""
    from _support.tiny_files import tiny_config, write_generic
    from sharpclip.train.run import build_trainer, run_train

    cfg = tiny_config(write_generic(tmp_path / "data"), tmp_path / "run", "train.eval_every=0")
    run_train(cfg)
    new = checkpoint.latest(tmp_path / "run" / "checkpoints")
    resumed = build_trainer(cfg)
    resumed.resume(new)
    old = tmp_path / "old" / new.name
    shutil.copytree(new, old, ignore=shutil.ignore_patterns(checkpoint.STATE))
    state = {"optimizer": resumed.optimizer.state_dict(), "scheduler": resumed.scheduler.state_dict(),
             "rng": checkpoint.rng_state(), "rank_rng": [checkpoint.rng_state()]}  # fmt: skip
    torch.save(state, old / checkpoint.TRAINING_STATE)
    record = old / checkpoint.TRAINER_STATE  # that format recorded no file digests
    record.write_text(json.dumps({k: v for k, v in json.loads(record.read_text()).items() if k != "files"}))
    legacy = build_trainer(cfg)
    legacy.resume(old)
    assert legacy.scheduler.last_epoch == resumed.scheduler.last_epoch == 2
    for a, b in zip(resumed.optimizer.state.values(), legacy.optimizer.state.values(), strict=True):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    for a, b in zip(resumed.model.parameters(), legacy.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_an_asynchronous_save_holds_its_steps_state_while_training_goes_on(tmp_path):
    model, optimizer, scheduler = dcp_worker.build(False, seed=0)
    dcp_worker.train(model, optimizer, scheduler)
    torch.save({**dcp_worker.whole(model, optimizer), "last_epoch": scheduler.last_epoch}, tmp_path / "at_save.pt")
    sharded = checkpoint.sharded_state(model, optimizer, scheduler, [checkpoint.rng_state()])
    weights = checkpoint.snapshot(model)
    pending = checkpoint.begin_save(tmp_path / "run", dcp_worker.STEPS, lambda d: save_weights(model, d, weights),
                                    sharded, {"step": dcp_worker.STEPS, "loader": {}}, asynchronous=True)  # fmt: skip
    assert not pending.final.exists()  # renamed only once everything is written
    dcp_worker.train(model, optimizer, scheduler, steps=1)  # training goes on while it is written
    path = pending.wait()
    assert path == pending.final and path.is_dir() and not list(path.parent.glob(".step-*"))
    dcp_worker.compare(path, tmp_path / "at_save.pt", False, "asynchronous", 1)


def test_train_async_checkpoint_gives_the_checkpoints_of_synchronous_saves(tmp_path, monkeypatch):
    """Forced on for the CPU (the setting is CUDA-only): the same files, the folder complete at the next save or the
    run's end, pruning after the rename."""
    from safetensors.torch import load_file

    from _support.tiny_files import tiny_config, write_generic
    from sharpclip.train import trainer
    from sharpclip.train.run import run_train

    root = write_generic(tmp_path / "data")
    runs = {}
    for mode in ("sync", "async"):
        if mode == "async":
            monkeypatch.setattr(trainer, "ASYNC_CHECKPOINT_DEVICES", ("cuda", "cpu"))
        run = tmp_path / mode
        run_train(tiny_config(root, run, "train.eval_every=0", "train.max_steps=3", "train.keep_last=2",
                              f"train.async_checkpoint={mode == 'async'}"))  # fmt: skip
        runs[mode] = run / "checkpoints"
    assert "in the background" in (tmp_path / "async" / "train.log").read_text()
    names = [p.name for p in checkpoint.all_checkpoints(runs["async"])]
    assert names == [p.name for p in checkpoint.all_checkpoints(runs["sync"])] == ["step-000002", "step-000003"]
    for name in names:
        a, b = (load_file(str(runs[m] / name / WEIGHTS)) for m in ("sync", "async"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert checkpoint.sharded_keys(runs["sync"] / name) == checkpoint.sharded_keys(runs["async"] / name)
