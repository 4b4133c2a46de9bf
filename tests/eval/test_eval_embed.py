"""Eval image loading: transparency handled as the reference evaluators do (PIL convert("RGB")), the same in training
and evaluation, white compositing as an option, the policy in the manifest."""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from sharpclip.config import DataConfig, EvalConfig
from sharpclip.data.images import load_image as load_training_image
from sharpclip.data.images import to_rgb
from sharpclip.data.transforms import ClipImageTransform
from sharpclip.eval.embed import load_image
from sharpclip.eval.manifest import preprocessing_record


def _cutout(tmp_path: Path) -> Path:
    rgba = Image.new("RGBA", (8, 8), (10, 200, 30, 0))  # right half: green under full transparency
    rgba.paste((255, 0, 0, 255), (0, 0, 4, 8))  # left half opaque red
    path = tmp_path / "cutout.png"
    rgba.save(path)
    return path


def test_transparent_pixels_keep_their_colour_by_default_as_convert_rgb(tmp_path: Path) -> None:
    path = _cutout(tmp_path)
    with Image.open(path) as im:
        reference = im.convert("RGB")  # Long-CLIP _convert_image_to_rgb, GOAL, ARO, DCI's Winoground scorer
    assert reference.getpixel((6, 4)) == (10, 200, 30)
    assert to_rgb(load_image(path)).getpixel((6, 4)) == (10, 200, 30)
    assert to_rgb(load_image(path), "white").getpixel((6, 4)) == (255, 255, 255)
    assert to_rgb(load_image(path)).getpixel((1, 4)) == (255, 0, 0)
    transform = ClipImageTransform(8)
    torch.testing.assert_close(transform(load_image(path)), transform(reference), atol=0, rtol=0)


def test_training_and_evaluation_apply_the_same_policy(tmp_path: Path) -> None:
    path = _cutout(tmp_path)
    for alpha in ("drop", "white"):
        train = ClipImageTransform(8, alpha=DataConfig(image_alpha=alpha).image_alpha)  # as model_transforms gives
        evaluate = ClipImageTransform(8, alpha=alpha)
        torch.testing.assert_close(evaluate(load_image(path)), train(load_training_image(path)), atol=0, rtol=0)
    assert EvalConfig().image_alpha == "drop" and DataConfig().image_alpha == "drop"
    assert preprocessing_record(ClipImageTransform(8))["alpha"].startswith('drop: PIL convert("RGB")')
    assert preprocessing_record(ClipImageTransform(8, alpha="white"))["alpha"].startswith("white")
