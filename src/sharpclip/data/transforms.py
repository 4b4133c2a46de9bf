"""CLIP's preprocessing: images (resize, centre crop, normalise) and text (tokenise, truncate with eos kept last).

Images follow OpenAI CLIP / Long-CLIP `_transform(n_px)` and HF `CLIPImageProcessor`: the shorter side is resized to
`size` with PIL bicubic (the longer side to floor(size·long/short)), a centre crop of size×size is taken with the
offset rounded down (HF; torchvision rounds to nearest, which can shift odd margins by one pixel), values are scaled
to [0, 1] and normalised per channel; transparency is dropped first with PIL `convert("RGB")` (OpenAI CLIP,
open_clip and Long-CLIP; `alpha="white"` composites onto white, HF's rule). tests/data check parity with
`CLIPImageProcessorPil` on the same (opaque) images.

Text follows Long-CLIP `tokenize(truncate=True)` and HF `truncation=True`: bos + the first L−2 tokens + eos, L = the
model's context length (77, or 248 for Long-CLIP towers). The attention mask marks real tokens, since the pad id of
OpenAI's tokenizer equals eos. OpenAI-vocabulary tokenizers first get OpenAI CLIP's text cleaning (data.text).
A batch is padded to its longest caption rounded up to a multiple of 8 (at most L), not
to L: a causal text tower that pools its eos token (CLIP, the RoPE tower) computes the same embedding either way,
since no real position attends to a later one, and a batch of 30-token captions does not pay for 248 positions.
SigLIP attends to its padding and pools the last position, so its towers keep the full padding (`pad_to_context`).

Which size, mean, std, tokenizer and context a model takes is the model's to say (models.preprocessing); this module
only implements the operations.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from sharpclip.data.images import to_rgb
from sharpclip.data.text import cleaning_for

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class ClipImageTransform:
    """PIL image → (3, size, size) float32 tensor, exactly CLIP's eval preprocessing.

    crop=False gives SigLIP's instead: the whole image resized to size × size (aspect not kept), no crop;
    `resample` is a PIL filter code (3 bicubic, as CLIP and SigLIP; 2 bilinear); `alpha` is the transparency policy
    of `data.images.to_rgb` (drop, the references' `convert("RGB")`, or white).
    """

    def __init__(
        self,
        size: int = 224,
        mean: Sequence[float] = CLIP_MEAN,
        std: Sequence[float] = CLIP_STD,
        crop: bool = True,
        resample: int = Image.BICUBIC,
        alpha: str = "drop",
    ):
        self.size, self.crop, self.resample, self.alpha = size, crop, resample, alpha
        self.mean = np.asarray(mean, dtype=np.float32).reshape(3, 1, 1)
        self.std = np.asarray(std, dtype=np.float32).reshape(3, 1, 1)

    @property
    def interpolation(self) -> str:
        """What the eval manifest records about the geometry of this preprocessing."""
        name = {Image.BICUBIC: "bicubic", Image.BILINEAR: "bilinear"}.get(self.resample, str(self.resample))
        how = "shorter side, then centre crop" if self.crop else "whole image to a square, no crop"
        return f"{name} (PIL), {how}"

    def resize(self, image: Image.Image) -> Image.Image:
        """Shorter side to `size`, the longer scaled and rounded down (torchvision / HF rule); no crop: size × size."""
        w, h = image.size
        short, long = (w, h) if w <= h else (h, w)
        new_long = int(self.size * long / short)
        new_size = (self.size, new_long) if w <= h else (new_long, self.size)
        if not self.crop:
            new_size = (self.size, self.size)
        return image if new_size == (w, h) else image.resize(new_size, self.resample)

    def center_crop(self, image: Image.Image) -> Image.Image:
        """The central `size` × `size` square (the image itself when cropping is off: it is square already)."""
        if not self.crop:
            return image
        w, h = image.size
        top, left = (h - self.size) // 2, (w - self.size) // 2
        return image.crop((left, top, left + self.size, top + self.size))

    def __call__(self, image: Image.Image) -> Tensor:
        """RGB, resize, centre crop, scale to [0, 1], normalise: (3, size, size) float32."""
        pixels = np.asarray(self.center_crop(self.resize(to_rgb(image, self.alpha))), dtype=np.float32)
        chw = pixels.transpose(2, 0, 1) / 255.0
        return torch.from_numpy((chw - self.mean) / self.std)


PAD_MULTIPLE = 8  # tensor-core friendly widths; also bounds how many distinct shapes torch.compile sees


class TextTokenizer:
    """Captions → (input_ids, attention_mask), each (B, W) long, truncated to L with eos kept as the last token.

    tokenizer: any HF tokenizer with bos/eos added by its post-processor (CLIPTokenizer, the word tokenizer of
    models.tokenizer); L = context_length. W = the longest caption rounded up to a multiple of 8, at most L; W = L
    when `pad_to_context` (SigLIP, whose tower reads the padding). Captions are cleaned first as the tokenizer's
    reference does (`data.text.cleaning_for`: OpenAI CLIP's cleaning for OpenAI-vocabulary tokenizers, none for
    SigLIP's); `cleaning` describes it for the eval manifest.
    """

    def __init__(self, tokenizer, context_length: int, pad_to_context: bool = False):
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.pad_to_context = pad_to_context
        self.eos = tokenizer.eos_token_id
        self.clean, self.cleaning = cleaning_for(tokenizer)

    def _cleaned(self, texts: Sequence[str]) -> list[str]:
        return [self.clean(t) for t in texts] if self.clean is not None else list(texts)

    @property
    def pad_id(self) -> int:
        """The id padding is filled with (the tokenizer's pad token, else eos)."""
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos

    @property
    def pads_left(self) -> bool:
        """True when the tokenizer pads on the left."""
        return getattr(self.tokenizer, "padding_side", "right") == "left"

    def width(self, longest: int) -> int:
        """The padded width of a batch whose longest (truncated) caption has `longest` tokens."""
        if self.pad_to_context:
            return self.context_length
        return min(self.context_length, -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE)

    def __call__(self, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
        """(input_ids, attention_mask), each (B, W) long, eos kept in truncated rows."""
        texts = self._cleaned(texts)
        enc = self.tokenizer(
            list(texts), padding="longest", truncation=True, max_length=self.context_length, return_tensors="pt"
        )
        ids, mask = enc["input_ids"].long(), enc["attention_mask"].long()
        extra = self.width(ids.shape[1]) - ids.shape[1]
        if extra > 0:  # on the side the tokenizer pads
            side = (extra, 0) if self.pads_left else (0, extra)
            ids = torch.nn.functional.pad(ids, side, value=self.pad_id)
            mask = torch.nn.functional.pad(mask, side, value=0)
        full = mask.sum(1) == self.context_length
        ids[full, -1] = torch.where(ids[full, -1] == self.eos, ids[full, -1], self.eos)  # a tokenizer that cut eos
        return ids, mask

    def lengths(self, texts: Sequence[str]) -> list[int]:
        """Untruncated token counts, bos and eos included (for validation reports)."""
        return [len(ids) for ids in self.tokenizer(self._cleaned(texts), truncation=False, verbose=False)["input_ids"]]


class MemoTokenizer:
    """A `TextTokenizer` that tokenises each distinct caption once and rebuilds every batch from the stored rows
    (data.preload: the same captions come back every epoch). Its batches equal the wrapped tokenizer's."""

    def __init__(self, tokenize: TextTokenizer):
        self.tokenize = tokenize
        self.rows: dict[str, Tensor] = {}  # caption -> its real tokens (truncated, eos kept)

    def __call__(self, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
        """(input_ids, attention_mask), each (B, W) long, as `TextTokenizer` gives them; new captions tokenised once."""
        new = list(dict.fromkeys(t for t in texts if t not in self.rows))
        if new:
            ids, mask = self.tokenize(new)
            self.rows.update((t, row[keep.bool()]) for t, row, keep in zip(new, ids, mask, strict=True))
        rows = [self.rows[t] for t in texts]
        width = self.tokenize.width(max(len(r) for r in rows))
        left = self.tokenize.pads_left
        ids = torch.full((len(rows), width), self.tokenize.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            where = slice(width - len(row), width) if left else slice(0, len(row))
            ids[i, where], mask[i, where] = row, 1
        return ids, mask


class Preprocessing(NamedTuple):
    """What a loader does to a sample before the model sees it: `image` (PIL → (3, S, S)) and `text` (captions →
    (input_ids, attention_mask)). A model decides both (models.preprocessing.model_transforms); the data layer only
    applies them."""

    image: ClipImageTransform
    text: TextTokenizer
