"""Training augmentation (open_clip's --aug-cfg): crop geometry, jitter, and never in evaluation."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from data_helpers import cfg_for, prep
from PIL import Image

from _support.tiny_files import write_generic
from sharpclip.config import AugmentConfig, ConfigError, DataConfig
from sharpclip.data import build_loader
from sharpclip.data.augment import AugmentedTransform, color_jitter, crop_box
from sharpclip.data.transforms import ClipImageTransform
from sharpclip.models.tokenizer import build_word_tokenizer

TOK = build_word_tokenizer(["a cat number caption red blue green square circle round thing seen from above"])


def test_crop_boxes_stay_inside_with_area_and_ratio_in_range():
    rng = random.Random(0)
    for _ in range(200):
        left, top, right, bottom = crop_box(120, 80, (0.3, 0.6), (0.75, 4 / 3), rng)
        w, h = right - left, bottom - top
        assert 0 <= left < right <= 120 and 0 <= top < bottom <= 80
        assert 0.3 * 9600 * 0.95 <= w * h <= 0.6 * 9600 * 1.05 and 0.7 <= w / h <= 1.4


def test_impossible_ratios_fall_back_to_a_centred_box():
    assert crop_box(100, 10, (1.0, 1.0), (1.0, 1.0), random.Random(0)) == (45, 0, 55, 10)


def test_jitter_changes_pixels_and_zero_strength_does_nothing():
    image = Image.new("RGB", (8, 8), (120, 60, 30))
    assert color_jitter(image, [0, 0, 0, 0], random.Random(0)).tobytes() == image.tobytes()
    assert color_jitter(image, [0.4, 0.4, 0.4, 0.1], random.Random(0)).tobytes() != image.tobytes()


def test_augmented_transform_keeps_shape_and_normalisation_and_varies():
    base = ClipImageTransform(16)
    aug = AugmentedTransform(base, AugmentConfig(enabled=True, scale=[0.2, 0.5], color_jitter=[0.3, 0.3, 0.3, 0.05]))
    image = Image.effect_noise((40, 30), 80).convert("RGB")
    outs = [aug(image) for _ in range(3)]
    assert all(o.shape == (3, 16, 16) and o.dtype == torch.float32 for o in outs)
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], base(image))


def test_draws_follow_the_given_generator():
    aug = AugmentedTransform(ClipImageTransform(16), AugmentConfig(enabled=True, scale=[0.2, 0.5]))
    image = Image.effect_noise((40, 30), 80).convert("RGB")
    assert torch.equal(aug(image, random.Random(7)), aug(image, random.Random(7)))
    assert not torch.equal(aug(image, random.Random(7)), aug(image, random.Random(8)))


def _pixels(root: Path, workers: int, epoch: int, stop_after: int | None = None, state: dict | None = None):
    """{row id: pixels} of one training epoch of 12 generic rows with augmentation, batches of 3; with `stop_after`,
    (the first batches' pixels, the loader's state) instead; with `state`, from that saved position."""
    augment = AugmentConfig(enabled=True, scale=[0.1, 0.3], color_jitter=[0.3, 0.3, 0.3, 0.05])
    data = DataConfig(format="generic", root=str(root), num_workers=workers, augment=augment)
    loader = build_loader(data, "train", prep(TOK, 16), batch_size=3, seed=5)
    if state is not None:
        loader.load_state_dict(state)
    loader.set_epoch(epoch)
    seen, batches = {}, iter(loader)
    for k, batch in enumerate(batches):
        seen |= dict(zip(batch.ids, batch.pixel_values, strict=True))
        if stop_after is not None and k + 1 == stop_after:
            return seen, json.loads(json.dumps(loader.state_dict()))
    return seen


def test_each_sample_draws_its_own_crops_whichever_worker_reads_it_and_after_a_resume(tmp_path):
    """The loaders seed each sample's draws from (seed, epoch, row): the same pixels with 0 or 2 loader workers and
    after a resume mid-epoch with workers (whose generators restart), other crops in another epoch."""
    root = write_generic(tmp_path, n=12, splits=("train",))
    alone = _pixels(root, 0, epoch=1)
    workers = _pixels(root, 2, epoch=1)
    first, state = _pixels(root, 2, epoch=1, stop_after=2)
    resumed = _pixels(root, 2, epoch=1, state=state)
    assert len(alone) == 12 and len(first) == 6 and first.keys().isdisjoint(resumed)
    for pixels in (workers, first | resumed):
        assert pixels.keys() == alone.keys() and all(torch.equal(pixels[k], alone[k]) for k in alone)
    other = _pixels(root, 0, epoch=2)
    assert not any(torch.equal(other[k], alone[k]) for k in alone)


def test_off_by_default_and_never_in_evaluation():
    assert AugmentConfig().enabled is False
    plain = next(iter(build_loader(cfg_for("karpathy"), "test", prep(TOK, 8), batch_size=2, train=False)))
    on = cfg_for("karpathy", augment=AugmentConfig(enabled=True, scale=[0.1, 0.2]))
    evaluated = next(iter(build_loader(on, "test", prep(TOK, 8), batch_size=2, train=False)))
    trained = next(iter(build_loader(on, "test", prep(TOK, 8), batch_size=2, train=True, seed=0)))
    assert torch.equal(plain.pixel_values, evaluated.pixel_values)
    assert not torch.equal(
        plain.pixel_values.sum((1, 2, 3)).sort().values, trained.pixel_values.sum((1, 2, 3)).sort().values
    )


def test_bad_ranges_are_config_errors():
    with pytest.raises(ConfigError, match=r"data\.augment\.scale"):
        AugmentConfig(scale=[0.5, 1.5])


def test_a_large_train_seed_seeds_the_loaders_workers_without_overflow():
    # the loader's per-epoch generator seed (seed·1,000,003 + epoch)·65,537 + rank passed 2^64 from seed ≈ 2.8e8 on:
    # train.seed=1234567890 ended training with "Overflow when unpacking long long"
    loader = build_loader(cfg_for("karpathy"), "test", prep(TOK, 8), batch_size=2, train=True, seed=1_234_567_890)
    loader.set_epoch(1)
    assert next(iter(loader)).pixel_values.shape[0] == 2
