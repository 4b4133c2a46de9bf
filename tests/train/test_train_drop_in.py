"""The drop-in loss in a plain PyTorch loop trains exactly as sharpclip's trainer does: the same tiny model, the same
batches, HN-CLIP's loss over the whole batch (the trainer's exact accumulation: a 16-row matrix from micro-batches
of 8), the same AdamW, clipping and logit-scale clamp give the same loss curve."""

from __future__ import annotations

import json
import math

import pytest
import torch

from _support.tiny_run import ToyLoader, toy_model, train_config
from sharpclip.config import LossConfig, ModelConfig, TermConfig
from sharpclip.losses.drop_in import HNClipLoss
from sharpclip.models.factory import save_checkpoint
from sharpclip.train.features import build_objective
from sharpclip.train.trainer import Trainer

ROWS = 32  # two batches of 16 an epoch
# a constant rate (no warmup, cosine floor 1): the plain loop needs no schedule; no weight decay: no groups
SETTINGS = {"epochs": 2, "micro_batch_size": 8, "lr": 1e-3, "warmup_steps": 0, "min_lr_ratio": 1.0}
SETTINGS |= {"weight_decay": 0.0, "accumulation": "exact"}


def _sharpclip_curve(tmp_path) -> list[float]:
    model = toy_model()
    cfg = train_config(str(tmp_path / "run"), **SETTINGS)
    objective = build_objective(LossConfig(terms={"hn": TermConfig("hn_clip", params={"gamma": 0.5})}))
    loader = ToyLoader(model.tokenizer, n=ROWS, batch_size=cfg.batch_size)
    trainer = Trainer(model, objective, loader, cfg, tmp_path / "run",
                      write_model=lambda d: save_checkpoint(model, d, ModelConfig(name="tiny-clip")))  # fmt: skip
    trainer.fit()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def _plain_loop_curve() -> list[float]:
    """What a user's own script does, with HNClipLoss where its CLIP loss was."""
    model = toy_model()
    loader = ToyLoader(model.tokenizer, n=ROWS, batch_size=16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.0)
    loss_fn = HNClipLoss(gamma=0.5)
    curve = []
    model.train()
    for epoch in range(SETTINGS["epochs"]):
        loader.set_epoch(epoch)
        for batch in loader:
            image = model.encode_image(batch.pixel_values).embedding
            text = model.encode_text(batch.input_ids, batch.attention_mask).embedding
            loss = loss_fn(image, text, model.logit_scale.exp())
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            with torch.no_grad():
                model.logit_scale.clamp_(0, math.log(100))
            curve.append(loss.item())
    return curve


@pytest.mark.slow
def test_a_plain_loop_through_hnclip_loss_matches_sharpclip_train(tmp_path):
    sharpclip, plain = _sharpclip_curve(tmp_path), _plain_loop_curve()
    assert len(sharpclip) == len(plain) == 4
    assert len(set(sharpclip)) == 4  # every step a new batch on new weights
    # fp32 losses near 9 (the margin lifts every negative): 1e-6 of the loss is one or two float32 steps
    gaps = [abs(a - b) / max(1.0, abs(a)) for a, b in zip(sharpclip, plain, strict=True)]
    assert max(gaps) <= 1e-6, f"sharpclip {sharpclip}, plain loop {plain}"
