"""How the trainer is wired: one evaluation path shared with `sharpclip eval` and the demo, validation handed to the
trainer at construction, a declared loader protocol, and checkpoints read back by the code that writes them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from _support.tiny_files import tiny_config, write_generic
from _support.tiny_run import ToyLoader
from sharpclip.config import EvalConfig, TrainConfig
from sharpclip.data.captions import CaptionLoader
from sharpclip.data.dataset import SampleLoader
from sharpclip.data.schema import Loader
from sharpclip.data.stream import StreamLoader
from sharpclip.eval.suite import run_suite
from sharpclip.models import tiny_model
from sharpclip.train import checkpoint
from sharpclip.train.distill import distill
from sharpclip.train.run import build_trainer

SRC = Path(__file__).resolve().parents[2] / "src" / "sharpclip"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_generic(tmp_path_factory.mktemp("data"))


def _calls(name: str) -> list[str]:
    """`file:line` of every call of `name(...)` in src/sharpclip."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            func = getattr(node, "func", None)
            if isinstance(node, ast.Call) and name in (getattr(func, "id", None), getattr(func, "attr", None)):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    return found


def test_one_builder_makes_every_model_embedder():
    """Training's validation, the demo and `sharpclip eval` embed through eval.evaluator.model_embedder alone."""
    assert all(site.startswith("eval/evaluator.py:") for site in _calls("ModelEmbedder")), _calls("ModelEmbedder")
    users = {site.split(":")[0] for site in _calls("model_embedder") + _calls("retrieval_validator")}
    assert {"demo/measure.py", "demo/stages.py", "train/run.py", "eval/evaluator.py"} <= users


def test_no_module_replaces_a_trainers_validation_after_construction():
    patched = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            for target in getattr(node, "targets", []):
                owner = getattr(getattr(target, "value", None), "id", "self")
                if isinstance(target, ast.Attribute) and target.attr == "evaluate" and owner != "self":
                    patched.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert not patched, patched


def test_training_validation_scores_a_model_as_sharpclip_eval_does(data, tmp_path):
    cfg = tiny_config(data, tmp_path / "run")
    trainer = build_trainer(cfg)
    trainer.model.eval()
    with torch.no_grad():
        validation = trainer.evaluate(trainer.model)
    report = run_suite(trainer.model, EvalConfig(suites=["retrieval"], device="cpu", progress=False), cfg.data)
    retrieval = report.results["retrieval"]
    for k in (1, 5, 10):
        assert validation[f"t2i_R@{k}"] == retrieval["t2i"][f"R@{k}"]
        assert validation[f"i2t_R@{k}"] == retrieval["i2t"][f"R@{k}"]
    assert validation["mean_R@1"] == (retrieval["t2i"]["R@1"] + retrieval["i2t"]["R@1"]) / 2


def test_build_trainer_runs_the_validation_it_is_given(data, tmp_path):
    def given(model):
        return {"mean_R@1": 50.0}

    assert build_trainer(tiny_config(data, tmp_path / "a"), evaluate=given).evaluate is given
    assert build_trainer(tiny_config(data, tmp_path / "b", "train.eval_every=0"), evaluate=given).evaluate is given
    assert build_trainer(tiny_config(data, tmp_path / "c", "train.eval_every=0")).evaluate is None


@pytest.mark.parametrize("loader", [SampleLoader, StreamLoader, CaptionLoader, ToyLoader])
def test_every_loader_the_trainer_is_given_is_a_loader(loader):
    assert issubclass(loader, Loader)


def test_a_distillation_run_without_a_model_config_can_be_read_back(tmp_path):
    """Its checkpoints hold the student's weights, written and read by models.factory (save_weights / read_weights)."""
    teacher = tiny_model("clip")
    train = TrainConfig(output_dir=str(tmp_path / "run"), max_steps=2, batch_size=4, micro_batch_size=4,
                        eval_every=0, progress=False)  # fmt: skip
    student = distill(teacher, [f"a red square number {i}" for i in range(8)], train)
    weights, _, state = checkpoint.load(checkpoint.latest(tmp_path / "run" / "checkpoints"))
    assert state["step"] == 2 and weights.keys() == student.state_dict().keys()
