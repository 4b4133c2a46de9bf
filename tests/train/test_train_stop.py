"""A stop signal ends a run cleanly (its step finished, a checkpoint written, `Stopped`), a second SIGTERM ends it at
once with the last complete checkpoint intact, and checkpoints come by the clock (train.stop)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _support.tiny_files import write_generic
from _support.tiny_run import ToyLoader, toy_model, train_config
from sharpclip.config import ConfigError, LossConfig, ModelConfig, TermConfig, TrainConfig
from sharpclip.models.factory import save_checkpoint
from sharpclip.train import checkpoint
from sharpclip.train.features import build_objective
from sharpclip.train.stop import RunControl, Stopped
from sharpclip.train.trainer import Trainer

WORKER = Path(__file__).with_name("trainer_worker.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _trainer(run: Path, **overrides) -> Trainer:
    model = toy_model()
    cfg = train_config(str(run), **overrides)  # 2 epochs of 4 steps
    objective = build_objective(LossConfig(terms={"c": TermConfig("infonce")}))

    def write_model(d: Path, state: dict | None = None) -> None:
        save_checkpoint(model, d, ModelConfig(name="tiny-clip"), state=state)

    return Trainer(model, objective, ToyLoader(model.tokenizer, batch_size=cfg.batch_size), cfg, run, write_model)


def _steps(run: Path) -> list[str]:
    return [p.name for p in checkpoint.all_checkpoints(run / "checkpoints")]


def test_a_stop_signal_finishes_the_step_checkpoints_it_and_the_resume_ends_at_the_uninterrupted_weights(
    tmp_path, monkeypatch
):
    reference = _trainer(tmp_path / "ref")
    reference.fit()
    monkeypatch.setenv("SHARPCLIP_SIGNAL", "step:2:SIGUSR1")  # arrives after step 2: agreed before step 3
    stopped = _trainer(tmp_path / "run")
    with pytest.raises(Stopped, match="stopped by a signal after step 3; checkpoint step-000003 written"):
        stopped.fit()
    assert _steps(tmp_path / "run") == ["step-000003"]  # no epoch-end save: only the stop's
    monkeypatch.delenv("SHARPCLIP_SIGNAL")
    resumed = _trainer(tmp_path / "run")
    resumed.resume(checkpoint.latest(tmp_path / "run" / "checkpoints"))
    assert resumed.fit().step == 8
    for key, value in reference.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[key], value), key


def test_the_signal_handlers_are_restored_after_training(tmp_path):
    import signal

    before = signal.getsignal(signal.SIGTERM)
    _trainer(tmp_path / "run", epochs=1).fit()
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("asynchronous", [False, True])
def test_checkpoints_by_rank_0s_clock_are_agreed_and_pruned_by_keep_last(tmp_path, monkeypatch, asynchronous):
    """Also with train.async_checkpoint (forced on for the CPU): the clock starts again when a save starts, not
    when its background write is found done at the next save (else every step after the first would save)."""
    clock = iter(range(0, 10_000, 7))  # each look at the clock is 7 "seconds" later
    monkeypatch.setattr("sharpclip.train.stop.clock", lambda: next(clock))
    monkeypatch.setattr("sharpclip.train.trainer.ASYNC_CHECKPOINT_DEVICES", ("cuda", "cpu"))
    every_12_s = {"checkpoint_every_min": 0.2, "keep_last": 1, "async_checkpoint": asynchronous}
    trainer = _trainer(tmp_path / "run", epochs=2, **every_12_s)
    saves, save = [], trainer.save
    monkeypatch.setattr(trainer, "save", lambda best=False: saves.append(trainer.state.step) or save(best))
    trainer.fit()
    # the clock starts at 0: due at step 2 (14 s), again 14 s after that save (step 4, also the epoch's end), ...
    assert saves == [2, 4, 4, 6, 8, 8]
    assert _steps(tmp_path / "run") == ["step-000008"]  # keep_last=1 (no validation: no best to keep)
    assert trainer.control.save_now is False


def test_a_clock_checkpoint_is_rank_0s_decision():
    clocked = RunControl([], 1.0, is_main=False)
    clocked._last_save -= 3600
    assert clocked.requests() == (0.0, 0.0)  # another rank's clock does not count
    main = RunControl([], 1.0, is_main=True)
    main._last_save -= 3600
    assert main.requests() == (0.0, 1.0)
    main.agreed([0.0, 1.0])
    assert main.save_now and not main.stopping


def test_a_sigterm_repeated_at_once_is_the_same_request(monkeypatch):
    """At a preemption slurmd signals every task and srun forwards its own SIGTERM too: not a second request."""
    import signal

    control = RunControl(["SIGTERM"], 0.0, is_main=True)
    killed = []
    monkeypatch.setattr("sharpclip.train.stop.os.kill", lambda pid, sig: killed.append(sig))
    now = [50.0]
    monkeypatch.setattr("sharpclip.train.stop.clock", lambda: now[0])
    with control.signals():
        control._handle(signal.SIGTERM, None)
        control._handle(signal.SIGTERM, None)  # the same instant: a duplicate
        assert killed == [] and control.requests() == (1.0, 0.0)
        now[0] += 3
        control._handle(signal.SIGTERM, None)  # later: the user insists
        assert killed == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_stop_signals_are_checked():
    with pytest.raises(ConfigError, match=r"train\.stop_signals"):
        TrainConfig(stop_signals=["SIGKILL"])


@pytest.mark.slow
def test_a_second_sigterm_ends_at_once_and_leaves_the_last_complete_checkpoint(tmp_path):
    """The first SIGTERM after step 3 asks for the stop; the second comes inside step 4's checkpoint write (files
    written, not yet renamed), more than stop.REPEAT_S later: the process dies by SIGTERM, step-2 stays complete,
    and a resume finishes the run."""
    env = {**ENV, "SHARPCLIP_SIGNAL": "step:3:SIGTERM;checkpoint:4:SIGTERM", "SHARPCLIP_DELAY": "step:3:2.5"}
    cmd = [sys.executable, str(WORKER), str(tmp_path / "run"), str(tmp_path / "w.safetensors"), "checkpoint_every=2"]
    killed = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert killed.returncode == -15, killed.stderr[-3000:]
    ckpts = tmp_path / "run" / "checkpoints"
    assert _steps(tmp_path / "run") == ["step-000002"] and (ckpts / ".step-000004.tmp").is_dir()
    resumed = subprocess.run([*cmd, "resume"], capture_output=True, text=True, env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert load_file(tmp_path / "w.safetensors")
    assert _steps(tmp_path / "run")[-1] == "step-000008"


@pytest.mark.slow
def test_a_signal_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """SIGTERM on rank 1 only, after step 2: the request rides on the step's flags, so rank 0 stops at the same step;
    both write their part of one checkpoint and exit 75."""
    data = write_generic(tmp_path / "data", n=16)
    args = ["-m", "sharpclip", "train", "model.name=tiny-clip", "data.format=generic", f"data.root={data}",
            "data.num_workers=0", f"train.output_dir={tmp_path / 'run'}", "train.device=cpu", "train.batch_size=4",
            "train.micro_batch_size=2", "train.max_steps=8", "train.epochs=2", "train.eval_every=0",
            "train.progress=false", "train.dist_timeout_min=10"]  # fmt: skip
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in (0, 1):
        env = {**ENV, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "SHARPCLIP_SIGNAL": "step:2:SIGTERM:1"}  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env))  # fmt: skip
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [75, 75], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    assert "stopped by a signal after step 3; checkpoint step-000003 written" in outputs[0][0]
    assert "another rank received a stop signal" in outputs[0][1]
    assert "SIGTERM reached this rank" in outputs[1][1]
    assert _steps(tmp_path / "run") == ["step-000003"]
