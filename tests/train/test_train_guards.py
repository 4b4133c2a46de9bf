"""Forgetting guards in training (train.guards): the floor rule picks the best checkpoint; deltas are measured
against the initial model, evaluated once before the first step and read back on resume."""

from __future__ import annotations

import json

import pytest

from _support.tiny_files import tiny_config, write_generic
from _support.tiny_run import ToyLoader, toy_model, train_config
from sharpclip.config import ConfigError, LossConfig, ModelConfig, TermConfig, load_config
from sharpclip.eval.guards import GUARDS_HOLD
from sharpclip.models.factory import save_checkpoint
from sharpclip.train import checkpoint
from sharpclip.train.features import build_objective
from sharpclip.train.run import GUARDS_INITIAL, run_train
from sharpclip.train.trainer import Trainer


def test_the_best_checkpoint_is_the_best_target_whose_guards_hold(tmp_path):
    sequence = iter(
        [
            {"mean_R@1": 0.2, GUARDS_HOLD: 1.0},
            {"mean_R@1": 0.9, GUARDS_HOLD: 0.0},  # the highest target, but a floor was crossed
            {"mean_R@1": 0.5, GUARDS_HOLD: 1.0},
            {"mean_R@1": 0.4, GUARDS_HOLD: 1.0},
        ]
    )
    model = toy_model()
    cfg = train_config(str(tmp_path / "run"), epochs=4, keep_last=1)
    objective = build_objective(LossConfig(terms={"clip": TermConfig("infonce")}))
    trainer = Trainer(
        model, objective, ToyLoader(model.tokenizer, batch_size=16), cfg, tmp_path / "run",
        write_model=lambda d: save_checkpoint(model, d, ModelConfig(name="tiny-clip")),
        evaluate=lambda model: next(sequence),
    )  # fmt: skip
    trainer.fit()
    ckpts = tmp_path / "run" / "checkpoints"
    assert checkpoint.best(ckpts).name == "step-000012"  # epoch 2 (0.5), not epoch 1 (0.9)
    assert json.loads((ckpts / checkpoint.BEST).read_text())["metric"] == 0.5


def test_guards_are_logged_as_deltas_from_the_initial_model(tmp_path):
    data = write_generic(tmp_path / "data")
    guards = "train.guards=[{metric: retrieval/mean_R@1, max_drop: 100}, {metric: retrieval/t2i/R@5}]"
    cfg = tiny_config(data, tmp_path / "run", guards, "train.max_steps=4", "eval.recall_k=[1,5]")
    run_train(cfg)
    initial = json.loads((tmp_path / "run" / GUARDS_INITIAL).read_text())
    evals = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if
             "eval/guard/retrieval/t2i/R@5" in r]  # fmt: skip
    assert evals, "no evaluation recorded the guards"
    for r in evals:
        want = r["eval/guard/retrieval/t2i/R@5"] - initial["retrieval"]["t2i"]["R@5"]
        assert r["eval/guard_delta/retrieval/t2i/R@5"] == pytest.approx(want)
        assert r[f"eval/{GUARDS_HOLD}"] == 1.0  # a floor of 100 points always holds
    assert checkpoint.best(tmp_path / "run" / "checkpoints") is not None


def test_a_resume_reads_the_initial_evaluation_back(tmp_path):
    data = write_generic(tmp_path / "data")
    guards = "train.guards=[{metric: retrieval/mean_R@1}]"
    run_train(tiny_config(data, tmp_path / "run", guards, "train.max_steps=2"))
    path = tmp_path / "run" / GUARDS_INITIAL
    saved = json.loads(path.read_text())
    saved["retrieval"]["t2i"]["R@1"] = saved["retrieval"]["i2t"]["R@1"] = -1000.0  # recognisable, not re-measured
    path.write_text(json.dumps(saved))
    run_train(tiny_config(data, tmp_path / "run", guards, "train.max_steps=4"), resume=tmp_path / "run")
    last = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["eval/guard_delta/retrieval/mean_R@1"] == pytest.approx(last["eval/guard/retrieval/mean_R@1"] + 1000)


def test_guard_settings_are_checked_when_the_config_loads() -> None:
    with pytest.raises(ConfigError, match="suite/key"):
        load_config(None, ["train.guards=[{metric: top1}]"])
    with pytest.raises(ConfigError, match="max_drop must be >= 0"):
        load_config(None, ["train.guards=[{metric: zeroshot/top1, max_drop: -1}]"])
    with pytest.raises(ConfigError, match="eval_every"):
        load_config(None, ["train.guards=[{metric: zeroshot/top1}]", "train.eval_every=0"])
