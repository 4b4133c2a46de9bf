"""Typed configuration: one dataclass per part, filled from YAML plus dotted command-line overrides.

OmegaConf structured configs do the merging and type checking; this module only turns their errors into messages
that name the source (file or override) and the full key, and validates choices that a type cannot express.
`run_*` entry points are the only places that see the whole `Config`; every builder takes its own sub-config.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A configuration value is unknown, mistyped or out of range; the message names the key and its source."""


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(choices)}")


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


@dataclass
class SynthDenseConfig:
    """Sizes of the generated SynthDense corpus (data.synthetic); the corpus is a pure function of these values."""

    seed: int = 0
    resolution: int = 64  # rendered image side in pixels
    min_objects: int = 3
    max_objects: int = 5
    train_families: int = 9000  # the prototype's v1: independent scenes (train_family_size 1) train as well
    train_family_size: int = 1
    test_families: int = 150
    test_family_size: int = 6  # a base scene and 5 near-duplicates, each 1 or 2 attributes of one object apart
    test_variants: str = "any"  # what the near-duplicates change: any attribute | details (size, texture only)
    pretrain_scenes: int = 20000  # independent scenes with coarse captions (stage A)
    edits: int = 2000  # instruction-edit pairs
    mmvp_pairs: int = 15  # image pairs per visual pattern
    workers: int = 2  # rendering processes

    def __post_init__(self) -> None:
        _check_choice("data.synthdense.test_variants", self.test_variants, ("any", "details"))


@dataclass
class DataConfig:
    """Where the samples come from, how they are preprocessed and batched (data.build_loader)."""

    format: str = "synthdense"  # see data.formats.FORMATS: synthdense | generic | docci | dci | long_dci | ...
    root: str = ""  # the release folder, laid out as the README's Data section shows
    train_split: str = "train"
    eval_split: str = "test"
    num_workers: int = 0
    on_bad_sample: str = "error"  # error | skip (skipped samples are counted and reported at the end of each epoch)
    # preprocessing (CLIP's: shorter side resized bicubic, centre crop, normalise; tokens truncated, eos kept last)
    image_size: int = 224
    image_mean: list[float] = field(default_factory=lambda: [0.48145466, 0.4578275, 0.40821073])
    image_std: list[float] = field(default_factory=lambda: [0.26862954, 0.26130258, 0.27577711])
    context_length: int = 77  # 248 for Long-CLIP-stretched text towers
    # batching (the batch size itself is the trainer's: train.batch_size / world size)
    shuffle: bool = True  # for the train split; evaluation splits are never shuffled
    group_batches: bool = True  # rows with the same group (an edit's halves, a family) share a batch
    distinct_captions: bool = False  # keep exact-duplicate captions out of one batch
    # format options
    caption_choice: str = "random"  # several captions per image (COCO/Flickr): first | random (per epoch) | all
    docci_test: str = "goal"  # goal: 5,100 = qual_test + test (GOAL) | test: the 5,000 `test` images (FineLIP)
    dci_caption: str = "extra"  # extra: extra_caption only (GOAL, Long-DCI) | short | short_extra
    list_file: str = ""  # a GOAL-style [{filename, caption}] JSON; images found by file name in the format's folder
    annotation_file: str = ""  # overrides the format's default annotation file name (ShareGPT4V, Karpathy)
    sharegpt4v_test_size: int = 1000  # Long-CLIP: the first 1,000 records are the test set
    image_field: str = "image"  # generic JSONL/CSV column names
    caption_field: str = "caption"
    short_caption_field: str = "short_caption"
    id_field: str = "id"
    group_field: str = "group"
    synthdense: SynthDenseConfig = field(default_factory=SynthDenseConfig)
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
        if self.context_length < 3:
            raise ConfigError(f"data.context_length: {self.context_length} leaves no room between bos and eos")


@dataclass
class TermConfig:
    """One weighted term of the objective: a registered loss, its hyperparameters and where its inputs come from."""

    loss: str = "infonce"  # a name in losses.registry
    weight: float = 1.0
    params: dict[str, Any] = field(default_factory=dict)  # keyword hyperparameters of the loss (gamma, ...)
    inputs: dict[str, str] = field(default_factory=dict)  # loss argument -> feature key (text -> text_long)


@dataclass
class LossConfig:
    """The objective as named weighted terms (losses.build_objective), e.g. HN-CLIP eq. 3 or CLIP-IN eq. 8."""

    # Empty in the schema so that a recipe's terms replace the default instead of merging into it (OmegaConf merges
    # dict keys); `load_config` fills in DEFAULT_TERMS when no layer names any. A weight of 0 disables a term.
    terms: dict[str, TermConfig] = field(default_factory=dict)


DEFAULT_TERMS = {"contrastive": TermConfig("infonce")}


@dataclass
class TrainConfig:
    """The optimisation loop (train.Trainer)."""

    output_dir: str = "runs/default"  # the run directory: config, metrics, checkpoints, reports, figures
    seed: int = 0
    epochs: int = 1
    max_steps: int = 0  # > 0 stops after this many optimiser steps (and sets the schedule's length)
    batch_size: int = 128  # effective (global) batch: the size of the contrastive matrix under `exact`
    micro_batch_size: int = 16  # rows per forward pass
    accumulation: str = "exact"  # exact (cached gradients) | per_micro_batch (each micro-batch its own loss)
    lr: float = 1e-5
    module_lr: dict[str, float] = field(default_factory=dict)  # parameter-name prefix -> lr (longest prefix wins)
    weight_decay: float = 0.1  # not applied to gains, biases, logit scale/bias
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0  # the cosine schedule ends at lr * min_lr_ratio
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    precision: str = "fp32"  # fp32 | bf16 (autocast on the towers; losses in fp32)
    grad_checkpointing: bool = False
    checkpoint_every: int = 0  # optimiser steps between checkpoints (0: at the end of each epoch only)
    keep_last: int = 2  # checkpoints kept besides the best
    eval_every: int = 1  # epochs between evaluations (0: never)
    best_metric: str = "mean_R@1"  # the evaluation number that picks the best checkpoint (higher is better)
    diagnostics_every: int = 0  # optimiser steps between gradient diagnostics (0: off)
    diagnostics_gamma: float = 0.5  # γ of the HN-CLIP loss the diagnostics compare against
    nan_patience: int = 5  # consecutive non-finite steps (skipped) before the run stops
    progress: bool = True
    tensorboard: bool = False
    wandb: bool = False

    def __post_init__(self) -> None:
        _check_choice("train.accumulation", self.accumulation, ("exact", "per_micro_batch"))
        _check_choice("train.precision", self.precision, ("fp32", "bf16"))
        if self.batch_size % self.micro_batch_size:
            raise ConfigError(
                f"train.batch_size ({self.batch_size}) must be a multiple of train.micro_batch_size "
                f"({self.micro_batch_size})"
            )


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
    output_dir: str = ""  # reports go here; default <train.output_dir>/eval
    device: str = "cpu"
    progress: bool = True

    def __post_init__(self) -> None:
        if self.chunk_size < 1 or self.batch_size < 1:
            raise ConfigError(
                f"eval.chunk_size and eval.batch_size must be >= 1, got {self.chunk_size}, {self.batch_size}"
            )
        bad = [k for k in [*self.recall_k, *self.zeroshot_k] if k < 1]
        if bad:
            raise ConfigError(f"eval.recall_k / eval.zeroshot_k: values must be >= 1, got {bad}")
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


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


def _merge(base: Any, layer: Any, source: str) -> Any:
    try:
        return OmegaConf.merge(base, layer)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        reason = str(err).splitlines()[0]
        raise ConfigError(f"{source}: key '{key}': {reason}") from None


def split_args(args: list[str] | tuple[str, ...]) -> tuple[list[str], list[str]]:
    """Command-line words -> (YAML files, key=value overrides): a word with '=' is an override."""
    return [a for a in args if "=" not in a], [a for a in args if "=" in a]


def load_config(
    path: str | Path | list[str | Path] | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    """Build a validated `Config`: defaults, then each YAML file of `path` in order, then `key=value` overrides.

    Several files layer like overrides (a recipe, then e.g. configs/tiny_synthdense.yaml or a file of local paths).
    An unknown key or a value of the wrong type raises `ConfigError` naming the file or override and the key.
    """
    merged = OmegaConf.structured(Config)
    paths = [] if path is None else [path] if isinstance(path, str | Path) else list(path)
    for file in map(Path, paths):
        if not file.is_file():
            raise ConfigError(f"{file}: config file not found")
        try:
            layer = OmegaConf.load(file)
        except Exception as err:  # yaml errors carry line numbers in their message
            raise ConfigError(f"{file}: not valid YAML: {err}") from None
        merged = _merge(merged, layer, str(file))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value (e.g. train.lr=1e-4)")
        merged = _merge(merged, OmegaConf.from_dotlist([item]), f"override {item!r}")
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
