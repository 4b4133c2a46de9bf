"""Training-time augmentation like open_clip's `--aug-cfg`: random resized crop and colour jitter, in PIL + numpy.

    transform = AugmentedTransform(model_transform, cfg.augment)   # PIL image -> (3, size, size), as before
    pixels = augmented(transform, image, seed, epoch, key)         # with the sample's own draws

Random resized crop: a box of area `scale` × the image's (uniform) and aspect ratio `ratio` (log-uniform), up to 10
draws, else the largest centred box within `ratio` (the rule torchvision's RandomResizedCrop follows); the box is
resized to size × size with the model's resample filter and normalised with its mean/std. Colour jitter (with
probability `color_jitter_prob`): brightness, contrast, saturation and hue factors drawn uniformly in [1 - s, 1 + s]
(hue: a shift in [-s, s] of the hue circle), applied in a random order; greyscale with probability
`gray_scale_prob`. The loaders give each sample its own generator, seeded from (run seed, epoch, sample)
(`sample_draws`), so a sample's crop and jitter in an epoch do not depend on which rank or loader worker reads it,
nor on how far that worker had read: a run draws the same crops at every world size and worker count, and a resume
mid-epoch draws the uninterrupted run's. Called without one, the transform draws from Python's global generator.
Evaluation never uses this: only `build_loader(..., train=True)` wraps the model's transform.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from types import ModuleType

import numpy as np
import torch
from PIL import Image, ImageEnhance
from torch import Tensor

from sharpclip.config import AugmentConfig
from sharpclip.data.images import to_rgb
from sharpclip.data.transforms import ClipImageTransform


def crop_box(width: int, height: int, scale, ratio, rng: random.Random | ModuleType) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of a random crop with area share in `scale` and aspect ratio in `ratio`."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(*log_ratio))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            left, top = rng.randint(0, width - w), rng.randint(0, height - h)
            return left, top, left + w, top + h
    aspect = width / height  # fallback: the whole image, cut to the nearest allowed aspect ratio
    if aspect < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif aspect > ratio[1]:
        w, h = round(height * ratio[1]), height
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


def _hue_shift(image: Image.Image, shift: float) -> Image.Image:
    hsv = np.asarray(image.convert("HSV"), dtype=np.uint8).copy()
    hsv[..., 0] = (hsv[..., 0].astype(np.int16) + round(shift * 255)) % 256
    return Image.fromarray(hsv, "HSV").convert("RGB")


def color_jitter(image: Image.Image, strengths, rng: random.Random | ModuleType) -> Image.Image:
    """Brightness, contrast, saturation (factors in [1-s, 1+s]) and hue (shift in [-s, s]) in a random order."""
    ops = []
    for enhancer, s in zip(
        (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color), strengths[:3], strict=True
    ):
        if s > 0:
            factor = rng.uniform(max(0.0, 1 - s), 1 + s)
            ops.append(lambda im, e=enhancer, f=factor: e(im).enhance(f))
    if strengths[3] > 0:
        shift = rng.uniform(-strengths[3], strengths[3])
        ops.append(lambda im, d=shift: _hue_shift(im, d))
    rng.shuffle(ops)
    for op in ops:
        image = op(image)
    return image


class AugmentedTransform:
    """The model's preprocessing with a random resized crop (and colour jitter) in place of resize + centre crop."""

    def __init__(self, base: ClipImageTransform, cfg: AugmentConfig):
        self.base, self.cfg = base, cfg

    @property
    def interpolation(self) -> str:
        """What a manifest records: the base geometry plus the augmentation."""
        crop, jitter = self.cfg.scale, self.cfg.color_jitter
        return f"{self.base.interpolation}; training: random resized crop of area {crop}, colour jitter {jitter}"

    def __call__(self, image: Image.Image, rng: random.Random | None = None) -> Tensor:
        """RGB → random crop → size × size → jitter / greyscale → normalised (3, size, size) float32; the draws from
        `rng` (default: Python's global generator)."""
        rng, size = rng or random, self.base.size
        image = to_rgb(image, self.base.alpha)  # the base's transparency policy (data.image_alpha)
        box = crop_box(*image.size, self.cfg.scale, self.cfg.ratio, rng)
        image = image.resize((size, size), self.base.resample, box=box)
        if any(self.cfg.color_jitter) and rng.random() < self.cfg.color_jitter_prob:
            image = color_jitter(image, self.cfg.color_jitter, rng)
        if self.cfg.gray_scale_prob and rng.random() < self.cfg.gray_scale_prob:
            image = image.convert("L").convert("RGB")
        chw = np.asarray(image, dtype=np.float32).transpose(2, 0, 1) / 255.0
        return torch.from_numpy((chw - self.base.mean) / self.base.std)


def sample_draws(seed: int, epoch: int, key: object) -> random.Random:
    """The generator of one sample's augmentation in one epoch (`key`: its row index or id); see the docstring."""
    return random.Random(f"{seed}:{epoch}:{key}")


def augmented(transform: Callable[[Image.Image], Tensor], image: Image.Image, seed: int, epoch: int, key: object):
    """`transform(image)`, drawing from the sample's own generator when the transform augments."""
    if isinstance(transform, AugmentedTransform):
        return transform(image, sample_draws(seed, epoch, key))
    return transform(image)
