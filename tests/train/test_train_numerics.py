"""Numerical faults: a diverged update is reported as such (also when a validation meets it first), its weights never
resumed from nor exported or evaluated as the best,
non-finite weights stop the run before any checkpoint, and the logit scale is clamped to [0, ln 100]."""

from __future__ import annotations

import math

import pytest
import torch

from _support.tiny_files import tiny_config, write_generic
from _support.tiny_run import ToyLoader, toy_model
from sharpclip.cli import main
from sharpclip.train import checkpoint
from sharpclip.train.optim import clamp_logit_scale, logit_scale_ceiling
from sharpclip.train.run import run_train
from sharpclip.train.trainer import TrainingDiverged
from train.test_train_trainer import _trainer


def test_a_huge_lr_is_reported_as_a_diverged_update_and_its_checkpoint_is_not_resumed(tmp_path):
    # no weight decay: at lr·weight_decay >= 1 the config is refused before any step (config.TrainConfig)
    trainer = _trainer(tmp_path, lr=1e6, weight_decay=0.0, warmup_steps=0, checkpoint_every=1, nan_patience=3,
                       epochs=3)  # fmt: skip
    with pytest.raises(TrainingDiverged) as err:
        trainer.fit()
    message = str(err.value)
    assert "update of step 1 diverged" in message and "train.lr" in message
    assert "validate-data" not in message and "fp32" not in message  # the samples and precision are not to blame
    ckpts = tmp_path / "run" / "checkpoints"
    assert (ckpts / "step-000001" / checkpoint.DIVERGED).is_file()
    assert checkpoint.latest(ckpts) is None  # a resume will not start from the poisoned weights


def test_an_update_that_makes_a_weight_non_finite_stops_before_any_checkpoint(tmp_path):
    trainer = _trainer(tmp_path, checkpoint_every=1, epochs=1)
    step = trainer.optimizer.step

    def poisoning_step(*args, **kwargs):
        out = step(*args, **kwargs)
        if trainer.state.step == 1:  # the second update
            with torch.no_grad():
                trainer.model.hf_model.text_projection.weight[0, 0] = float("inf")
        return out

    trainer.optimizer.step = poisoning_step
    with pytest.raises(TrainingDiverged, match="update of step 2 made the weights non-finite"):
        trainer.fit()
    names = [p.name for p in checkpoint.all_checkpoints(tmp_path / "run" / "checkpoints")]
    assert names == ["step-000001"]


def test_bad_data_is_still_blamed_on_the_samples_and_fp32_runs_are_not_told_to_use_fp32(tmp_path):
    model = toy_model()
    loader = ToyLoader(model.tokenizer, batch_size=16)
    loader.pixels[:] = float("nan")
    trainer = _trainer(tmp_path, loader=loader, nan_patience=2)
    with pytest.raises(TrainingDiverged, match="validate-data") as err:
        trainer.fit()
    assert "fp32" not in str(err.value)


def test_the_logit_scale_is_clamped_from_below_and_above():
    scale = torch.nn.Parameter(torch.tensor(-3.0))
    clamp_logit_scale(scale)
    assert float(scale.detach()) == 0.0  # s = 1, not e^-3: a collapsed scale makes every logit equal
    scale.data.fill_(7.0)
    clamp_logit_scale(scale)
    assert float(scale.detach()) == pytest.approx(math.log(100))
    frozen = torch.nn.Parameter(torch.tensor(-3.0), requires_grad=False)
    clamp_logit_scale(frozen)
    assert float(frozen.detach()) == -3.0  # a frozen scale is the user's choice


def test_a_runaway_scale_update_is_clamped_in_training(tmp_path):
    trainer = _trainer(tmp_path, epochs=1, max_steps=1, warmup_steps=0)
    with torch.no_grad():
        trainer.model.logit_scale.fill_(1e-3)
    step = trainer.optimizer.step

    def shrink_scale(*args, **kwargs):
        out = step(*args, **kwargs)
        with torch.no_grad():
            trainer.model.logit_scale.sub_(50.0)  # what a huge update does to it
        return out

    trainer.optimizer.step = shrink_scale
    trainer.fit()
    assert float(trainer.model.logit_scale.detach()) == 0.0


def test_a_checkpoint_scale_above_100_is_the_ceiling_not_cut_to_100(tmp_path, monkeypatch):
    siglip = math.log(112.33)  # SigLIP SO400M's own scale
    made = toy_model()
    with torch.no_grad():
        made.logit_scale.fill_(siglip)
    monkeypatch.setattr("train.test_train_trainer.toy_model", lambda: made)
    trainer = _trainer(tmp_path, epochs=1, max_steps=2, warmup_steps=0)
    step = trainer.optimizer.step

    def raise_scale(*args, **kwargs):
        out = step(*args, **kwargs)
        with torch.no_grad():
            trainer.model.logit_scale.add_(1.0)
        return out

    trainer.optimizer.step = raise_scale
    trainer.fit()
    assert float(trainer.model.logit_scale.detach()) == pytest.approx(siglip)  # its own scale, not 100
    assert logit_scale_ceiling(None) == logit_scale_ceiling(torch.nn.Parameter(torch.tensor(1.0))) == math.log(100)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_generic(tmp_path_factory.mktemp("data"))


def _diverging(data, run, lr: str):
    """Tiny CLIP, 2 steps an epoch, validated after each: the first update blows the weights up (no weight decay:
    at lr·weight_decay >= 1 the config is refused before any step)."""
    cfg = tiny_config(data, run, f"train.lr={lr}", "train.weight_decay=0", "train.warmup_steps=0", "train.max_steps=0",
                      "train.epochs=4")  # fmt: skip
    with pytest.raises(TrainingDiverged) as err:
        run_train(cfg)
    return str(err.value)


def test_lr_1e6_with_validation_every_epoch_ends_with_the_diverged_update_message(data, tmp_path):
    message = _diverging(data, tmp_path / "run", "1e6")  # the epoch-end validation meets the NaN first
    assert "update of step 1 diverged" in message and "train.lr" in message
    assert "fp16" not in message and "embeddings contain" not in message


def test_a_diverged_checkpoint_is_never_best_for_export_or_eval(data, tmp_path, capsys):
    run = tmp_path / "run"
    message = _diverging(data, run, "1e3")  # step 1 is validated (best), then every later step fails
    ckpts = run / "checkpoints"
    assert "update of step 1 diverged" in message and (ckpts / "step-000001" / checkpoint.DIVERGED).is_file()
    assert checkpoint.best(ckpts) is None  # best.json named the diverged checkpoint: dropped
    checkpoint.mark_best(ckpts, ckpts / "step-000001", 0.5)  # a best.json from before the divergence was marked
    with pytest.raises(checkpoint.CheckpointError, match="marked diverged"):
        checkpoint.resolve_source(run, best=True)
    capsys.readouterr()
    assert main(["export", str(run), "--best", "--to", str(tmp_path / "hf")]) == 1
    assert "marked diverged" in capsys.readouterr().err and not (tmp_path / "hf").exists()
    assert main(["eval", "--model", str(run), "--best", "--suite", "retrieval"]) == 2
    assert "marked diverged" in capsys.readouterr().err
