"""Typed configuration: one dataclass per part, filled from YAML plus dotted command-line overrides.

OmegaConf structured configs do the merging and type checking; this module only turns their errors into messages
that name the source (file or override) and the full key, and validates choices that a type cannot express.
`run_*` entry points are the only places that see the whole `Config`; every builder takes its own sub-config.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A configuration value is unknown, mistyped or out of range; the message names the key and its source."""


ALPHA_POLICIES = ("drop", "white")  # data.images.to_rgb: what becomes of transparent pixels
VALIDATION_KS = (1, 5, 10)  # the per-epoch validation's recall levels (eval.evaluator.retrieval_validator)
VALIDATION_METRICS = (
    *(f"{d}_R@{k}" for d in ("t2i", "i2t") for k in VALIDATION_KS),
    "mean_R@1",
)  # what `train.best_metric` may name
PIL_MAX_IMAGE_PIXELS = 89_478_485  # PIL.Image.MAX_IMAGE_PIXELS's default (its decompression-bomb limit)


def _check_min(key: str, value: float, low: float) -> None:
    if not value >= low:  # also refuses NaN
        raise ConfigError(f"{key}: must be >= {low:g}, got {value}")


def _check_lr(key: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{key}: a learning rate must be finite and > 0, got {value}")


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(choices)}")


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
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0

    def __post_init__(self) -> None:
        _check_choice("model.adapter.method", self.method, ("none", "lora", "dora"))
        _check_choice("model.adapter.towers", self.towers, ("text", "vision", "both"))
        _check_choice("model.adapter.modules", self.modules, ("attention", "mlp", "attention_mlp"))
        if self.rank < 1:
            raise ConfigError(f"model.adapter.rank: must be >= 1, got {self.rank}")


@dataclass
class FreezeConfig:
    """Lock a tower, optionally leaving its last N layers (and the norm + projection after them) trainable."""

    vision: bool = False
    text: bool = False
    vision_unlocked_layers: int = 0
    text_unlocked_layers: int = 0


@dataclass
class TinyConfig:
    """Sizes of the tiny presets (models.tiny): the defaults are the unit-test size; the demo's SynthDense model
    (demo.plan) is width 64, 2 + 2 layers, patch 8, 48 px, context 152."""

    width: int = 32  # hidden size of both towers and the projection
    layers: int = 2  # per tower
    heads: int = 4
    mlp_ratio: int = 2  # intermediate size = mlp_ratio * width
    patch_size: int = 8
    image_size: int = 32
    context_length: int = 0  # text positions; 0 keeps the real tower's (77 CLIP, 64 SigLIP)

    def __post_init__(self) -> None:
        if min(self.width, self.layers, self.heads, self.mlp_ratio, self.patch_size) < 1 or self.width % self.heads:
            raise ConfigError(f"model.tiny: sizes must be >= 1 and width divisible by heads, got {self}")
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
    rope_theta: float = 10000.0
    rope_ntk_factor: float = 0.0  # > 0: NTK-scale theta for context_length beyond the distilled length (TULIP: 8)
    logit_scale_learnable: bool = True
    logit_scale_init: float | None = None  # log space; None keeps the checkpoint's value
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    freeze: FreezeConfig = field(default_factory=FreezeConfig)
    tiny: TinyConfig = field(default_factory=TinyConfig)  # sizes of a tiny-* preset; ignored for other names

    def __post_init__(self) -> None:
        _check_choice("model.kind", self.kind, ("auto", "clip", "siglip", "siglip2", "open_clip"))
        _check_choice("model.text_encoder", self.text_encoder, ("absolute", "rope"))
        _check_choice("model.activation", self.activation, ("", "quick_gelu", "gelu"))


@dataclass
class SynthDenseConfig:
    """Sizes of the generated SynthDense corpus (data.synthetic); the corpus is a pure function of these values."""

    seed: int = 0
    resolution: int = 64  # rendered image side in pixels
    min_objects: int = 3
    max_objects: int = 5
    train_families: int = 9000  # independent scenes (train_family_size 1) train as well as families
    train_family_size: int = 1
    # more training families of two: a scene and a near-duplicate differing only in the size or texture of one
    # object (natural near-duplicates, as photographs of one set-up); the sampler keeps both in one batch
    train_detail_pairs: int = 0
    test_families: int = 150
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
        if self.test_changed_objects < 1:
            raise ConfigError(f"data.synthdense.test_changed_objects must be >= 1; got {self.test_changed_objects}")
        if not 0.0 <= self.detail_random_p <= 1.0:
            raise ConfigError(f"data.synthdense.detail_random_p must be in [0, 1]; got {self.detail_random_p}")


@dataclass
class AugmentConfig:
    """Training-time image augmentation like open_clip's `--aug-cfg` (data.augment); off by default, never in eval.

    The papers' recipes train on CLIP's centre crop, so every recipe leaves this off. On: a random crop of
    `scale` × the image area and aspect ratio in `ratio` (log-uniform), resized to the model's size, then with
    probability `color_jitter_prob` brightness / contrast / saturation / hue jitter of the given strengths, and
    with probability `gray_scale_prob` greyscale.
    """

    enabled: bool = False
    scale: list[float] = field(default_factory=lambda: [0.9, 1.0])  # open_clip's default crop area range
    ratio: list[float] = field(default_factory=lambda: [0.75, 4 / 3])
    color_jitter: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0])  # brightness, contrast, sat., hue
    color_jitter_prob: float = 0.8
    gray_scale_prob: float = 0.0

    def __post_init__(self) -> None:
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
    train_split: str = "train"
    # train on a subset of the train split (HN-CLIP Fig. 6 / Table A9; data.subset): the first ⌈train_fraction · N⌉
    # samples ranked by sha256("subset_seed:id"), or the first train_count when > 0 (not both). The same samples for
    # every objective, training seed, world size and resume, and nested (5 % inside 20 %); the run directory records
    # the sizes and the sha256 of the ids (train_subset.json). Not for streamed formats (webdataset)
    train_fraction: float = 1.0
    train_count: int = 0
    subset_seed: int = 0  # the subset's own seed: runs with different train.seed share one subset
    eval_split: str = "test"
    # loader processes: auto = the cores available to this rank (affinity / ranks on the node), at most 8; 0 decodes
    # in the training process. Pinned memory on CUDA, workers kept across epochs, each `prefetch_factor` batches ahead
    num_workers: int | str = "auto"
    prefetch_factor: int = 2
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
    caption_field: str = "caption"
    short_caption_field: str = "short_caption"
    id_field: str = "id"
    group_field: str = "group"
    synthdense: SynthDenseConfig = field(default_factory=SynthDenseConfig)
    # streamed formats (webdataset): shards of the train split, epoch length, shuffle buffer (data.stream)
    shards: list[str] = field(default_factory=list)  # brace patterns relative to data.root; empty: found by split
    epoch_samples: int = 0  # samples per epoch over all ranks (0: one pass over the shards)
    shuffle_buffer: int = 1000  # encoded samples each loader worker holds for shuffling (0: shard order only)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    # a second source of instruction-edit pairs joined to the training split (CLIP-IN stage 2: UltraEdit beside
    # long-caption pairs); empty: none. Its rows go through the same sampler, edit halves kept in one batch.
    edits_format: str = ""  # e.g. ultraedit
    edits_root: str = ""
    edits_split: str = "train"

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
        if self.prefetch_factor < 1:
            raise ConfigError(f"data.prefetch_factor: must be >= 1, got {self.prefetch_factor}")
        if self.epoch_samples < 0 or self.shuffle_buffer < 0:
            raise ConfigError("data.epoch_samples and data.shuffle_buffer must be >= 0")
        _check_min("data.max_image_pixels", self.max_image_pixels, 1)
        if self.preload and self.augment.enabled:
            raise ConfigError(
                "data.preload keeps one decoded copy of each image, but data.augment draws new crops every epoch; "
                "turn one of them off"
            )
        if not 0.0 < self.train_fraction <= 1.0 or self.train_count < 0:
            raise ConfigError(
                f"data.train_fraction must be in (0, 1] and data.train_count >= 0; got {self.train_fraction} and "
                f"{self.train_count}"
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
    weight: float = 1.0
    params: dict[str, Any] = field(default_factory=dict)  # keyword hyperparameters of the loss (gamma, ...)
    inputs: dict[str, str] = field(default_factory=dict)  # loss argument -> feature (text -> text_short)


@dataclass
class LossConfig:
    """The objective as named weighted terms (losses.build_objective), e.g. HN-CLIP eq. 3 or CLIP-IN eq. 8."""

    # Empty in the schema so that a recipe's terms replace the default instead of merging into it (OmegaConf merges
    # dict keys); `load_config` fills in DEFAULT_TERMS when no layer names any. A weight of 0 disables a term.
    terms: dict[str, TermConfig] = field(default_factory=dict)


DEFAULT_TERMS = {"contrastive": TermConfig("infonce")}


@dataclass
class GuardConfig:
    """A forgetting guard (train.guards; eval.guards does the arithmetic): one evaluation number, `suite/key/…`
    (e.g. `zeroshot/top1`, `coco/mean_R@1`), evaluated at every validation as its change from the initial model;
    with `max_drop`, a checkpoint that lost more points than that cannot become the best one."""

    metric: str = ""
    max_drop: float | None = None

    def __post_init__(self) -> None:
        if "/" not in self.metric:
            raise ConfigError(f"train.guards: metric {self.metric!r} must be suite/key, e.g. zeroshot/top1")
        if self.max_drop is not None and not self.max_drop >= 0:
            raise ConfigError(f"train.guards ({self.metric}): max_drop must be >= 0 points, got {self.max_drop}")


@dataclass
class TrainConfig:
    """The optimisation loop (train.Trainer)."""

    output_dir: str = "runs/default"  # the run directory: config, metrics, checkpoints, reports, figures
    seed: int = 0
    epochs: int = 1
    max_steps: int = 0  # > 0 stops after this many optimiser steps (and sets the schedule's length)
    batch_size: int = 128  # effective (global) batch: the size of the contrastive matrix under `exact`
    micro_batch_size: int = 16  # rows per forward pass (under per_micro_batch: rows per contrastive matrix)
    accumulation: str = "exact"  # exact (cached gradients) | per_micro_batch (each micro-batch its own loss)
    # per_micro_batch only: rows per forward pass, a multiple of micro_batch_size (0: micro_batch_size); the
    # micro-batches of one pass keep their own matrices, so only speed and memory change (faster when memory allows)
    encode_batch_size: int = 0
    lr: float = 1e-5
    module_lr: dict[str, float] = field(default_factory=dict)  # parameter-name prefix -> lr (longest prefix wins)
    weight_decay: float = 0.1  # not applied to gains, biases, logit scale/bias
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0  # the cosine schedule ends at lr * min_lr_ratio
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    device: str = "auto"  # auto (cuda:<LOCAL_RANK> when CUDA is available, else cpu) | cpu | cuda | cuda:N
    # minutes a collective may wait for the slowest rank before the run stops (torch's default is 10): rank 0
    # counts shards and writes checkpoints while the others wait, which takes minutes for large data or models
    dist_timeout_min: float = 60.0
    precision: str = "fp32"  # fp32 | bf16 (autocast on the towers; losses in fp32)
    tf32: bool = True  # TF32 matmuls on CUDA (fp32 accumulation); no effect on the CPU
    compile: bool = False  # torch.compile the two towers (the first steps pay for compilation)
    grad_checkpointing: bool = False  # recompute each tower layer in backward (activation memory of one layer)
    checkpoint_every: int = 0  # optimiser steps between checkpoints (0: at the end of each epoch only)
    keep_last: int = 2  # newest checkpoints kept (>= 1), besides the best
    eval_every: int = 1  # epochs between evaluations (0: never)
    best_metric: str = "mean_R@1"  # the evaluation number that picks the best checkpoint (higher is better)
    diagnostics_every: int = 0  # optimiser steps between gradient diagnostics (0: off)
    nan_patience: int = 5  # consecutive non-finite steps (skipped) before the run stops
    progress: bool = True
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "sharpclip"
    wandb_name: str = ""  # the W&B run name; default: the run directory's name
    # forgetting guards, evaluated with the validation (eval.* settings; the initial model once, before step 0)
    guards: list[GuardConfig] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_choice("train.accumulation", self.accumulation, ("exact", "per_micro_batch"))
        _check_choice("train.precision", self.precision, ("fp32", "bf16"))
        _check_device("train.device", self.device)
        self._check_ranges()
        if self.batch_size % self.micro_batch_size:
            raise ConfigError(
                f"train.batch_size ({self.batch_size}) must be a multiple of train.micro_batch_size "
                f"({self.micro_batch_size})"
            )
        self._check_encode_batch_size()

    def _check_encode_batch_size(self) -> None:
        size, micro = self.encode_batch_size, self.micro_batch_size
        if not size:
            return
        if self.accumulation != "per_micro_batch":
            raise ConfigError(
                "train.encode_batch_size applies to accumulation: per_micro_batch only (under exact, "
                "train.micro_batch_size is already the rows per forward pass); set it to 0"
            )
        if size % micro or self.batch_size % size:
            raise ConfigError(
                f"train.encode_batch_size ({size}) must be a multiple of train.micro_batch_size ({micro}) that "
                f"divides train.batch_size ({self.batch_size})"
            )

    def _check_ranges(self) -> None:
        for key in ("batch_size", "micro_batch_size", "keep_last", "nan_patience"):
            _check_min(f"train.{key}", getattr(self, key), 1)
        for key in ("epochs", "max_steps", "warmup_steps", "checkpoint_every", "eval_every", "diagnostics_every",
                    "grad_clip", "weight_decay", "encode_batch_size"):  # fmt: skip
            _check_min(f"train.{key}", getattr(self, key), 0)
        if not self.dist_timeout_min > 0:
            raise ConfigError(f"train.dist_timeout_min: must be > 0 minutes, got {self.dist_timeout_min}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"train.min_lr_ratio: must be in [0, 1], got {self.min_lr_ratio}")
        _check_lr("train.lr", self.lr)
        for prefix, lr in self.module_lr.items():
            _check_lr(f"train.module_lr.{prefix}", lr)
        if self.best_metric not in VALIDATION_METRICS:
            raise ConfigError(
                f"train.best_metric: {self.best_metric!r} is not a validation metric; use one of "
                f"{', '.join(VALIDATION_METRICS)}"
            )
        if self.guards and not self.eval_every:
            raise ConfigError("train.guards are evaluated with the validation: set train.eval_every >= 1")


@dataclass
class EvalConfig:
    """What to evaluate (eval.run_suite): benchmark names of eval.suite.DATASETS, each read from its own root."""

    suites: list[str] = field(default_factory=lambda: ["retrieval"])  # "retrieval" = data.format on data.eval_split
    data_root: str = ""  # a suite's root is roots[name], else data_root/<name> if it exists, else data_root
    roots: dict[str, str] = field(default_factory=dict)
    # per-suite data options merged into that suite's DataConfig, e.g. {dci: {list_file: DCI_test.json}} for GOAL's
    # DCI protocol, {docci: {docci_test: goal}}; keys are DataConfig fields other than format and root
    data_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    split: str = "test"
    recall_k: list[int] = field(default_factory=lambda: [1, 5, 10, 25, 50])
    chunk_size: int = 1024  # query rows scored at once: memory O(chunk_size × gallery)
    batch_size: int = 64  # images / captions per forward pass
    prompts: str = "photo"  # zero-shot prompt set: a name in eval.zeroshot.PROMPT_SETS or a file, one template a line
    zeroshot_k: list[int] = field(default_factory=lambda: [1, 5])
    hash_images: bool = False  # sha256 every image in the manifest (slow on large benchmarks)
    image_alpha: str = "drop"  # transparency: drop (PIL convert("RGB"), every reference evaluator) | white
    output_dir: str = ""  # reports go here; default <train.output_dir>/eval
    device: str = "auto"  # auto | cpu | cuda | cuda:N, as train.device
    jpeg_draft: bool = False  # JPEG draft decoding (see data.jpeg_draft); off: scores from the exact full decode
    progress: bool = True
    precision: str = "fp32"  # fp32 | bf16 (autocast on the towers; in-training validation uses train.precision)
    num_workers: int | str = "auto"  # image decoding processes: auto (as data.num_workers) or a number

    def __post_init__(self) -> None:
        if self.chunk_size < 1 or self.batch_size < 1:
            raise ConfigError(
                f"eval.chunk_size and eval.batch_size must be >= 1, got {self.chunk_size}, {self.batch_size}"
            )
        _check_device("eval.device", self.device)
        bad = [k for k in [*self.recall_k, *self.zeroshot_k] if k < 1]
        if bad:
            raise ConfigError(f"eval.recall_k / eval.zeroshot_k: values must be >= 1, got {bad}")
        _check_choice("eval.image_alpha", self.image_alpha, ALPHA_POLICIES)
        _check_choice("eval.precision", self.precision, ("fp32", "bf16"))
        self._check_data_options()

    def _check_data_options(self) -> None:
        allowed = {f.name for f in fields(DataConfig)} - {"format", "root"}
        for suite, options in self.data_options.items():
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


def _merge(base: Any, layer: Any, source: str) -> Any:
    try:
        return OmegaConf.merge(base, layer)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        if key in REMOVED_KEYS:
            raise ConfigError(f"{source}: key '{key}' is no longer a setting: {REMOVED_KEYS[key]}") from None
        reason = str(err).splitlines()[0]
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


def split_args(args: list[str] | tuple[str, ...]) -> tuple[list[str], list[str]]:
    """Command-line words -> (YAML files, key=value overrides): a word with '=' is an override."""
    overrides = [a for a in args if "=" in a]
    check_typed_overrides(overrides)
    return [a for a in args if "=" not in a], overrides


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
    paths = [] if path is None else [path] if isinstance(path, str | Path) else list(path)
    for file in map(Path, paths):
        if not file.is_file():
            raise ConfigError(f"{file}: config file not found")
        try:
            layer = OmegaConf.load(file)
        except Exception as err:  # yaml errors carry line numbers in their message
            raise ConfigError(_not_a_mapping(file) or f"{file}: not valid YAML: {err}") from None
        if not isinstance(layer, DictConfig):
            raise ConfigError(_not_a_mapping(file) or f"{file}: the top level must be a mapping")
        if saved:
            _drop_removed(layer, file)
        merged = _merge(merged, layer, str(file))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value (e.g. train.lr=1e-4)")
        merged = _merge(merged, parse_override(item), f"override {item!r}")
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ConfigError(str(err).splitlines()[0]) from None
    if not cfg.loss.terms:
        cfg.loss.terms = {
            name: TermConfig(t.loss, t.weight, dict(t.params), dict(t.inputs)) for name, t in DEFAULT_TERMS.items()
        }
    return cfg


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML, as written into every run directory."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
