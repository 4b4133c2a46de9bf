"""A run directory is a model everywhere: `model.name=RUN` loads the run's newest complete checkpoint (as `eval
--model RUN` does) for `train` (continue fine-tuning from a finished run) and every other builder, and a `train` that
fails to start leaves no empty output folder behind."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from _support.finetuned_run import finetuned_run, init_checkpoint
from _support.tiny_files import write_generic
from sharpclip.cli import main
from sharpclip.config import ModelConfig
from sharpclip.models import create_model
from sharpclip.models.factory import RUN_BEST, RUN_CHECKPOINTS, RUN_DIVERGED, RUN_MARKER
from sharpclip.train import checkpoint, run_dir


def test_factory_names_match_the_checkpoint_layout() -> None:
    assert (RUN_CHECKPOINTS, RUN_BEST, RUN_DIVERGED) == ("checkpoints", checkpoint.BEST, checkpoint.DIVERGED)
    assert RUN_MARKER == run_dir.MARKER


def test_model_name_run_directory_loads_its_newest_complete_checkpoint(tmp_path: Path, caplog) -> None:
    run = tmp_path / "run"
    tuned, _ = finetuned_run(run, init_checkpoint(tmp_path / "init"), context=None)
    later = run / "checkpoints" / "step-000009"  # a newer checkpoint marked diverged is skipped
    (run / "checkpoints" / "step-000003").rename(later)
    (later / RUN_DIVERGED).write_text("{}")
    finetuned_run(run, init_checkpoint(tmp_path / "init"), context=None)
    (run / "checkpoints" / RUN_BEST).write_text(json.dumps({"name": "step-000001", "metric": 1.0}))
    with caplog.at_level(logging.INFO, logger="sharpclip"):
        model = create_model(ModelConfig(name=str(run)))
    assert "using its newest complete checkpoint step-000003; best.json names step-000001" in caplog.text
    for name, value in tuned.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


@pytest.mark.parametrize("started", ["checkpoints folder", "killed during start-up"])
def test_model_name_run_directory_without_a_checkpoint_is_one_line(tmp_path: Path, capsys, started) -> None:
    """Matrix 6 B8: a run killed during start-up (its marker and config.yaml, no checkpoints/) was read as a
    transformers folder: "Unrecognized model ... Should have a `model_type` key"."""
    run = tmp_path / "empty_run"
    if started == "checkpoints folder":
        (run / "checkpoints").mkdir(parents=True)
    else:
        run.mkdir()
        run_dir.write_marker(run)
        (run / "config.yaml").write_text("train:\n  lr: 0.001\n")
    data = write_generic(tmp_path / "d", n=8)
    out = tmp_path / "runs" / "from_run"
    args = ["train", f"model.name={run}", "data.format=generic", f"data.root={data}", f"train.output_dir={out}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "a run directory without a complete checkpoint" in err and "Unrecognized model" not in err
    assert not out.exists()  # a failed start leaves no empty output folder behind


def test_train_continues_fine_tuning_from_a_finished_run(tmp_path: Path, capsys) -> None:
    data = write_generic(tmp_path / "d", n=8)
    common = ["data.format=generic", f"data.root={data}", "data.num_workers=0", "train.batch_size=4",
              "train.micro_batch_size=4", "train.max_steps=1", "train.progress=false",
              "train.eval_every=0"]  # fmt: skip
    first, second = tmp_path / "first", tmp_path / "second"
    assert main(["train", "model.name=tiny-clip", f"train.output_dir={first}", *common]) == 0
    assert main(["train", f"model.name={first}", f"train.output_dir={second}", *common]) == 0
    assert "trained 1 steps" in capsys.readouterr().out
    log = (second / "train.log").read_text()
    assert f"model.name={first}: a run directory; using its newest complete checkpoint step-000001" in log
    start = create_model(ModelConfig(name=str(first))).state_dict()
    after = create_model(ModelConfig(name=str(second))).state_dict()
    assert any(not torch.equal(start[k], after[k]) for k in start)  # one more step moved the first run's weights
