"""Typed configuration: one dataclass per part, filled from YAML plus dotted command-line overrides.

OmegaConf structured configs do the merging and type checking; this module only turns their errors into messages
that name the source (file or override) and the full key, and validates choices that a type cannot express.
`run_*` entry points are the only places that see the whole `Config`; every builder takes its own sub-config.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import os
import re
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException


class ConfigError(ValueError):
    """A configuration value is unknown, mistyped or out of range; the message names the key and its source."""


ALPHA_POLICIES = ("drop", "white")  # data.images.to_rgb: what becomes of transparent pixels
VALIDATION_KS = (1, 5, 10)  # the per-epoch validation's recall levels (eval.evaluator.retrieval_validator)
VALIDATION_METRICS = (
    *(f"{d}_R@{k}" for d in ("t2i", "i2t") for k in VALIDATION_KS),
    "mean_R@1",
)  # what `train.best_metric` may name
SCHEDULES = ("cosine", "linear", "constant")  # train.schedule: the learning rate after the warmup (train.optim)
AUTO = "auto"  # train.micro_batch_size / encode_batch_size: sized to the device's memory before step 1
PIL_MAX_IMAGE_PIXELS = 89_478_485  # PIL.Image.MAX_IMAGE_PIXELS's default (its decompression-bomb limit)


@dataclass(frozen=True)
class Range:
    """The values a numeric setting may take: bounds `ge` / `gt` (above) and `le` / `lt` (below), each optional;
    every float must be finite. `why`: what the `ge` / `le` bounds protect, added to their errors (`why_le`, when
    given, for the `le` bound instead)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    why: str = ""
    why_le: str = ""

    def problem(self, value: float) -> str | None:
        """What is wrong with `value` ('must be >= 1, got 0'), or None when it is allowed."""
        if not math.isfinite(value):
            return f"must be a finite number, got {value}"
        for bound, holds, word in (
            (self.gt, value > (self.gt or 0), ">"),
            (self.ge, value >= (self.ge or 0), ">="),
            (self.lt, value < (self.lt or 0), "<"),
            (self.le, value <= (self.le or 0), "<="),
        ):
            if bound is not None and not holds:
                reason = self.why_le if word == "<=" and self.why_le else self.why
                why = f": {reason}" if reason and word in (">=", "<=") else ""
                return f"must be {word} {bound:g}, got {value}{why}"
        return None


# A learning rate below LR_FLOOR changes no weight: an AdamW step moves a weight w by about lr, and fp32 rounds a
# change below half its spacing (|w|·2^-24) away, so at 1e-10 no weight with |w| above 1.7e-3 would ever move.
LR_FLOOR = 1e-10
# Above LR_CEILING no step is a training step: one update moves each weight by about lr (CLIP's weights are far below
# 1), and up to here the diverged-update stop reports it; near 3.4e37 AdamW's step size lr / (1 - β1^t) overflows
# fp32 (3.4e38) inside the optimiser before any check could, so a bound is the only place to catch it.
LR_CEILING = 1e6
_LR = Range(gt=0, ge=LR_FLOOR, le=LR_CEILING,
            why="an AdamW step moves each weight by about lr, and fp32 rounds such a change away "
            "for every weight over 2^24·lr in magnitude (1.7e-3 at 1e-10): no weight would move",
            why_le="an AdamW step moves each weight by about lr, so every update diverges; "
            "typical rates are 1e-6..1e-3")  # fmt: skip
_COUNT, _POSITIVE, _FRACTION = Range(ge=0), Range(ge=1), Range(ge=0, le=1)
# A seed is a 64-bit integer to torch's generators (a larger one is "Overflow when unpacking long long"); the loaders
# derive per-epoch seeds from it modulo 2^64 (data.dataset, data.sampling).
SEED_CEILING = 2**63 - 1
_SEED = Range(ge=0, le=SEED_CEILING, why_le="torch's generators take 64-bit seeds")
# model.logit_scale_init is log s: exp overflows fp32 above 88.7, and filling the parameter with ±1e38 overflows
# before any step; e^±20 (s ≈ 4.9e8 or 2e-9) lies far outside any checkpoint's scale (CLIP's ln 100 ≈ 4.6).
_LOG_SCALE = Range(ge=-20, le=20, why="the log of the logit scale (CLIP's is ln 100 ≈ 4.6); e^20 ≈ 4.9e8")
_TIMEOUT_MIN = Range(gt=0, le=7 * 24 * 60, why_le="a collective waiting over a week has hung (and far larger "
                     "values overflow Python's timedelta)")  # fmt: skip
# Every number of the config (a dotted key; `*`: any key of a mapping) with its range, checked in one place
# (`check_declared`, from each section's __post_init__); tests/core/test_core_config_validation.py fails on a numeric
# key without an entry. The objective's weights and parameters are checked against the loss registry
# (losses.objective), the guards' max_drop by GuardConfig.
RANGES: dict[str, Range] = {
    "model.context_length": _POSITIVE,
    "model.keep_positions": _COUNT,
    "model.rope_theta": Range(gt=0),
    "model.rope_ntk_factor": _COUNT,
    "model.logit_scale_init": _LOG_SCALE,
    "model.adapter.rank": _POSITIVE,
    "model.adapter.alpha": Range(gt=0),
    "model.adapter.dropout": Range(ge=0, lt=1),
    "model.freeze.vision_unlocked_layers": _COUNT,
    "model.freeze.text_unlocked_layers": _COUNT,
    **{f"model.tiny.{k}": _POSITIVE for k in ("width", "layers", "heads", "mlp_ratio", "patch_size", "image_size")},
    "model.tiny.context_length": _COUNT,
    "data.num_workers": _COUNT,
    "eval.num_workers": _COUNT,
    "data.prefetch_factor": _POSITIVE,
    "data.max_image_pixels": _POSITIVE,
    "data.sharegpt4v_test_size": _COUNT,
    "data.epoch_samples": _COUNT,
    "data.shuffle_buffer": _COUNT,
    "data.train_fraction": Range(gt=0, le=1, why="the share of the train split trained on"),
    "data.train_count": _COUNT,
    "data.subset_seed": _COUNT,
    **{
        f"data.synthdense.{k}": _COUNT
        for k in (
            "seed",
            "train_families",
            "train_detail_pairs",
            "test_families",
            "pretrain_scenes",
            "pretrain_detail_pairs",
            "edits",
            "mmvp_pairs",
            "zeroshot_per_class",
        )
    },
    **{
        f"data.synthdense.{k}": _POSITIVE
        for k in ("resolution", "train_family_size", "test_family_size", "test_changed_objects", "workers")
    },
    **{
        f"data.synthdense.{k}": Range(ge=1, le=9, why="a scene is a 3×3 grid of cells, one object a cell")
        for k in ("min_objects", "max_objects")
    },
    "data.synthdense.detail_random_p": _FRACTION,
    "data.augment.color_jitter_prob": _FRACTION,
    "data.augment.gray_scale_prob": _FRACTION,
    "train.seed": _SEED,
    "train.epochs": _COUNT,
    "train.max_steps": _COUNT,
    "train.batch_size": _POSITIVE,
    "train.micro_batch_size": _POSITIVE,
    "train.encode_batch_size": _COUNT,
    "train.lr": _LR,
    "train.module_lr.*": _LR,
    "train.weight_decay": _COUNT,
    "train.warmup_steps": _COUNT,
    "train.min_lr_ratio": _FRACTION,
    "train.beta1": Range(ge=0, lt=1, why="a moment's decay per step"),
    "train.beta2": Range(ge=0, lt=1, why="a moment's decay per step"),
    "train.eps": Range(gt=0),
    "train.grad_clip": _COUNT,
    "train.dist_timeout_min": _TIMEOUT_MIN,
    "train.checkpoint_every": _COUNT,
    "train.checkpoint_every_min": _COUNT,
    "train.log_every": _COUNT,
    "train.hang_timeout_min": _COUNT,
    "train.keep_last": _POSITIVE,
    "train.eval_every": _COUNT,
    "train.diagnostics_every": _COUNT,
    "train.nan_patience": _POSITIVE,
    "eval.chunk_size": _POSITIVE,
    "eval.batch_size": _POSITIVE,
}


def declared_range(key: str) -> Range | None:
    """The entry of RANGES for dotted `key` (a mapping's entries by `prefix.*`), or None."""
    if key in RANGES:
        return RANGES[key]
    parts = key.split(".")
    for n in range(len(parts) - 1, 0, -1):  # a mapping's keys may hold dots (train.module_lr.backbone.text_model)
        if (found := RANGES.get(".".join(parts[:n]) + ".*")) is not None:
            return found
    return None


def check_number(key: str, value: Any) -> None:
    """Raise ConfigError naming `key` unless `value` is within its RANGES entry (any number must be finite). None
    (an optional setting left unset) and non-numbers pass."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return
    problem = (declared_range(key) or Range()).problem(value)
    if problem is not None:
        raise ConfigError(f"{key}: {problem}")


def check_declared(section: Any, prefix: str) -> None:
    """Every number of dataclass `section` (and of its mappings of numbers) against RANGES, as `prefix.field`;
    nested sections check themselves."""
    for f in fields(section):
        value = getattr(section, f.name)
        if isinstance(value, dict):
            for name, item in value.items():
                check_number(f"{prefix}.{f.name}.{name}", item)
        else:
            check_number(f"{prefix}.{f.name}", value)


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(choices)}")


STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT")  # what train.stop_signals may name (train.stop)
# the shortest hang check (3 s): a tiny CPU step takes about 1 s here, so a shorter timeout tells nothing of a hang;
# the check itself is armed only once every rank has taken a step (train.heartbeat)
HANG_FLOOR_MIN = 0.05


def _check_signals(key: str, names: list[str]) -> None:
    unknown = [n for n in names if n not in STOP_SIGNALS]
    if unknown or not isinstance(names, list):
        raise ConfigError(f"{key}: {unknown or names!r} not among {', '.join(STOP_SIGNALS)}; give a list of them")


DEVICE_SPEC = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")  # what sharpclip.devices.resolve_device accepts


def _check_device(key: str, value: str) -> None:
    if not DEVICE_SPEC.match(value):
        raise ConfigError(f"{key}: {value!r} is not a device; use auto, cpu, cuda or cuda:N")


@dataclass
class AdapterConfig:
    """Low-rank adapters via peft (models.adapters): LoRA (Hu et al. 2021) or DoRA (Liu et al. 2024)."""

    method: str = "none"  # none | lora | dora
    towers: str = "both"  # text | vision | both
    modules: str = "attention_mlp"  # attention (q, k, v, out) | mlp (fc1, fc2) | attention_mlp
    rank: int = 8  # the adapters' rank r (low-rank update B·A with A of r rows)
    alpha: float = 16.0  # the scaling α: each update is multiplied by α / rank (peft's lora_alpha)
    dropout: float = 0.0  # dropout on the adapters' input (peft's lora_dropout)

    def __post_init__(self) -> None:
        _check_choice("model.adapter.method", self.method, ("none", "lora", "dora"))
        _check_choice("model.adapter.towers", self.towers, ("text", "vision", "both"))
        _check_choice("model.adapter.modules", self.modules, ("attention", "mlp", "attention_mlp"))
        check_declared(self, "model.adapter")


@dataclass
class FreezeConfig:
    """Lock a tower, optionally leaving its last N layers (and the norm + projection after them) trainable."""

    vision: bool = False  # lock the image tower (no gradient, no optimiser state)
    text: bool = False  # lock the text tower
    vision_unlocked_layers: int = 0  # with vision locked: its last N layers (and the norm + projection) still train
    text_unlocked_layers: int = 0  # with text locked: its last N layers (and the norm + projection) still train

    def __post_init__(self) -> None:
        check_declared(self, "model.freeze")


@dataclass
class TinyConfig:
    """Sizes of the tiny presets (models.tiny): the defaults are the unit-test size; the demo's SynthDense model
    (demo.plan) is width 64, 2 + 2 layers, patch 8, 48 px, context 152."""

    width: int = 32  # hidden size of both towers and the projection
    layers: int = 2  # per tower
    heads: int = 4  # attention heads per layer; width must be a multiple
    mlp_ratio: int = 2  # intermediate size = mlp_ratio * width
    patch_size: int = 8  # vision patch side in pixels
    image_size: int = 32  # input side in pixels, a multiple of patch_size
    context_length: int = 0  # text positions; 0 keeps the real tower's (77 CLIP, 64 SigLIP)

    def __post_init__(self) -> None:
        check_declared(self, "model.tiny")
        if self.width % self.heads:
            raise ConfigError(f"model.tiny.width ({self.width}) must be divisible by model.tiny.heads ({self.heads})")
        if self.image_size % self.patch_size:
            raise ConfigError(f"model.tiny.image_size ({self.image_size}) must be a multiple of patch_size")


@dataclass
class ModelConfig:
    """Which dual encoder to build (models.create_model)."""

    name: str = "tiny-clip"  # a tiny preset, a local folder or OpenAI-format file, or a hub id in the local HF cache
    kind: str = "auto"  # auto | clip | siglip | siglip2 | open_clip; auto reads the folder's config.json
    vocabulary: str = ""  # tiny presets' word tokenizer: "" (built-in words) | synthdense | a file, one word a line
    processor: str = ""  # folder / cached hub id with the tokenizer + image processor when `name` has none
    activation: str = ""  # an OpenAI-format file's MLP activation: "" (QuickGELU, OpenAI's) | quick_gelu | gelu
    # the open_clip architecture of a bare checkpoint file (open_clip_train's epoch_N.pt): a shipped config's name
    # (ViT-B-32, ViT-H-14-quickgelu, ...; see docs/open-clip.md) or the path of an open_clip model config JSON
    open_clip_config: str = ""
    context_length: int | None = None  # stretch text positions to this length (Long-CLIP rule) when set
    keep_positions: int = 20  # Long-CLIP: rows kept verbatim and frozen when stretching
    text_encoder: str = "absolute"  # absolute | rope (CLIP-IN §3.3: rotary text tower, from `sharpclip distill`)
    rope_theta: float = 10000.0  # the rotary text tower's base frequency θ (text_encoder: rope)
    rope_ntk_factor: float = 0.0  # > 0: NTK-scale theta for context_length beyond the distilled length (TULIP: 8)
    logit_scale_learnable: bool = True  # train the logit scale (and SigLIP's bias); false keeps them fixed
    logit_scale_init: float | None = None  # log space; None keeps the checkpoint's value
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    freeze: FreezeConfig = field(default_factory=FreezeConfig)
    tiny: TinyConfig = field(default_factory=TinyConfig)  # sizes of a tiny-* preset; ignored for other names

    def __post_init__(self) -> None:
        _check_choice("model.kind", self.kind, ("auto", "clip", "siglip", "siglip2", "open_clip"))
        _check_choice("model.text_encoder", self.text_encoder, ("absolute", "rope"))
        _check_choice("model.activation", self.activation, ("", "quick_gelu", "gelu"))
        check_declared(self, "model")


@dataclass
class SynthDenseConfig:
    """Sizes of the generated SynthDense corpus (data.synthdense); the corpus is a pure function of these values."""

    seed: int = 0  # the seed every scene, caption and split is drawn from
    resolution: int = 64  # rendered image side in pixels
    min_objects: int = 3  # objects per scene, at least
    max_objects: int = 5  # objects per scene, at most
    train_families: int = 9000  # independent scenes (train_family_size 1) train as well as families
    train_family_size: int = 1  # scenes per training family (1: independent scenes)
    # more training families of two: a scene and a near-duplicate differing only in the size or texture of one
    # object (natural near-duplicates, as photographs of one set-up); the sampler keeps both in one batch
    train_detail_pairs: int = 0
    test_families: int = 150  # test scenes, each with its near-duplicates (test_family_size in all)
    test_family_size: int = 6  # a base scene and 5 near-duplicates, each 1 or 2 attributes of one object apart
    test_variants: str = "any"  # what the near-duplicates change: any attribute | details (size, texture only)
    # how many distinct objects each test near-duplicate changes (all of them when a scene has fewer), each in one
    # (60 %) or two of those attributes
    test_changed_objects: int = 1
    pretrain_scenes: int = 20000  # independent scenes with coarse captions (stage A)
    # more pre-training families of two, indexed after the `pretrain_scenes`: a scene and a near-duplicate differing
    # only in the size or texture of one object (in every pretrain split; the sampler keeps both in one batch)
    pretrain_detail_pairs: int = 0
    edits: int = 2000  # instruction-edit pairs
    mmvp_pairs: int = 15  # image pairs per visual pattern
    # zero-shot colour + shape classification (64 classes) of single-object scenes, images per class: what coarse
    # pre-training knows, the demo's forgetting guard
    zeroshot_per_class: int = 0
    # `caption_noisy`: the probability that each size and each texture word is drawn at random (independently per
    # word, seeded) instead of being the image's; 1: every detail word random, 0: `caption_noisy` is the true caption
    detail_random_p: float = 1.0
    workers: int = 2  # rendering processes

    def __post_init__(self) -> None:
        _check_choice("data.synthdense.test_variants", self.test_variants, ("any", "details"))
        check_declared(self, "data.synthdense")
        if self.max_objects < self.min_objects:
            raise ConfigError(
                f"data.synthdense.max_objects ({self.max_objects}) must be >= data.synthdense.min_objects "
                f"({self.min_objects})"
            )


@dataclass
class AugmentConfig:
    """Training-time image augmentation like open_clip's `--aug-cfg` (data.augment); off by default, never in eval.

    The papers' recipes train on CLIP's centre crop, so every recipe leaves this off. On: a random crop of
    `scale` × the image area and aspect ratio in `ratio` (log-uniform), resized to the model's size, then with
    probability `color_jitter_prob` brightness / contrast / saturation / hue jitter of the given strengths, and
    with probability `gray_scale_prob` greyscale. Each sample's draws are seeded from (train.seed, epoch, sample),
    so a run draws the same crops at every world size and loader worker count, and after a resume.
    """

    enabled: bool = False  # turn the augmentation on (training only)
    scale: list[float] = field(default_factory=lambda: [0.9, 1.0])  # open_clip's default crop area range
    ratio: list[float] = field(default_factory=lambda: [0.75, 4 / 3])  # the crop's aspect-ratio range
    color_jitter: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0])  # brightness, contrast, sat., hue
    color_jitter_prob: float = 0.8  # probability of the colour jitter, per image
    gray_scale_prob: float = 0.0  # probability of greyscale, per image

    def __post_init__(self) -> None:
        check_declared(self, "data.augment")
        if len(self.scale) != 2 or not 0 < self.scale[0] <= self.scale[1] <= 1:
            raise ConfigError(f"data.augment.scale: expected [min, max] with 0 < min <= max <= 1, got {self.scale}")
        if len(self.ratio) != 2 or not 0 < self.ratio[0] <= self.ratio[1]:
            raise ConfigError(f"data.augment.ratio: expected [min, max] with 0 < min <= max, got {self.ratio}")
        if len(self.color_jitter) != 4 or min(self.color_jitter) < 0 or self.color_jitter[3] > 0.5:
            raise ConfigError(
                f"data.augment.color_jitter: expected 4 strengths >= 0 (hue <= 0.5), got {self.color_jitter}"
            )


@dataclass
class DataConfig:
    """Where the samples come from, how they are preprocessed and batched (data.build_loader)."""

    format: str = "synthdense"  # see data.formats.FORMATS: synthdense | generic | docci | dci | long_dci | ...
    root: str = ""  # the release folder, laid out as docs/data.md shows
    train_split: str = "train"  # the split training reads
    # train on a subset of the train split (HN-CLIP Fig. 6 / Table A9; data.subset): the first ⌈train_fraction · N⌉
    # samples ranked by sha256("subset_seed:id"), or the first train_count when > 0 (not both). The same samples for
    # every objective, training seed, world size and resume, and nested (5 % inside 20 %); the run directory records
    # the sizes and the sha256 of the ids (train_subset.json). Not for streamed formats (webdataset)
    train_fraction: float = 1.0
    train_count: int = 0  # > 0: train on this many samples of the train split instead (data.train_fraction then 1)
    subset_seed: int = 0  # the subset's own seed: runs with different train.seed share one subset
    eval_split: str = "test"  # the split validated on during training (train.eval_every) and `eval`'s retrieval
    # loader processes: auto = the cores this rank may use (its affinity within the container's CPU quota, shared by
    # the node's ranks; no fixed cap); 0 decodes in the training process. Pinned memory on CUDA, workers kept across
    # epochs, each `prefetch_factor` batches ahead
    num_workers: int | str = "auto"
    prefetch_factor: int = 2  # batches each loader worker prepares ahead (>= 1)
    # decode and preprocess every training image once, before step 1, and keep it in memory (3·H·W float32 a row at
    # the model's size: small datasets trained for many epochs), and each caption's tokens once seen: later epochs
    # open no file and tokenise nothing twice; auto workers become 0. Not with data.augment (its crops are drawn per
    # epoch) nor streamed formats
    preload: bool = False
    # JPEG draft decoding (PIL Image.draft): the decoder's own 1/2-1/8 DCT downscale when the photo is at least twice
    # the model's input, before the exact resize. Training only; evaluation has its own switch (eval.jpeg_draft)
    jpeg_draft: bool = True
    on_bad_sample: str = "error"  # error | skip (skipped samples are counted and reported at the end of each epoch)
    max_image_pixels: int = PIL_MAX_IMAGE_PIXELS  # larger images are bad samples (read from the header, not decoded)
    # batching (the batch size itself is the trainer's: train.batch_size / world size)
    shuffle: bool = True  # for the train split; evaluation splits are never shuffled
    group_batches: bool = True  # rows with the same group (an edit's halves, a family) share a batch
    distinct_captions: bool = False  # keep exact-duplicate captions out of one batch
    # format options
    caption_choice: str = "random"  # several captions per image (COCO/Flickr): first | random (per epoch) | all
    docci_test: str = "goal"  # goal: 5,100 = qual_test + test (GOAL) | test: the 5,000 `test` images (FineLIP)
    dci_caption: str = "extra"  # extra: extra_caption only (GOAL, Long-DCI) | short | short_extra
    # GOAL-style [{filename, caption}] JSON lists (images found by file name in the format's folder). A list replaces
    # one split only: `list_files[split]`, else `list_file` for the split its name says (`DCI_test.json`: test;
    # `DCI_train_del_org.json`: train) or, when its name says none, for `list_split`. Other splits read the release.
    list_file: str = ""
    list_split: str = ""  # the split `list_file` replaces when its file name names none (or to override the name)
    list_files: dict[str, str] = field(default_factory=dict)  # split -> list file, e.g. {train: ..., test: ...}
    overlap: str = "error"  # train vs evaluation images shared: error (refuse to start) | warn (log the count, go on)
    image_alpha: str = "drop"  # drop: PIL convert("RGB"), as OpenAI CLIP / open_clip / Long-CLIP | white: composite
    coco_flickr_protocol: str = "karpathy"  # karpathy: Karpathy test splits | longclip: COCO val2017, all Flickr30k
    annotation_file: str = ""  # overrides the format's default annotation file name (ShareGPT4V, Karpathy)
    sharegpt4v_test_size: int = 1000  # Long-CLIP: the first 1,000 records are the test set
    image_field: str = "image"  # generic JSONL/CSV column names
    caption_field: str = "caption"  # the caption column / JSON key (generic, hf; webdataset: a key of the .json)
    short_caption_field: str = "short_caption"  # an optional short caption's column (CLIP-IN's short + long)
    id_field: str = "id"  # an optional sample-id column (default: the row number; webdataset: the key)
    group_field: str = "group"  # an optional group column: rows of one group share a batch (data.group_batches)
    synthdense: SynthDenseConfig = field(default_factory=SynthDenseConfig)
    # streamed formats (webdataset): shards of the train split, epoch length, shuffle buffer (data.stream)
    shards: list[str] = field(default_factory=list)  # brace patterns relative to data.root; empty: found by split
    epoch_samples: int = 0  # samples per epoch over all ranks (0: one pass over the shards)
    shuffle_buffer: int = 1000  # encoded samples each loader worker holds for shuffling (0: shard order only)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    # a second source of instruction-edit pairs joined to the training split (CLIP-IN stage 2: UltraEdit beside
    # long-caption pairs); empty: none. Its rows go through the same sampler, edit halves kept in one batch.
    edits_format: str = ""  # e.g. ultraedit
    edits_root: str = ""  # the folder of the edit-pair source (data.edits_format)
    edits_split: str = "train"  # the split of the edit-pair source joined to training

    def __post_init__(self) -> None:
        _check_choice("data.on_bad_sample", self.on_bad_sample, ("error", "skip"))
        _check_choice("data.caption_choice", self.caption_choice, ("first", "random", "all"))
        _check_choice("data.docci_test", self.docci_test, ("goal", "test"))
        _check_choice("data.dci_caption", self.dci_caption, ("extra", "short", "short_extra"))
        _check_choice("data.overlap", self.overlap, ("error", "warn"))
        _check_choice("data.image_alpha", self.image_alpha, ALPHA_POLICIES)
        _check_choice("data.coco_flickr_protocol", self.coco_flickr_protocol, ("karpathy", "longclip"))
        if self.num_workers != "auto" and not (str(self.num_workers).isdigit()):
            raise ConfigError(f"data.num_workers: {self.num_workers!r} is neither auto nor a number >= 0")
        check_declared(self, "data")
        if self.preload and self.augment.enabled:
            raise ConfigError(
                "data.preload keeps one decoded copy of each image, but data.augment draws new crops every epoch; "
                "turn one of them off"
            )
        if self.train_count and self.train_fraction < 1.0:
            raise ConfigError("data.train_count and data.train_fraction both choose the subset's size; set one")
        if (self.train_count or self.train_fraction < 1.0) and self.format == "webdataset":
            raise ConfigError(
                "data.train_fraction / data.train_count: webdataset shards stream and are never indexed; list a "
                "subset of the shards in data.shards instead"
            )
        if self.preload and self.format == "webdataset":
            raise ConfigError("data.preload: webdataset shards stream and are never indexed; set it to false")


@dataclass
class TermConfig:
    """One weighted term of the objective: a registered loss, its hyperparameters and where its inputs come from."""

    loss: str = "infonce"  # a name in losses.registry
    weight: float = 1.0  # the term's weight in the sum; 0 disables it
    params: dict[str, Any] = field(default_factory=dict)  # keyword hyperparameters of the loss (gamma, ...)
    inputs: dict[str, str] = field(default_factory=dict)  # loss argument -> feature (text -> text_short)


@dataclass
class LossConfig:
    """The objective as named weighted terms (losses.build_objective), e.g. HN-CLIP eq. 3 or CLIP-IN eq. 8. On the
    command line `loss.terms:={…}` replaces a recipe's terms, `~loss.terms.NAME` deletes one, and `loss.terms={…}`
    merges into them."""

    # Empty in the schema so that a recipe's terms replace the default instead of merging into it (OmegaConf merges
    # dict keys); `load_config` fills in DEFAULT_TERMS when no layer names any. A weight of 0 disables a term.
    terms: dict[str, TermConfig] = field(default_factory=dict)  # named terms, summed; none given: one infonce term


DEFAULT_TERMS = {"contrastive": TermConfig("infonce")}


@dataclass
class GuardConfig:
    """A forgetting guard (train.guards; eval.guards does the arithmetic): one evaluation number, `suite/key/…`
    (e.g. `zeroshot/top1`, `coco/mean_R@1`), evaluated at every validation as its change from the initial model;
    with `max_drop`, a checkpoint that lost more points than that cannot become the best one."""

    metric: str = ""  # suite/key of an evaluation number, e.g. zeroshot/top1 or coco/mean_R@1
    max_drop: float | None = None  # points it may lose from the initial model before a checkpoint cannot be best

    def __post_init__(self) -> None:
        if "/" not in self.metric:
            raise ConfigError(f"train.guards: metric {self.metric!r} must be suite/key, e.g. zeroshot/top1")
        if self.max_drop is not None and not self.max_drop >= 0:
            raise ConfigError(f"train.guards ({self.metric}): max_drop must be >= 0 points, got {self.max_drop}")


@dataclass
class TrainConfig:
    """The optimisation loop (train.Trainer)."""

    output_dir: str = "runs/default"  # the run directory: config, metrics, checkpoints, reports, figures
    seed: int = 0  # seeds the initial weights, dropout, augmentation and the data order
    epochs: int = 1  # passes over the training data (train.max_steps, when set, stops sooner)
    max_steps: int = 0  # > 0 stops after this many optimiser steps (and sets the schedule's length)
    batch_size: int = 128  # effective (global) batch: the size of the contrastive matrix under `exact`
    # rows per forward pass (under per_micro_batch: rows per contrastive matrix); auto: the largest that fits the
    # device's memory, found by trial steps before step 1 (train.micro_batch; under per_micro_batch auto keeps the
    # micro-batch the lower layers set and sizes encode_batch_size instead)
    micro_batch_size: Any = 16
    accumulation: str = "exact"  # exact (cached gradients) | per_micro_batch (each micro-batch its own loss)
    # per_micro_batch only: rows per forward pass, a multiple of micro_batch_size (0: micro_batch_size); the
    # micro-batches of one pass keep their own matrices, so only speed and memory change (faster when memory
    # allows); auto: the largest that fits the device's memory, found by trial steps before step 1
    encode_batch_size: Any = 0
    lr: float = 1e-5  # AdamW's peak learning rate, after the warmup and before the schedule's decay
    module_lr: dict[str, float] = field(default_factory=dict)  # parameter-name prefix -> lr (longest prefix wins)
    weight_decay: float = 0.1  # not applied to gains, biases, logit scale/bias
    beta1: float = 0.9  # AdamW's first-moment decay (open_clip's --beta1)
    beta2: float = 0.98  # AdamW's second-moment decay (open_clip's --beta2; 0.98 is CLIP's fine-tuning default)
    eps: float = 1e-6  # AdamW's epsilon (open_clip's --eps)
    warmup_steps: int = 0  # optimiser steps of linear warmup to train.lr
    # the learning rate after the warmup: cosine (down to lr * min_lr_ratio), linear (straight down to lr *
    # min_lr_ratio) or constant (train.lr to the end)
    schedule: str = "cosine"
    min_lr_ratio: float = 0.0  # the cosine or linear schedule ends at lr * min_lr_ratio
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    device: str = "auto"  # auto (cuda:<LOCAL_RANK> when CUDA is available, else cpu) | cpu | cuda | cuda:N
    # minutes a collective may wait for the slowest rank before the run stops (torch's default is 10): rank 0
    # counts shards and writes checkpoints while the others wait, which takes minutes for large data or models
    dist_timeout_min: float = 60.0
    # how parameters are laid out over ranks: replicate (every rank holds all, DDP's semantics) | hybrid (sharded
    # within a node, replicated across nodes) | shard (sharded over all ranks)
    layout: str = "replicate"
    # hybrid and shard: keep each block's parameters gathered for the whole step and reduce gradients once, after
    # the step's last backward (fewer all-gathers and reductions under accumulation, for models whose gathered
    # blocks fit); the default frees each block after every pass and reduces every pass's gradients
    keep_gathered: bool = False
    precision: str = "fp32"  # fp32 | bf16 (bf16 weight copies and autocast in the towers; losses in fp32)
    tf32: bool = True  # TF32 matmuls on CUDA (fp32 accumulation); no effect on the CPU
    compile: bool = False  # torch.compile every transformer block (the first steps pay for compilation)
    compile_fullgraph: bool = False  # under train.compile: a graph break in a block is an error, not a silent split
    grad_checkpointing: bool = False  # recompute each tower layer in backward (activation memory of one layer)
    checkpoint_every: int = 0  # optimiser steps between checkpoints (0: at the end of each epoch only)
    # minutes between checkpoints, by rank 0's clock (0: off), beside train.checkpoint_every: a job that stops keeps
    # at most this much work since its last checkpoint
    checkpoint_every_min: float = 0.0
    keep_last: int = 2  # newest checkpoints kept (>= 1), besides the best
    # signals that end the run cleanly: every rank finishes its step, a checkpoint is written, exit status 75
    # (SIGTERM, SIGUSR1, SIGUSR2, SIGINT; [] keeps the default actions); a second SIGTERM ends the process at once
    stop_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    # minutes a rank may make no progress within training before every rank stops with one line naming it (0: off;
    # at least 0.05; saves and validations are bounded by train.dist_timeout_min instead)
    hang_timeout_min: float = 10.0
    # CUDA only: a checkpoint's state is copied to CPU memory and written in the background (dcp.async_save) while
    # training goes on; the folder is renamed complete when the write is done (off, or on the CPU: written at once)
    async_checkpoint: bool = False
    eval_every: int = 1  # epochs between evaluations (0: never)
    best_metric: str = "mean_R@1"  # the evaluation number that picks the best checkpoint (higher is better)
    diagnostics_every: int = 0  # optimiser steps between gradient diagnostics (0: off)
    nan_patience: int = 5  # consecutive non-finite steps (skipped) before the run stops
    progress: bool = True  # a progress bar on stderr when it is a terminal (ETA, loss, samples/s)
    # optimiser steps between plain progress lines in train.log (step, epoch, loss terms, lr, samples/s, data-wait
    # share, ETA), also on stderr when it is not a terminal or the bar is off (0: none)
    log_every: int = 50
    tensorboard: bool = False  # also write TensorBoard scalars to RUN/tensorboard (extra [tensorboard])
    wandb: bool = False  # also log to Weights & Biases, the run stored under RUN/wandb (extra [wandb])
    wandb_project: str = "sharpclip"  # the W&B project name
    wandb_name: str = ""  # the W&B run name; default: the run directory's name
    # forgetting guards, evaluated with the validation (eval.* settings; the initial model once, before step 0)
    guards: list[GuardConfig] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_choice("train.accumulation", self.accumulation, ("exact", "per_micro_batch"))
        _check_choice("train.precision", self.precision, ("fp32", "bf16"))
        _check_choice("train.layout", self.layout, ("replicate", "hybrid", "shard"))
        _check_choice("train.schedule", self.schedule, SCHEDULES)
        _check_device("train.device", self.device)
        self._check_auto()
        self._check_ranges()
        if self.micro_batch_size != AUTO and self.batch_size % self.micro_batch_size:
            raise ConfigError(
                f"train.batch_size ({self.batch_size}) must be a multiple of train.micro_batch_size "
                f"({self.micro_batch_size})"
            )
        self._check_encode_batch_size()

    def _check_auto(self) -> None:
        """Each of the two sizes: an integer, or `auto` where the accumulation mode allows it."""
        for key in ("micro_batch_size", "encode_batch_size"):
            value = getattr(self, key)
            if value != AUTO and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f"train.{key}: must be an integer or auto, got {value!r}")
        if self.micro_batch_size == AUTO and self.accumulation == "per_micro_batch":
            raise ConfigError(
                "train.micro_batch_size: auto under accumulation: per_micro_batch needs the micro-batch (each its own "
                "contrastive matrix) from a recipe or an earlier layer; give it and set train.encode_batch_size=auto"
            )

    def _check_encode_batch_size(self) -> None:
        size, micro = self.encode_batch_size, self.micro_batch_size
        if not size:
            return
        if self.accumulation != "per_micro_batch":
            raise ConfigError(
                "train.encode_batch_size applies to accumulation: per_micro_batch only (under exact, "
                "train.micro_batch_size is already the rows per forward pass); set it to 0"
            )
        if size != AUTO and (size % micro or self.batch_size % size):
            raise ConfigError(
                f"train.encode_batch_size ({size}) must be a multiple of train.micro_batch_size ({micro}) that "
                f"divides train.batch_size ({self.batch_size})"
            )

    def _check_ranges(self) -> None:
        check_declared(self, "train")
        rate = max([self.lr, *self.module_lr.values()])
        if self.weight_decay * rate >= 1:  # AdamW's decoupled decay: w ← w·(1 − lr·weight_decay) every step
            raise ConfigError(
                f"train.weight_decay: {self.weight_decay:g} with a learning rate of {rate:g} makes AdamW multiply "
                f"every decayed weight by 1 - lr·weight_decay = {1 - rate * self.weight_decay:.3g} each step, which "
                "erases or flips it; lower train.weight_decay (typically 0.01-0.5, CLIP's 0.2) or the learning rate "
                "(typically 1e-6-1e-3)"
            )
        if self.best_metric not in VALIDATION_METRICS:
            raise ConfigError(
                f"train.best_metric: {self.best_metric!r} is not a validation metric; use one of "
                f"{', '.join(VALIDATION_METRICS)}"
            )
        if self.guards and not self.eval_every:
            raise ConfigError("train.guards are evaluated with the validation: set train.eval_every >= 1")
        _check_signals("train.stop_signals", self.stop_signals)
        if 0 < self.hang_timeout_min < HANG_FLOOR_MIN:
            raise ConfigError(
                f"train.hang_timeout_min: {self.hang_timeout_min:g} is shorter than a training step may take: every "
                f"healthy run would stop as hung; give 0 (no hang check) or at least {HANG_FLOOR_MIN:g} (minutes)"
            )


# data options one suite reads itself, beside DataConfig's fields (eval.benchmarks): SPEC's subsets to score
SUITE_ONLY_OPTIONS = {"spec": ("subsets",)}


@dataclass
class EvalConfig:
    """What to evaluate (eval.run_suite): benchmark names of eval.suite.DATASETS, each read from its own root."""

    suites: list[str] = field(default_factory=lambda: ["retrieval"])  # "retrieval" = data.format on data.eval_split
    data_root: str = ""  # a suite's root is roots[name], else data_root/<name> if it exists, else data_root
    roots: dict[str, str] = field(default_factory=dict)  # suite name -> its own data folder, e.g. {docci: /data/docci}
    # per-suite data options merged into that suite's DataConfig, e.g. {dci: {list_file: DCI_test.json}} for GOAL's
    # DCI protocol, {docci: {docci_test: goal}}; keys are DataConfig fields other than format and root, and for
    # spec `subsets` (the subsets to score; default all six, each required)
    data_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    split: str = "test"  # the split of the `retrieval` suite (the run's own data)
    recall_k: list[int] = field(default_factory=lambda: [1, 5, 10, 25, 50])  # the K of the reported Recall@K
    chunk_size: int = 1024  # query rows scored at once: memory O(chunk_size × gallery)
    batch_size: int = 64  # images / captions per forward pass
    prompts: str = "photo"  # zero-shot prompt set: a name in eval.zeroshot.PROMPT_SETS or a file, one template a line
    zeroshot_k: list[int] = field(default_factory=lambda: [1, 5])  # the K of zero-shot top-K accuracy
    hash_images: bool = False  # sha256 every image in the manifest (slow on large benchmarks)
    image_alpha: str = "drop"  # transparency: drop (PIL convert("RGB"), every reference evaluator) | white
    output_dir: str = ""  # reports go here; default <train.output_dir>/eval
    device: str = "auto"  # auto | cpu | cuda | cuda:N, as train.device
    jpeg_draft: bool = False  # JPEG draft decoding (see data.jpeg_draft); off: scores from the exact full decode
    progress: bool = True  # a progress bar on stderr while embedding
    precision: str = "fp32"  # fp32 | bf16 (autocast on the towers; in-training validation uses train.precision)
    num_workers: int | str = "auto"  # image decoding processes: auto (as data.num_workers) or a number

    def __post_init__(self) -> None:
        check_declared(self, "eval")
        _check_device("eval.device", self.device)
        bad = [k for k in [*self.recall_k, *self.zeroshot_k] if k < 1]
        if bad:
            raise ConfigError(f"eval.recall_k / eval.zeroshot_k: values must be >= 1, got {bad}")
        _check_choice("eval.image_alpha", self.image_alpha, ALPHA_POLICIES)
        _check_choice("eval.precision", self.precision, ("fp32", "bf16"))
        self._check_data_options()

    def _check_data_options(self) -> None:
        for suite, options in self.data_options.items():
            allowed = {f.name for f in fields(DataConfig)} - {"format", "root"} | set(SUITE_ONLY_OPTIONS.get(suite, ()))
            for key in options:
                if key not in allowed:
                    raise ConfigError(
                        f"eval.data_options.{suite}.{key}: not a data option a suite can set; "
                        f"use one of {', '.join(sorted(allowed))} (a suite's root is eval.roots.{suite})"
                    )
            if "on_bad_sample" in options:  # pair-choice suites read it without building a DataConfig
                _check_choice(f"eval.data_options.{suite}.on_bad_sample", options["on_bad_sample"], ("error", "skip"))


@dataclass
class Config:
    """The whole configuration: one section per part."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


# Settings that no longer exist, with what replaced them (the error an old config meets). The model decides its own
# preprocessing (models.preprocessing), so a data-side copy could only disagree with it.
_BY_MODEL = "the model decides this (models.preprocessing reads it from the model); drop the key"
REMOVED_KEYS = {
    "train.diagnostics_gamma": "the gradient diagnostics read γ from the objective's hn_clip term "
    "(loss.terms.<name>.params.gamma; hn_clip's default 0.5 without one); delete the key",
    "data.image_size": f"{_BY_MODEL} (a tiny preset's size is model.tiny.image_size)",
    "data.image_mean": f"{_BY_MODEL} (it is the image processor's mean; set model.processor to choose another)",
    "data.image_std": f"{_BY_MODEL} (it is the image processor's std; set model.processor to choose another)",
    "data.context_length": f"{_BY_MODEL} (set model.context_length to stretch the text tower, e.g. 248)",
}


# Settings that name files or folders: a leading `~` is the home folder (os.path.expanduser) wherever the value was
# written, a YAML file (no shell expands it there) or the command line; `*`: every value of a mapping.
PATH_KEYS = (
    "model.name", "model.vocabulary", "model.processor", "model.open_clip_config", "data.root", "data.list_file",
    "data.list_files.*", "data.annotation_file", "data.shards", "data.edits_root", "train.output_dir",
    "eval.data_root", "eval.roots.*", "eval.output_dir", "eval.prompts",
)  # fmt: skip


def _expand_paths(cfg: Config) -> None:
    """`~` and `~user` at the start of every PATH_KEYS value (lists and mappings item by item)."""
    for key in PATH_KEYS:
        section_name, name = key.split(".", 1)
        section, name = getattr(cfg, section_name), name.removesuffix(".*")
        value = getattr(section, name)
        if isinstance(value, str):
            setattr(section, name, os.path.expanduser(value))
        elif isinstance(value, list):
            setattr(section, name, [os.path.expanduser(v) if isinstance(v, str) else v for v in value])
        elif isinstance(value, dict):
            setattr(section, name, {k: os.path.expanduser(v) if isinstance(v, str) else v for k, v in value.items()})
    data_paths = {k.split(".", 1)[1].removesuffix(".*") for k in PATH_KEYS if k.startswith("data.")}
    for options in cfg.eval.data_options.values():  # a suite's own data settings (list_file, annotation_file, ...)
        for name in data_paths & options.keys():
            if isinstance(options[name], str):
                options[name] = os.path.expanduser(options[name])


def is_path_key(key: str) -> bool:
    """Whether dotted `key` is one of PATH_KEYS (a mapping's entries by `prefix.*`)."""
    return key in PATH_KEYS or any(p.endswith(".*") and key.startswith(p[:-1]) for p in PATH_KEYS)


def as_place(value: Any) -> Any:
    """A path setting's value with its spelling's noise removed, for comparing two configs (os.path.normpath of each
    non-empty string: a trailing `/`, `./`, `a/../`; lists item by item); other values unchanged."""
    if isinstance(value, list):
        return [as_place(v) for v in value]
    return os.path.normpath(value) if isinstance(value, str) and value else value


# Other tools' names for sharpclip's settings (open_clip's flags, transformers' TrainingArguments), by leaf name
ALIASES = {
    "learning_rate": "train.lr", "num_train_epochs": "train.epochs", "per_device_train_batch_size": "train.batch_size",
    "train_batch_size": "train.batch_size", "wd": "train.weight_decay", "warmup": "train.warmup_steps",
    "workers": "data.num_workers", "dataloader_num_workers": "data.num_workers", "grad_clip_norm": "train.grad_clip",
    "max_grad_norm": "train.grad_clip", "logs": "train.output_dir", "train_data": "data.root",
    "save_total_limit": "train.keep_last", "save_steps": "train.checkpoint_every", "eval_steps": "train.eval_every",
    "gradient_checkpointing": "train.grad_checkpointing", "torch_compile": "train.compile",
    "dataset_type": "data.format", "csv_img_key": "data.image_field", "csv_caption_key": "data.caption_field",
    "pretrained": "model.name", "model_name_or_path": "model.name", "lock_image": "model.freeze.vision",
    "lock_text": "model.freeze.text", "max_steps": "train.max_steps", "adam_beta1": "train.beta1",
    "adam_beta2": "train.beta2", "adam_epsilon": "train.eps", "lr_scheduler": "train.schedule",
    "lr_scheduler_type": "train.schedule", "weight_decay_rate": "train.weight_decay",
}  # fmt: skip


def config_keys(node: Any = Config, prefix: str = "") -> list[str]:
    """Every dotted key of the schema (a mapping or list setting is one key), in declaration order."""
    keys = []
    for f in fields(node):
        key = f"{prefix}{f.name}"
        default = f.default_factory() if f.default_factory is not MISSING else f.default  # type: ignore[misc]
        keys += config_keys(type(default), f"{key}.") if is_dataclass(default) else [key]
    return keys


def suggest_keys(key: str, limit: int = 3) -> list[str]:
    """The settings a mistyped or foreign dotted `key` (or a bare leaf, `batch_size`) most likely means: an alias,
    keys with the same leaf name, then close spellings (difflib) of the whole key and of its leaf."""
    known, leaf = config_keys(), key.rsplit(".", 1)[-1].replace("-", "_")
    if key.startswith("loss.terms.") and key.count(".") >= 3:  # a term's own fields (its params are the loss's)
        term = key.split(".")[2]
        known += [f"loss.terms.{term}.{f.name}" for f in fields(TermConfig)]
    found = [ALIASES[leaf]] if leaf in ALIASES else []
    found += [k for k in known if k.rsplit(".", 1)[-1] == leaf]
    found += difflib.get_close_matches(key, known, n=limit, cutoff=0.75)
    section = key.rsplit(".", 1)[0] + "." if "." in key else ""  # a bare leaf (a flag's name): every section's
    leaves: dict[str, list[str]] = {}
    for k in known:
        if k.startswith(section):
            leaves.setdefault(k.rsplit(".", 1)[-1], []).append(k)
    for m in difflib.get_close_matches(leaf, list(leaves), n=limit, cutoff=0.6 if section else 0.8):
        found += leaves[m]
    return list(dict.fromkeys(k for k in found if k != key))[:limit]


def _did_you_mean(key: str) -> str:
    found = suggest_keys(key)
    return f"; did you mean {' or '.join(found)}?" if found else ""


def _merge(base: Any, layer: Any, source: str, given: str = "") -> Any:
    """`layer` over `base`; an error names `source` and the key (`given`: the override's own dotted key, which is
    more precise than OmegaConf's for a key under an unknown section)."""
    try:
        return OmegaConf.merge(base, layer)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        if isinstance(err, ConfigKeyError) and given.startswith(f"{key}."):
            key = given
        if key in REMOVED_KEYS:
            raise ConfigError(f"{source}: key '{key}' is no longer a setting: {REMOVED_KEYS[key]}") from None
        if isinstance(err, ConfigKeyError) and key != "?":  # not a setting: the likely one, if any
            raise ConfigError(f"{source}: '{key}' is not a setting{_did_you_mean(key)}") from None
        reason = str(err).splitlines()[0]
        if "is not Optional" in reason and given:  # `key=null` for a deletion
            reason += f"; to delete an entry of a mapping write ~{given} (docs/config.md#overrides)"
        if is_path_key(key) and "'None'" in reason:  # `output_dir: ~` is YAML's null, not the home folder
            reason += "; a bare ~ is YAML's null: write the folder out, or quote it ('~')"
        raise ConfigError(f"{source}: key '{key}': {reason}") from None


def _drop_removed(layer: DictConfig, file: Path) -> None:
    """Delete the REMOVED_KEYS a saved run config still holds, warning once per key."""
    for key in REMOVED_KEYS:
        section, name = key.split(".", 1)
        if isinstance(layer.get(section), DictConfig) and name in layer[section]:
            del layer[section][name]
            logging.getLogger("sharpclip.config").warning(
                "%s: ignoring '%s', no longer a setting: %s", file, key, REMOVED_KEYS[key]
            )


def _not_a_mapping(file: Path) -> str | None:
    """The error for a YAML file whose top level parses but is not a mapping (a list, a number, ...), else None."""
    try:
        top = yaml.safe_load(file.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError, OSError):
        return None
    if top is None or isinstance(top, dict):
        return None
    return (
        f"{file}: the top level must be a mapping of sections (model:, data:, loss:, train:, eval:), "
        f"not a {type(top).__name__}"
    )


SECTIONS = tuple(f.name for f in fields(Config))  # the top level: a `~` word naming one of these is a deletion


def is_deletion(word: str) -> bool:
    """Whether command-line `word` is a deletion override, `~section.key` (Hydra's spelling), rather than a file
    under a home folder (`~/recipes/x.yaml`, `~user/x.yaml`)."""
    return word.startswith("~") and "=" not in word and "/" not in word and word[1:].split(".")[0] in SECTIONS


def split_args(args: list[str] | tuple[str, ...]) -> tuple[list[str], list[str]]:
    """Command-line words -> (YAML files, overrides): a word with '=' is an override (`key=value` merges,
    `key:=value` replaces), and so is `~key` (deletes); a file's `~` is the home folder, also when the shell left it
    alone (quoted)."""
    overrides = [a for a in args if "=" in a or is_deletion(a)]
    check_typed_overrides(overrides)
    return [os.path.expanduser(a) for a in args if a not in overrides], overrides


def check_typed_overrides(overrides: list[str] | tuple[str, ...]) -> None:
    """Refuse one key given several times in a row with different values: what the shell makes of an unquoted brace
    pattern (`data.shards=[x-{0..3}.tar]` → four words, `data.shards=[x-0.tar]` ... `[x-3.tar]`, the last one
    winning), which would otherwise train on one shard of four without a word."""
    keys = [o.split("=", 1)[0] for o in overrides]
    for i in range(1, len(keys)):
        if keys[i] == keys[i - 1] and overrides[i] != overrides[i - 1]:
            run = [o for o, k in zip(overrides, keys, strict=True) if k == keys[i]]
            raise ConfigError(
                f"override {keys[i]} is given {len(run)} times in a row ({', '.join(run)}): did the shell expand a "
                "brace pattern? Quote the whole override (e.g. 'data.shards=[x-{0..3}.tar]') and give each key once"
            )


def _quoted_list(item: str) -> str | None:
    """`key=[a-{0..3}.tar, b]` with each item that holds braces quoted (YAML reads `{` as a mapping); None when the
    value is not a flat list."""
    key, _, value = item.partition("=")
    value = value.strip()
    if not (value.startswith("[") and value.endswith("]")) or "[" in value[1:-1]:
        return None
    items, depth, current = [], 0, ""
    for ch in value[1:-1]:
        depth += (ch == "{") - (ch == "}")
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    items.append(current)
    quoted = [json.dumps(t.strip()) if "{" in t and not t.strip().startswith(('"', "'")) else t for t in items]
    return f"{key}=[{','.join(quoted)}]"


def parse_override(item: str) -> DictConfig:
    """One `key=value` as an OmegaConf layer; an unquoted brace pattern in a list is read as a string (what it
    always means in a sharpclip setting); other values that are not YAML are a one-line ConfigError."""
    key, _, value = item.partition("=")
    if value.strip() == "~" and is_path_key(key.strip()):  # the shell left it unexpanded (`key=~`): the home folder
        item = f"{key}='~'"
    try:
        return OmegaConf.from_dotlist([item])
    except yaml.YAMLError as err:
        quoted = _quoted_list(item)
        if quoted is not None:
            try:
                return OmegaConf.from_dotlist([quoted])
            except yaml.YAMLError:
                pass
        reason = " ".join(str(err).split())
        raise ConfigError(
            f"override {item!r}: the value is not valid YAML ({reason}); quote strings holding braces, brackets or "
            "commas, e.g. 'data.shards=[\"shards-{000000..000003}.tar\"]'"
        ) from None


def apply_override(merged: DictConfig, item: str) -> DictConfig:
    """One command-line override over the layers merged so far: `key=value` merges (a mapping value adds to the
    mapping's entries), `key:=value` replaces the key's value wholesale, `~key` deletes a mapping's entry (a schema
    setting goes back to its default)."""
    if is_deletion(item):
        _delete(merged, item[1:].strip(), f"override {item!r}")
        return merged
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected key=value (e.g. train.lr=1e-4), key:=value or ~key")
    key, _, value = item.partition("=")
    key = key.strip()
    if key.endswith(":"):  # key:=value, the replacing spelling
        key = key[:-1].strip()
        _delete(merged, key, f"override {item!r}", missing_ok=True)
        return _merge(merged, parse_override(f"{key}={value}"), f"override {item!r}", key)
    layer = parse_override(item)
    _warn_merged(merged, layer, key, item)
    return _merge(merged, layer, f"override {item!r}", key)


def _delete(merged: DictConfig, key: str, source: str, missing_ok: bool = False) -> None:
    """Delete dotted `key`: a mapping's entry goes, a schema setting gets its default back."""
    parent_key, _, name = key.rpartition(".")
    parent = OmegaConf.select(merged, parent_key) if parent_key else merged
    if not isinstance(parent, DictConfig) or name not in parent:
        if missing_ok and isinstance(parent, DictConfig):
            return
        if isinstance(parent, DictConfig):
            held = f" ({parent_key or 'the config'} holds: {', '.join(map(str, parent)) or 'nothing'})"
        else:
            held = _did_you_mean(key)
        raise ConfigError(f"{source}: there is no '{key}' to delete{held}")
    schema = OmegaConf.get_type(parent)
    if schema is dict or schema is None:
        del parent[name]
    else:  # a dataclass field: its default (a fresh node of the same type holds it)
        parent[name] = OmegaConf.structured(schema)[name]


def _warn_merged(merged: DictConfig, layer: DictConfig, key: str, item: str) -> None:
    """Say so when a mapping value given with `=` keeps entries of the earlier layers (`loss.terms={clip: …}` over
    a recipe trains the recipe's terms plus clip): the merge is OmegaConf's rule, a replacement is `:=`."""
    given, before = OmegaConf.select(layer, key), OmegaConf.select(merged, key, default=None)
    if not (isinstance(given, DictConfig) and isinstance(before, DictConfig)) or OmegaConf.get_type(before) is not dict:
        return
    kept = [str(k) for k in before if k not in given]
    if kept:
        logging.getLogger("sharpclip.config").warning(
            "override %r merges into %s, which keeps %s from the earlier layers; to replace it write %s:=%s",
            item, key, ", ".join(kept), key, item.partition("=")[2].strip(),
        )  # fmt: skip


def load_config(
    path: str | Path | list[str | Path] | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    saved: bool = False,
) -> Config:
    """Build a validated `Config`: defaults, then each YAML file of `path` in order, then `key=value` overrides.

    Several files layer like overrides (a recipe, then e.g. configs/tiny_synthdense.yaml or a file of local paths).
    An unknown key or a value of the wrong type raises `ConfigError` naming the file or override and the key.
    saved: the files are a run directory's own config.yaml, written by an older sharpclip perhaps: keys of
    REMOVED_KEYS there are dropped with a warning (the run stays readable) instead of refused.
    """
    merged = OmegaConf.structured(Config)
    micro = merged.train.micro_batch_size  # the last integer micro-batch of the layers (per_micro_batch's auto)
    paths = [] if path is None else [path] if isinstance(path, str | Path) else list(path)
    for file in map(Path, paths):
        if not file.is_file():
            raise ConfigError(f"{file}: config file not found")
        try:
            layer = OmegaConf.load(file)
        except Exception as err:  # yaml errors carry line numbers in their message
            reason = " ".join(str(err).split())  # one line: a parser's message spans several (mark, problem)
            raise ConfigError(_not_a_mapping(file) or f"{file}: not valid YAML: {reason}") from None
        if not isinstance(layer, DictConfig):
            raise ConfigError(_not_a_mapping(file) or f"{file}: the top level must be a mapping")
        if saved:
            _drop_removed(layer, file)
        merged = _merge(merged, layer, str(file))
        micro = _numeric_micro(merged, micro)
    for item in overrides:
        merged = apply_override(merged, item)
        micro = _numeric_micro(merged, micro)
    _auto_encode_passes(merged, micro)
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ConfigError(str(err).splitlines()[0]) from None
    _expand_paths(cfg)
    if not cfg.loss.terms:
        cfg.loss.terms = {
            name: TermConfig(t.loss, t.weight, dict(t.params), dict(t.inputs)) for name, t in DEFAULT_TERMS.items()
        }
    return cfg


def _numeric_micro(merged: DictConfig, last: Any) -> Any:
    """`train.micro_batch_size` of the layers merged so far when it is a number, else `last`."""
    value = merged.train.micro_batch_size
    return last if value == AUTO else value


def _auto_encode_passes(merged: DictConfig, micro: Any) -> None:
    """Under per_micro_batch the micro-batch is the contrastive matrix, which memory must not change: there
    `train.micro_batch_size: auto` keeps the last number the layers gave it (the recipe's, else the default) and
    sizes the encode passes instead (`train.encode_batch_size: auto`)."""
    train = merged.train
    if train.micro_batch_size != AUTO or train.accumulation != "per_micro_batch":
        return
    train.micro_batch_size, train.encode_batch_size = micro, AUTO
    logging.getLogger("sharpclip.config").info(
        "train.micro_batch_size: auto under per_micro_batch keeps the micro-batch of %s rows (each its own contrastive "
        "matrix) and sizes the rows per forward pass instead (train.encode_batch_size: auto)", micro,
    )  # fmt: skip


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML, as written into every run directory."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
