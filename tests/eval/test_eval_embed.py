"""Eval image loading: the same RGB conversion as training (transparency composited onto white)."""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from sharpclip.data.images import load_image as load_training_image
from sharpclip.data.transforms import ClipImageTransform
from sharpclip.eval.embed import load_image


def test_eval_composites_transparency_onto_white_like_training(tmp_path: Path) -> None:
    rgba = Image.new("RGBA", (8, 8), (0, 0, 0, 0))
    rgba.paste((255, 0, 0, 255), (0, 0, 4, 8))  # left half opaque red, right half fully transparent
    path = tmp_path / "cutout.png"
    rgba.save(path)
    image = load_image(path)
    assert image.mode == "RGB" and image.getpixel((6, 4)) == (255, 255, 255) and image.getpixel((1, 4)) == (255, 0, 0)
    transform = ClipImageTransform(8)
    torch.testing.assert_close(transform(image), transform(load_training_image(path)), atol=0, rtol=0)
