"""The loader that feeds a GPU: workers by default (kept across epochs, still drawing each epoch's captions), pinned
batches on request, JPEG draft decoding for training (off for evaluation unless asked, and then in the manifest)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from data_helpers import prep
from PIL import Image

from sharpclip.config import DataConfig, EvalConfig
from sharpclip.data import build_loader, loader_options
from sharpclip.data.images import load_image
from sharpclip.data.transforms import ClipImageTransform
from sharpclip.models import tiny_model

CAPTIONS = [f"a {c} {s}" for c in ("red", "blue", "green", "white") for s in ("square", "circle", "star", "ring")]


def _photo(path: Path, size=(1500, 1000), seed: int = 0) -> Path:
    """A JPEG with photo-like content (smooth gradients plus noise), made in code."""
    rng = np.random.default_rng(seed)
    w, h = size
    x, y = np.meshgrid(np.linspace(0, 1, w), np.linspace(0, 1, h))
    base = np.stack([x, y, (x + y) / 2], -1) * 200 + rng.normal(0, 12, (h, w, 3))
    Image.fromarray(base.clip(0, 255).astype(np.uint8)).save(path, quality=90)
    return path


def _generic(tmp_path: Path, n: int = 8, size=(1500, 1000), captions: int = 1) -> DataConfig:
    (tmp_path / "img").mkdir()
    with open(tmp_path / "train.jsonl", "w") as f:
        for i in range(n):
            _photo(tmp_path / "img" / f"{i}.jpg", size, seed=i)
            caption = [CAPTIONS[(i + k) % 16] for k in range(captions)] if captions > 1 else CAPTIONS[i % 16]
            f.write(json.dumps({"id": str(i), "image": f"img/{i}.jpg", "caption": caption}) + "\n")
    (tmp_path / "test.jsonl").write_text((tmp_path / "train.jsonl").read_text())
    return DataConfig(format="generic", root=str(tmp_path))


def test_draft_decoding_scales_a_large_jpeg_down_by_a_power_of_two_keeping_the_target(tmp_path):
    path = _photo(tmp_path / "p.jpg")
    assert load_image(path).size == (1500, 1000)
    assert load_image(path, draft_size=224).size == (375, 250)  # 1/4: both sides still >= 224
    assert load_image(path, draft_size=336).size == (750, 500)  # 1/2
    assert load_image(path, draft_size=600).size == (1500, 1000)  # under twice the target: decoded whole
    png = tmp_path / "p.png"
    Image.open(path).save(png)
    assert load_image(png, draft_size=224).size == (1500, 1000)  # only JPEG has a draft mode


def test_drafted_pixels_stay_close_to_the_full_decode(tmp_path):
    path = _photo(tmp_path / "p.jpg")
    transform = ClipImageTransform(224)
    full, drafted = transform(load_image(path)), transform(load_image(path, draft_size=224))
    assert full.shape == drafted.shape == (3, 224, 224)
    assert 0 < float((full - drafted).abs().mean()) < 0.05  # different pixels, the same picture


def test_training_loaders_draft_and_evaluation_loaders_do_not(tmp_path):
    cfg = _generic(tmp_path, n=4)
    train = build_loader(cfg, "train", prep(tiny_model("clip").tokenizer, 32), batch_size=4)
    test = build_loader(cfg, "test", prep(tiny_model("clip").tokenizer, 32), batch_size=4)
    assert train.dataset.draft_size == 32 and test.dataset.draft_size is None
    no_draft = DataConfig(**{**vars(cfg), "jpeg_draft": False})
    off = build_loader(no_draft, "train", prep(tiny_model("clip").tokenizer, 32), batch_size=4)
    assert off.dataset.draft_size is None


def test_workers_default_to_auto_persist_and_prefetch():
    options = loader_options(DataConfig(), pin_memory=True)
    assert options["num_workers"] >= 1 and options["pin_memory"] is True
    assert options["persistent_workers"] is True and options["prefetch_factor"] == 2
    assert loader_options(DataConfig(num_workers=0)) == {"num_workers": 0, "pin_memory": False}


def _captions_per_epoch(loader, epochs: int) -> list[list[str]]:
    tok = loader.collate_fn.tokenize.tokenizer
    out = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        rows = [(ids, m) for b in loader for ids, m in zip(b.input_ids, b.attention_mask, strict=True)]
        out.append([tok.decode(ids[m.bool()][1:-1]) for ids, m in rows])
    return out


def test_persistent_workers_draw_each_epochs_captions_like_the_main_process(tmp_path):
    cfg = _generic(tmp_path, n=6, size=(40, 30), captions=4)
    tok = tiny_model("clip").tokenizer
    kw = {"batch_size": 6, "train": False}  # release order: only the caption draw changes between epochs
    alone = build_loader(DataConfig(**{**vars(cfg), "num_workers": 0}), "train", prep(tok, 32), **kw)
    workers = build_loader(DataConfig(**{**vars(cfg), "num_workers": 2}), "train", prep(tok, 32), **kw)
    assert workers.persistent_workers
    expected = _captions_per_epoch(alone, 3)
    assert expected[0] != expected[1] or expected[1] != expected[2]  # the draw does change with the epoch
    assert _captions_per_epoch(workers, 3) == expected


@pytest.mark.gpu
def test_batches_come_pinned_when_asked(tmp_path):
    cfg = _generic(tmp_path, n=4, size=(40, 30))
    loader = build_loader(cfg, "train", prep(tiny_model("clip").tokenizer, 32), batch_size=4, pin_memory=True)
    batch = next(iter(loader))
    assert batch.pixel_values.is_pinned() and batch.input_ids.is_pinned()


def test_eval_draft_is_off_by_default_and_recorded_in_the_manifest_when_on(tmp_path):
    from sharpclip.eval.report import suite_manifest
    from sharpclip.eval.suite import run_suite

    cfg = _generic(tmp_path, n=4)
    model = tiny_model("clip")
    for draft in (False, True):
        ecfg = EvalConfig(device="cpu", progress=False, jpeg_draft=draft)
        result = run_suite(model, ecfg, cfg)
        manifest = suite_manifest(result, model, ecfg)
        assert ("jpeg_draft" in manifest["image_preprocessing"]) is draft
        assert manifest["settings"]["device"] == "cpu"
    assert EvalConfig().jpeg_draft is False and DataConfig().jpeg_draft is True
