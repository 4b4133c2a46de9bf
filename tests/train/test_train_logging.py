"""What a run tells its user: the model and its parameter counts, the tiny-preset warning, one epoch convention."""

from __future__ import annotations

import json
import logging
import re

from _support.tiny_run import ToyLoader, toy_model, train_config
from sharpclip.cli import main
from sharpclip.config import LossConfig, ModelConfig, TermConfig
from sharpclip.models import save_checkpoint
from sharpclip.train.features import build_objective
from sharpclip.train.logging import tag
from sharpclip.train.run import log_model, warn_tiny
from sharpclip.train.trainer import Trainer


def test_every_record_counts_epochs_from_zero_evaluations_included(tmp_path):
    model = toy_model()
    cfg = train_config(str(tmp_path / "run"), epochs=2, batch_size=8, micro_batch_size=8, warmup_steps=0,
                       accumulation="per_micro_batch")  # fmt: skip
    loader = ToyLoader(model.tokenizer, n=16, batch_size=8)
    objective = build_objective(LossConfig(terms={"c": TermConfig("infonce")}))
    write = lambda d: save_checkpoint(model, d, ModelConfig())  # noqa: E731
    trainer = Trainer(model, objective, loader, cfg, tmp_path / "run", write, evaluate=lambda m: {"mean_R@1": 1.0})
    trainer.fit()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [(r["step"], r["epoch"]) for r in records if "loss" in r]
    evals = [(r["step"], r["epoch"]) for r in records if "eval/mean_R@1" in r]
    assert steps == [(1, 0), (2, 0), (3, 1), (4, 1)]
    assert evals == [(2, 0), (4, 1)]  # the evaluation after epoch 0 is recorded under epoch 0, like its steps


def test_the_model_and_its_parameter_counts_are_logged(caplog):
    model = toy_model()
    for p in model.vision_model.parameters():
        p.requires_grad_(False)
    with caplog.at_level(logging.INFO, logger="sharpclip.train"):
        total, trainable = log_model(model, "tiny-clip")
    assert 0 < trainable < total == sum(p.numel() for p in model.parameters())
    assert f"model tiny-clip (CLIPModel): {total:,} parameters, {trainable:,} trainable" in caplog.text


def test_training_a_tiny_preset_warns_and_a_real_name_does_not(caplog):
    with caplog.at_level(logging.WARNING, logger="sharpclip.train"):
        warn_tiny("/models/clip-vit-large-patch14")
        assert not caplog.text
        warn_tiny("tiny-clip")
    assert "tiny preset with random weights" in caplog.text


def test_sink_names_are_grouped():
    assert [tag(k) for k in ("loss", "lr", "eval/mean_R@1", "diag/cos")] == [
        "train/loss",
        "train/lr",
        "eval/mean_R@1",
        "diag/cos",
    ]


def test_version_flag(capsys):
    from sharpclip import __version__

    try:
        main(["--version"])
    except SystemExit as stop:
        assert stop.code == 0
    assert capsys.readouterr().out.strip() == f"sharpclip {__version__}"


class FakeWandb:
    """Stands in for the `wandb` module (not installed here): records what `init`, `log` and `finish` received."""

    def __init__(self) -> None:
        self.inits: list[dict] = []
        self.logs: list[tuple[dict, int]] = []

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self

    def log(self, numbers: dict, step: int) -> None:
        self.logs.append((dict(numbers), step))

    def finish(self) -> None:
        pass


def test_wandb_gets_the_config_on_a_fresh_run_and_each_step_one_epoch(tmp_path, monkeypatch):
    from _support.tiny_files import write_generic

    fake = FakeWandb()
    monkeypatch.setitem(__import__("sys").modules, "wandb", fake)
    data = write_generic(tmp_path / "data")
    args = ["train", "model.name=tiny-clip", "data.format=generic", f"data.root={data}", "data.num_workers=0",
            f"train.output_dir={tmp_path / 'run'}", "train.batch_size=4", "train.micro_batch_size=4", "train.epochs=2",
            "train.progress=false", "train.wandb=true", "train.lr=3e-4"]  # fmt: skip
    assert main(args) == 0
    (init,) = fake.inits
    assert set(init["config"]) == {"model", "data", "loss", "train", "eval"}
    assert init["config"]["train"]["lr"] == 3e-4 and init["name"] == "run"
    epochs = [step for numbers, step in fake.logs if "train/epoch" in numbers]
    assert epochs == [1, 2, 3, 4]  # 2 epochs of 2 steps, each step's epoch once (not again with its evaluation)
    assert any("eval/mean_R@1" in numbers for numbers, _ in fake.logs)


def test_the_progress_bar_shows_throughput_and_data_wait_beside_the_loss(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("sharpclip.progress.on_terminal", lambda: True)  # bars draw on a terminal only
    model = toy_model()
    cfg = train_config(str(tmp_path / "run"), epochs=1, batch_size=8, micro_batch_size=8, progress=True)
    loader = ToyLoader(model.tokenizer, n=16, batch_size=8)
    objective = build_objective(LossConfig(terms={"c": TermConfig("infonce")}))
    write = lambda d: save_checkpoint(model, d, ModelConfig())  # noqa: E731
    Trainer(model, objective, loader, cfg, tmp_path / "run", write).fit()
    bar = capsys.readouterr().err.split("\r")[-1]
    assert re.search(r"2/2 .*loss=\d+\.\d{4}, scale=\d+\.\d, samples/s=\d+\.\d, data=\d\.\d{3}s", bar), bar
