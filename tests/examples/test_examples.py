"""The examples run end to end on tiny models without a network: the Hugging Face Trainer one always, the
open_clip_train one where open_clip is installed; the open_clip example's loss swap is tested with a stand-in for
open_clip_train's main module everywhere."""

from __future__ import annotations

import importlib.util
import math
import sys
import types
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from sharpclip.losses import hn_clip
from sharpclip.losses.drop_in import HNClipLoss, SigLipMarginLoss

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example(name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the Hugging Face Trainer -----------------------------------------------------------------------------------
def test_the_compute_loss_override_is_hn_clip_on_the_models_embeddings(tmp_path):
    hf = _example("hf_trainer_hn")
    model = hf.tiny_clip().eval()
    batch = torch.utils.data.default_collate([hf.RandomPairs()[i] for i in range(6)])
    args = hf.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    loss = hf.HNTrainer(model=model, args=args).compute_loss(model, batch)
    out = model(**batch)
    assert torch.allclose(loss, hn_clip(out.image_embeds, out.text_embeds, model.logit_scale, gamma=0.5), atol=1e-6)


@pytest.mark.slow
def test_hf_trainer_example_trains_a_tiny_clipmodel(tmp_path):
    hf = _example("hf_trainer_hn")
    trainer = hf.main(["--output-dir", str(tmp_path / "run"), "--steps", "4"])
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses)
    assert float(trainer.model.logit_scale.detach()) != pytest.approx(
        math.log(1 / 0.07), abs=1e-7
    )  # the scale trained too


# -- open_clip_train --------------------------------------------------------------------------------------------
def _stand_in(monkeypatch, with_create_loss: bool) -> dict:
    """open_clip_train.main as 3.x (main calls create_loss(args)) or the task trainer (main builds ClipLoss)."""
    seen: dict = {}
    package, entry = types.ModuleType("open_clip_train"), types.ModuleType("open_clip_train.main")
    losses = types.ModuleType("open_clip.loss")
    losses.ClipLoss = losses.SigLipLoss = None  # replaced by the example in the task layout

    def main(argv):
        args = Namespace(model="ViT-B-32", siglip="--siglip" in argv, local_loss="--local-loss" in argv,
                         gather_with_grad=True, rank=0, world_size=1, horovod=False, distill=False,
                         loss_dist_impl="shift")  # fmt: skip
        seen["argv"] = argv
        if with_create_loss:
            seen["loss"] = entry.create_loss(args)
        else:
            make = losses.SigLipLoss if args.siglip else losses.ClipLoss
            seen["loss"] = make(rank=0, world_size=1) if args.siglip else make(local_loss=args.local_loss)

    entry.main = main
    if with_create_loss:
        entry.create_loss = lambda args: pytest.fail("open_clip's own create_loss was called")
    monkeypatch.setitem(sys.modules, "open_clip_train", package)
    monkeypatch.setitem(sys.modules, "open_clip_train.main", entry)
    monkeypatch.setitem(sys.modules, "open_clip", types.ModuleType("open_clip"))
    monkeypatch.setitem(sys.modules, "open_clip.loss", losses)
    return seen


@pytest.mark.parametrize("layout", ["create_loss", "task"])
def test_open_clip_example_swaps_the_loss_factory_and_passes_every_other_argument(monkeypatch, layout):
    seen = _stand_in(monkeypatch, with_create_loss=layout == "create_loss")
    example = _example("open_clip_train_hn")
    example.main(["--model", "ViT-B-32", "--hn-gamma", "0.25", "--local-loss", "--batch-size", "8"])
    assert seen["argv"] == ["--model", "ViT-B-32", "--local-loss", "--batch-size", "8"]
    assert isinstance(seen["loss"], HNClipLoss) and seen["loss"].gamma == 0.25 and seen["loss"].local_loss
    example.main(["--siglip"])
    assert isinstance(seen["loss"], SigLipMarginLoss) and seen["loss"].gamma == 0.5


@pytest.mark.parametrize("missing", ["open_clip_train", "torchvision"])
def test_open_clip_example_without_open_clip_stops_with_one_line(monkeypatch, missing):
    """What a sharpclip-only environment meets: open_clip_train absent, or present without torchvision."""
    real = importlib.import_module

    def absent(name, *args):
        if name.split(".")[0] == "open_clip_train":
            raise ModuleNotFoundError(f"No module named {missing!r}", name=missing)
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", absent)
    with pytest.raises(SystemExit) as stop:
        _example("open_clip_train_hn").main(["--model", "ViT-B-32"])
    message = str(stop.value.code)
    assert "\n" not in message and f"no module named {missing!r}" in message
    assert "pip install 'open_clip_torch[training]'" in message and "torch and torchvision" in message


def test_open_clip_example_refuses_distillation_in_one_line():
    example = _example("open_clip_train_hn")
    with pytest.raises(ValueError, match="keep open_clip's"):
        example.hn_create_loss(Namespace(model="coca_ViT-B-32", distill=False), gamma=0.5)


TINY_OPEN_CLIP = """{"embed_dim": 16,
 "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 16, "head_width": 16},
 "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}"""


@pytest.mark.slow
def test_open_clip_example_trains_end_to_end(tmp_path, monkeypatch):
    pytest.importorskip(
        "open_clip_train.main",
        reason="open_clip is not installed (it cannot be installed next to this torch build); the loss swap is "
        "tested above with a stand-in for open_clip_train, and the loss itself against open_clip's formula",
    )
    import open_clip

    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "hn-tiny.json").write_text(TINY_OPEN_CLIP)
    open_clip.add_model_config(tmp_path / "configs")
    calls, forward = [], HNClipLoss.forward

    def counted(self, *args, **kwargs):
        calls.append(forward(self, *args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(HNClipLoss, "forward", counted)
    args = ["--hn-gamma", "0.5", "--model", "hn-tiny", "--dataset-type", "synthetic", "--train-num-samples", "16",
            "--batch-size", "4", "--epochs", "1", "--workers", "0", "--precision", "fp32", "--device", "cpu",
            "--logs", str(tmp_path / "logs"), "--name", "hn", "--report-to", "", "--save-frequency", "0"]  # fmt: skip
    _example("open_clip_train_hn").main(args)
    assert len(calls) == 4  # 16 samples in batches of 4, each through HNClipLoss
    assert all(math.isfinite(float(c["contrastive_loss"] if isinstance(c, dict) else c)) for c in calls)
