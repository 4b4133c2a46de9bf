"""What a dual encoder decides about its inputs: image size, mean/std, crop and resampling, tokenizer and context.

Training (train.run), evaluation (eval.evaluator) and the demo all build their preprocessing here, from the model
itself, so they can never disagree with it or with each other: a Long-CLIP-stretched tower reads 248 tokens, a
SigLIP tower gets its own mean/std, no crop and full padding, with no second setting to keep in step. The operations
themselves (CLIP's resize and centre crop, tokenising with eos kept last) are data.transforms'.
"""

from __future__ import annotations

from typing import Any

from PIL import Image

from sharpclip.data.transforms import CLIP_MEAN, CLIP_STD, ClipImageTransform, Preprocessing, TextTokenizer


def model_image_size(model: Any) -> int:
    """The square side a dual encoder's vision tower takes: `image_size`, or for SigLIP 2 NaFlex (whose config has
    none) the side of its square patch budget, `patch_size · √num_patches` (256 px for the released patch-16 towers).
    """
    vcfg = model.vision_model.config
    size = getattr(vcfg, "image_size", None)
    if size:
        return int(size)
    if getattr(vcfg, "num_patches", None) and getattr(vcfg, "patch_size", None):
        return int(vcfg.patch_size * round(vcfg.num_patches**0.5))
    raise ValueError(
        f"{type(vcfg).__name__} has neither image_size nor patch_size and num_patches; cannot tell the input size "
        "of this vision tower"
    )


def model_transforms(model: Any, alpha: str = "drop") -> Preprocessing:
    """The preprocessing a dual encoder was built for: its image size and mean/std, its tokenizer and context.

    model: a sharpclip DualEncoder (its `image_processor`, `tokenizer`, vision config (`model_image_size`),
    `context_length`, `pads_to_context`). `alpha`: the transparency policy (`data.image_alpha` in training,
    `eval.image_alpha` in evaluation; drop by default).
    """
    proc = getattr(model, "image_processor", None)
    image = ClipImageTransform(
        size=model_image_size(model),
        mean=getattr(proc, "image_mean", None) or CLIP_MEAN,
        std=getattr(proc, "image_std", None) or CLIP_STD,
        crop=proc is None or bool(getattr(proc, "do_center_crop", False)),  # SigLIP processors resize, never crop
        resample=int(getattr(proc, "resample", None) or Image.BICUBIC),
        alpha=alpha,
    )
    pad_to_context = bool(getattr(model, "pads_to_context", False))
    return Preprocessing(image, TextTokenizer(model.tokenizer, model.context_length, pad_to_context))
