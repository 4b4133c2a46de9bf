"""The training loop: it learns, logs, skips bad steps, resumes bit-identically after SIGKILL, and 2 processes
with half the batch each end where 1 process with the whole batch ends."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _support.tiny_run import ToyLoader, toy_model, train_config
from sharpclip.config import LossConfig, ModelConfig, TermConfig
from sharpclip.models.factory import save_checkpoint
from sharpclip.train import checkpoint
from sharpclip.train.features import build_objective
from sharpclip.train.optim import param_groups, warmup_cosine
from sharpclip.train.trainer import Trainer, TrainingDiverged

WORKER = Path(__file__).with_name("trainer_worker.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
BASE = ["checkpoint_every=2"]  # 4 steps per epoch: checkpoints mid-epoch and at its end


def _trainer(tmp_path, terms=None, loader=None, **overrides):
    model = toy_model()
    terms = terms or {"hn": TermConfig("hn_clip"), "tok": TermConfig("filip", weight=0.5)}
    cfg = train_config(str(tmp_path / "run"), **overrides)
    loader = loader or ToyLoader(model.tokenizer, batch_size=cfg.batch_size)
    objective = build_objective(LossConfig(terms=terms))

    def write_model(d: Path) -> None:
        save_checkpoint(model, d, ModelConfig(name="tiny-clip"))

    return Trainer(model, objective, loader, cfg, tmp_path / "run", write_model=write_model)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_training_lowers_the_loss_and_logs_every_term(tmp_path):
    model = toy_model()
    loader = ToyLoader(model.tokenizer, n=16, batch_size=16)  # one batch to memorise
    terms = {"clip": TermConfig("infonce"), "tok": TermConfig("filip", weight=0.1)}
    trainer = _trainer(tmp_path, terms=terms, loader=loader, epochs=12, lr=3e-3, warmup_steps=0)
    trainer.fit()
    steps = [r for r in _records(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert len(steps) == 12
    for key in ("clip", "tok", "loss", "lr", "logit_scale", "samples_per_s", "seen", "infonce_monitor", "grad_norm"):
        assert key in steps[0], key
    first, last = sum(r["loss"] for r in steps[:3]), sum(r["loss"] for r in steps[-3:])
    assert last < 0.8 * first
    assert steps[-1]["seen"] == 12 * 16
    saturation = [r for r in _records(tmp_path / "run" / "metrics.jsonl") if "saturated_batches" in r]
    assert len(saturation) == 12


def test_schedule_warms_up_then_decays_to_the_floor():
    assert warmup_cosine(0, 4, 20) == pytest.approx(0.25)
    assert warmup_cosine(3, 4, 20) == pytest.approx(1.0)
    assert warmup_cosine(12, 4, 20) == pytest.approx(0.5)
    assert warmup_cosine(20, 4, 20, min_ratio=0.1) == pytest.approx(0.1)


def test_no_weight_decay_on_gains_biases_and_the_logit_scale():
    model = toy_model()
    groups = param_groups(model.named_parameters(), 1e-4, 0.1, {"backbone.text_model": 5e-5})
    for group in groups:
        for name in group["names"]:
            no_decay = any(w in name for w in ("bias", "norm", "logit_scale")) or "layer_norm" in name
            assert (group["weight_decay"] == 0) == (no_decay or model.get_parameter(name).ndim < 2), name
            assert group["lr"] == (5e-5 if name.startswith("backbone.text_model") else 1e-4), name


def test_logit_scale_is_clamped_after_each_step(tmp_path):
    trainer = _trainer(tmp_path, epochs=1, lr=10.0, weight_decay=0.0, warmup_steps=0, grad_clip=0.0)
    with torch.no_grad():
        trainer.model.logit_scale.fill_(math.log(99.9))
    trainer.fit()
    assert float(trainer.model.logit_scale.detach()) <= math.log(100) + 1e-6


def test_non_finite_steps_are_skipped_then_stop_the_run(tmp_path, caplog):
    model = toy_model()
    loader = ToyLoader(model.tokenizer, batch_size=16)
    loader.pixels[:] = float("nan")  # every batch poisons the loss
    trainer = _trainer(tmp_path, loader=loader, nan_patience=3, epochs=2)
    with pytest.raises(TrainingDiverged, match="3 consecutive steps"):
        trainer.fit()
    skipped = [r for r in _records(tmp_path / "run" / "metrics.jsonl") if r.get("skipped")]
    assert len(skipped) == 3 and all(r["ids"][0].startswith("toy-") for r in skipped)
    assert trainer.state.step == 0


def test_bf16_autocast_and_gradient_checkpointing_train(tmp_path):
    trainer = _trainer(tmp_path, epochs=1, max_steps=2, precision="bf16", grad_checkpointing=True)
    assert trainer.model.hf_model.is_activation_checkpointing
    before = trainer.model.hf_model.text_projection.weight.detach().clone()
    trainer.fit()
    steps = [r for r in _records(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert len(steps) == 2 and all(math.isfinite(r["loss"]) for r in steps)
    assert not torch.equal(before, trainer.model.hf_model.text_projection.weight)


def test_diagnostics_record_both_gradients(tmp_path):
    trainer = _trainer(tmp_path, epochs=1, diagnostics_every=2)
    trainer.fit()
    records = _records(tmp_path / "run" / "diagnostics.jsonl")
    assert [r["step"] for r in records] == [0, 2]
    r = records[0]
    assert r["batch_rows"] == 16
    assert r["loss_hn"] > r["loss_infonce"] > 0  # the margin only adds to the negatives' logits
    assert r["grad_norm_infonce"] > 0 and r["grad_norm_hn"] > 0 and -1 <= r["grad_cosine"] <= 1
    assert r["grad_zero_infonce"] == 0.0 and 0 <= r["margin_mean"] <= r["margin_hardest"] <= 1


def test_diagnostics_with_gamma_zero_compare_a_gradient_with_itself(tmp_path):
    """γ comes from the configured hn_clip term: at γ = 0 the HN gradient is InfoNCE's."""
    terms = {"hn": TermConfig("hn_clip", params={"gamma": 0.0})}
    trainer = _trainer(tmp_path, terms=terms, epochs=1, max_steps=1, diagnostics_every=1)
    trainer.fit()
    r = _records(tmp_path / "run" / "diagnostics.jsonl")[0]
    assert r["grad_cosine"] == pytest.approx(1.0, abs=1e-5) and r["grad_norm_ratio"] == pytest.approx(1.0, abs=1e-5)


def test_diagnostics_under_per_micro_batch_measure_each_micro_batch(tmp_path):
    """The paper's 16 × 8: each micro-batch's own InfoNCE and zero-gradient flag; the step's gradient is their mean."""
    from sharpclip.train.diagnostics import gradient_diagnostics
    from sharpclip.train.features import FeatureEncoder
    from sharpclip.train.step import run_step

    trainer = _trainer(tmp_path, terms={"clip": TermConfig("infonce")}, epochs=1, accumulation="per_micro_batch")
    batch = next(iter(trainer.loader))
    encoder = FeatureEncoder(trainer.model, trainer.objective.feature_keys)
    r = gradient_diagnostics(encoder, batch, 4, 0.5, "per_micro_batch")
    assert len(r["micro_loss_infonce"]) == len(r["micro_grad_zero_infonce"]) == 4 and r["batch_rows"] == 16
    assert r["loss_infonce"] == pytest.approx(sum(r["micro_loss_infonce"]) / 4, rel=1e-5)
    assert r["micro_grad_zero_infonce"] == [0.0] * 4
    trainer.model.zero_grad(set_to_none=True)
    run_step(encoder, trainer.objective, batch, 4, "per_micro_batch")  # what training does with this batch
    trained = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
    assert r["grad_norm_infonce"] == pytest.approx(float(trained.norm()), rel=1e-4)
    whole = gradient_diagnostics(encoder, batch, 4, 0.5, "exact")  # one 16 × 16 matrix: another gradient
    assert "micro_loss_infonce" not in whole and whole["loss_infonce"] != pytest.approx(r["loss_infonce"])


def test_checkpoints_keep_the_last_n_and_the_best(tmp_path):
    scores = iter([0.2, 0.5, 0.3, 0.1])
    trainer = _trainer(tmp_path, epochs=4, keep_last=1)
    trainer.evaluate = lambda model: {"mean_R@1": next(scores)}
    trainer.fit()
    ckpts = tmp_path / "run" / "checkpoints"
    names = [p.name for p in checkpoint.all_checkpoints(ckpts)]
    assert names == ["step-000008", "step-000016"]  # the best (epoch 2) and the last
    assert checkpoint.best(ckpts).name == "step-000008"
    keys = checkpoint.sharded_keys(ckpts / "step-000016")  # the DCP folder: optimiser, scheduler, RNG
    assert {k.split(".")[0] for k in keys} == {"optimizer", "scheduler", "rng"}
    assert any(k.endswith(".exp_avg") for k in keys)


def _run(
    tmp_path: Path, name: str, *args: str, fault: str | None = None, procs: int = 1
) -> subprocess.CompletedProcess:
    out = tmp_path / f"{name}.safetensors"
    launcher = [sys.executable]
    if procs > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs)]
    env = {**ENV, "SHARPCLIP_FAULT": fault} if fault else ENV
    cmd = [*launcher, str(WORKER), str(tmp_path / name), str(out), *BASE, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    proc = _run(tmp, "ref")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_file(tmp / "ref.safetensors")


@pytest.fixture(scope="module")
def uninterrupted_with_dropout(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref_dropout")
    proc = _run(tmp, "ref", "dropout")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_file(tmp / "ref.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["step:3", "checkpoint:4"])
def test_sigkill_then_resume_is_bit_identical(tmp_path, uninterrupted_with_dropout, fault):
    """With attention dropout on, so the RNG states in the checkpoint matter as much as the optimiser's."""
    uninterrupted = uninterrupted_with_dropout
    killed = _run(tmp_path, "run", "dropout", fault=fault)
    assert killed.returncode == -9, killed.stderr[-3000:]  # died by SIGKILL mid-epoch
    ckpts = tmp_path / "run" / "checkpoints"
    assert checkpoint.latest(ckpts).name == "step-000002"  # the interrupted write left no checkpoint behind
    resumed = _run(tmp_path, "run", "resume", "dropout")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    weights = load_file(tmp_path / "run.safetensors")
    assert weights.keys() == uninterrupted.keys()
    for key, value in uninterrupted.items():
        assert torch.equal(weights[key], value), key
    assert not list(ckpts.glob(".step-*.tmp"))


@pytest.mark.slow
def test_two_processes_end_with_the_weights_of_one(tmp_path, uninterrupted):
    proc = _run(tmp_path, "ddp", procs=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    weights = load_file(tmp_path / "ddp.safetensors")
    for key, value in uninterrupted.items():
        assert torch.allclose(weights[key], value, atol=2e-5, rtol=1e-4), key


def test_tensorboard_and_wandb_sinks_receive_every_step(tmp_path, monkeypatch):
    """The optional sinks are wired to the same records as metrics.jsonl (fake modules stand in for the extras)."""
    import types

    calls: dict[str, list] = {"tb": [], "wandb": []}

    class Writer:
        def __init__(self, logdir):
            calls["tb_dir"] = logdir

        def add_scalar(self, key, value, step):
            calls["tb"].append((key, step))

        def close(self):
            calls["tb_closed"] = True

    class Run:
        def log(self, numbers, step):
            calls["wandb"].append((sorted(numbers), step))

        def finish(self):
            calls["wandb_finished"] = True

    def init(**kwargs):
        calls.setdefault("init", []).append(kwargs)
        return Run()

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("train:\n  lr: 0.001\n")  # what run_train writes first
    trainer = _trainer(tmp_path, epochs=1, max_steps=2, tensorboard=True, wandb=True, wandb_project="proj",
                       diagnostics_every=1)  # fmt: skip
    trainer.fit()
    assert ("train/loss", 1) in calls["tb"] and ("train/loss", 2) in calls["tb"] and calls["tb_closed"]
    assert any(k.startswith("diag/") for k, _ in calls["tb"]) and all(k.split("/")[0] in ("train", "eval", "diag")
                                                                      for k, _ in calls["tb"])  # fmt: skip
    assert [step for keys, step in calls["wandb"] if "train/lr" in keys] == [1, 2]
    assert calls["wandb_finished"] and calls["tb_dir"].endswith("tensorboard")
    first = calls["init"][0]
    assert first["project"] == "proj" and first["name"] == "run" and first["config"] == {"train": {"lr": 0.001}}
    assert first["resume"] == "allow" and len(first["id"]) == 16
    _trainer(tmp_path, epochs=1, max_steps=2, wandb=True).fit()  # the same run directory again, as --resume does
    assert calls["init"][1]["id"] == first["id"]


def test_per_micro_batch_counts_every_micro_batch(tmp_path):
    """seen, samples/s and the saturation monitor cover all micro-batches of a step, not the last."""
    from sharpclip.losses.monitors import infonce_saturation
    from sharpclip.train.features import FeatureEncoder
    from sharpclip.train.step import run_step, split_rows

    trainer = _trainer(tmp_path, terms={"clip": TermConfig("infonce")}, epochs=1, micro_batch_size=4,
                       accumulation="per_micro_batch")  # fmt: skip
    batch = next(iter(trainer.loader))
    encoder = FeatureEncoder(trainer.model, trainer.objective.feature_keys)
    with torch.no_grad():
        parts = [encoder(mb) for mb in split_rows(batch, 4)]
        expected = [infonce_saturation(f["image"], f["text"], trainer.model.logit_scale) for f in parts]
    trainer.model.zero_grad()
    result = run_step(encoder, trainer.objective, batch, 4, "per_micro_batch").read()
    assert result.rows == 16
    assert result.monitor["matrices_monitor"] == 4
    assert result.monitor["infonce_monitor"] == pytest.approx(sum(float(m["infonce"]) for m in expected) / 4, rel=1e-5)
    assert result.monitor["saturated_monitor"] == sum(m["infonce"] < 1e-3 for m in expected) / 4
    trainer.fit()
    steps = [r for r in _records(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert [r["seen"] for r in steps] == [16 * (k + 1) for k in range(len(steps))]
    assert all(r["matrices_monitor"] == 4 for r in steps)
