"""SynthDense through the generic reader: generated on first use under `data.root`, then read like any JSONL.

Splits: train, test (dense captions; `short_caption` = the colours-level coarse caption), pretrain (dense),
pretrain_layout (the pretrain scenes' dense captions without size and texture), pretrain_noisy (the same scenes'
dense captions with size and texture drawn at random, unrelated to the image: stage A2),
coarse_shapes / coarse_colours (the pretrain scenes with a coarse caption: stage A), edits (edit pairs), mmvp.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from sharpclip.config import DataConfig
from sharpclip.data.formats import generic
from sharpclip.data.formats._common import check_split
from sharpclip.data.schema import BadSampleReport, Sample

FILES = {
    "train": ("train", "caption"),
    "test": ("test", "caption"),
    "pretrain": ("pretrain", "caption"),
    "pretrain_layout": ("pretrain", "caption_layout"),  # dense captions without size and texture
    "pretrain_noisy": ("pretrain", "caption_noisy"),  # size and texture at random, not the image's (stage A2)
    "coarse_shapes": ("pretrain", "caption_shapes"),
    "coarse_colours": ("pretrain", "caption_colours"),
    "edits": ("edits", "caption"),
    "mmvp": ("mmvp", "caption"),
}


def read(root: Path, split: str, cfg: DataConfig, report: BadSampleReport) -> list[Sample]:
    """SynthDense samples of `split`, generating the corpus under `root` first if needed."""
    from sharpclip.data.synthdense.corpus import ensure  # rendering code loads only when SynthDense is used

    check_split("synthdense", split, tuple(FILES))
    ensure(root, cfg.synthdense)
    name, caption_field = FILES[split]
    opts = replace(
        cfg,
        caption_field=caption_field,
        image_field="image",
        short_caption_field="short_caption",
        id_field="id",
        group_field="group",
    )
    return generic.read(root, name, opts, report)
