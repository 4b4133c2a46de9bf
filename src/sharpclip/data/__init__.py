"""The data layer: read a release (or SynthDense), preprocess like CLIP, and batch group-aware.

    samples = read_samples(cfg.data, "test")                     # list of PairSample / EditSample, release order
    loader = build_loader(cfg.data, "train", model_transforms(model), batch_size=128, rank=r, world_size=w, seed=s)
    for batch in loader: ...                                     # Batch: pixels, tokens, groups, edit indices

The preprocessing is the model's (models.preprocessing.model_transforms gives a `Preprocessing`: image transform
and tokenizer at the model's size, mean/std and context); this layer applies whatever it is given.
docs/data.md shows each format's folder layout; `sharpclip validate-data` checks a folder before a run.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

from sharpclip.config import DataConfig
from sharpclip.data.augment import AugmentedTransform
from sharpclip.data.dataset import Collator, ImageTransform, SampleDataset, SampleLoader
from sharpclip.data.formats import FORMATS
from sharpclip.data.sampling import GroupBatchSampler
from sharpclip.data.schema import (
    BadSample,
    BadSampleError,
    BadSampleReport,
    Batch,
    EditSample,
    PairSample,
    Sample,
    log,
)
from sharpclip.data.stream import StreamLoader, build_stream_loader
from sharpclip.data.subset import select_subset
from sharpclip.data.transforms import MemoTokenizer, Preprocessing
from sharpclip.devices import resolve_num_workers

__all__ = [
    "BadSample",
    "BadSampleError",
    "BadSampleReport",
    "Batch",
    "EditSample",
    "PairSample",
    "Sample",
    "build_dataset",
    "build_loader",
    "data_root",
    "read_samples",
]


def data_root(cfg: DataConfig) -> Path:
    """`cfg.root`; for SynthDense without one, a cache folder named by the corpus config ($SHARPCLIP_CACHE)."""
    if cfg.root:
        return Path(cfg.root).expanduser()
    if cfg.format != "synthdense":
        raise ValueError(f"data.root is empty; set it to the {cfg.format} release folder (docs/data.md)")
    key = hashlib.sha1(json.dumps(asdict(cfg.synthdense), sort_keys=True).encode()).hexdigest()[:12]
    return Path(os.environ.get("SHARPCLIP_CACHE", "~/.cache/sharpclip")).expanduser() / f"synthdense-{key}"


def read_samples(cfg: DataConfig, split: str, report: BadSampleReport | None = None) -> list[Sample]:
    """The samples of `split` in release order; bad records go to `report` (raising under on_bad_sample: error).

    `split` may join several with "+" (e.g. SynthDense's "train+edits": pairs and edit pairs in one epoch, as
    CLIP-IN's stage 2 trains on both); their samples are concatenated in that order.
    """
    if cfg.format not in FORMATS:
        raise ValueError(f"data.format: unknown format {cfg.format!r}; known: {', '.join(FORMATS)}")
    report = report if report is not None else BadSampleReport(cfg.on_bad_sample)
    return [s for part in split.split("+") for s in FORMATS[cfg.format](data_root(cfg), part, cfg, report)]


def read_edit_samples(cfg: DataConfig, report: BadSampleReport | None = None) -> list[Sample]:
    """The edit pairs of `data.edits_format` at `data.edits_root` (split `data.edits_split`)."""
    if not cfg.edits_root:
        raise ValueError(f"data.edits_format is {cfg.edits_format!r} but data.edits_root is empty: set the folder")
    source = replace(cfg, format=cfg.edits_format, root=cfg.edits_root, edits_format="")
    return read_samples(source, cfg.edits_split, report)


def build_dataset(
    cfg: DataConfig, split: str, transform: ImageTransform, seed: int = 0, draft_size: int | None = None
) -> SampleDataset:
    """Rows of `split`, decoded and preprocessed on access (`transform`: PIL → (3, H, W), the model's).

    draft_size: JPEGs decode at the decoder's smallest DCT scale whose sides stay >= this (see data.images); None: in
    full.
    """
    report = BadSampleReport(cfg.on_bad_sample)
    samples = read_samples(cfg, split, report)
    subset = None
    if split == cfg.train_split and (cfg.train_count or cfg.train_fraction < 1.0):  # before any sampler sees a row
        samples, subset = select_subset(samples, cfg.train_fraction, cfg.train_count, cfg.subset_seed)
        log.info("data: training on %d of the %d samples of %r (data.subset, ids sha256 %s)", subset.selected,
                 subset.total, split, subset.ids_sha256[:12])  # fmt: skip
    if cfg.edits_format and split == cfg.train_split:
        samples += read_edit_samples(cfg, report)
    if not samples:
        raise ValueError(f"{data_root(cfg)}: split {split!r} of format {cfg.format!r} has no usable samples")
    dataset = SampleDataset(
        samples,
        transform,
        on_bad_sample=cfg.on_bad_sample,
        caption_choice=cfg.caption_choice,
        group_batches=cfg.group_batches,
        seed=seed,
        report=report,
        draft_size=draft_size,
        max_image_pixels=cfg.max_image_pixels,
    )
    dataset.subset = subset  # what the run directory records (train.run: train_subset.json)
    return dataset


def loader_options(cfg: DataConfig, pin_memory: bool = False) -> dict:
    """DataLoader keyword arguments for workers: `num_workers` resolved (auto: this rank's cores, no fixed cap), workers
    kept across epochs and `prefetch_factor` batches ahead each, pinned host memory for non-blocking copies to CUDA."""
    workers = resolve_num_workers(cfg.num_workers)
    options: dict = {"num_workers": workers, "pin_memory": pin_memory}
    if workers > 0:
        options.update(persistent_workers=True, prefetch_factor=cfg.prefetch_factor)
    return options


def build_loader(
    cfg: DataConfig,
    split: str,
    preprocessing: Preprocessing,
    *,
    batch_size: int = 64,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    train: bool | None = None,
    pin_memory: bool = False,
    whole_units: bool = True,
) -> SampleLoader | StreamLoader:
    """A DataLoader of `Batch`es for `split`; this rank's share of every epoch, deterministic per seed and epoch.

    preprocessing: the model's image transform and tokenizer (models.preprocessing.model_transforms; its context
    length, padding and image size are the model's). train: shuffle and drop the last partial batch (default: split ==
    cfg.train_split); evaluation keeps release order and every row. batch_size: rows per batch on this rank (an edit
    pair is two rows); indexed data is packed into global batches of batch_size × world_size rows, the same at every
    world size, and dealt to the ranks (data.sampling): whole units (`whole_units`, exact accumulation) or rows
    r·batch_size … (r + 1)·batch_size − 1 (per_micro_batch). `data.augment` (random resized crop, colour jitter)
    applies to training only. webdataset shards stream (data.stream: `StreamLoader`). pin_memory: batches in
    page-locked memory (training on CUDA), so the copy to the GPU overlaps compute. JPEG draft decoding
    (`data.jpeg_draft`) applies to training loaders, at the image transform's `size`.
    """
    train = split == cfg.train_split if train is None else train
    transform, tokenize = preprocessing
    draft = getattr(transform, "size", None) if train and cfg.jpeg_draft else None
    if train and cfg.augment.enabled:  # open_clip's --aug-cfg; never for evaluation
        transform = AugmentedTransform(transform, cfg.augment)
    if cfg.format == "webdataset":  # streamed, not indexed: data.stream
        return build_stream_loader(
            cfg, split, tokenize, batch_size=batch_size, image_transform=transform, rank=rank,
            world_size=world_size, seed=seed, train=train, pin_memory=pin_memory, draft_size=draft,
        )  # fmt: skip
    dataset = build_dataset(cfg, split, transform, seed, draft)
    workers = cfg.num_workers
    if train and cfg.preload:
        start = time.perf_counter()
        kept = dataset.preload()
        log.info("data: preloaded the %d images of %r (%.0f MB) in %.1f s", len(dataset), split, kept / 2**20,
                 time.perf_counter() - start)  # fmt: skip
        workers = 0 if workers == "auto" else workers  # nothing left to decode
        tokenize = MemoTokenizer(tokenize)  # and each caption tokenised once
    sampler = GroupBatchSampler(
        [r.unit for r in dataset.rows],
        batch_size,
        captions=[dataset.caption_of(i) for i in range(len(dataset))],
        distinct_captions=cfg.distinct_captions,
        shuffle=train and cfg.shuffle,
        drop_last=train,
        seed=seed,
        rank=rank,
        world_size=world_size,
        whole_units=whole_units,
    )
    with_short = any(getattr(s, "short_caption", None) for s in dataset.samples)
    return SampleLoader(
        dataset, batch_sampler=sampler, collate_fn=Collator(tokenize, with_short),
        **loader_options(replace(cfg, num_workers=workers), pin_memory),
    )  # fmt: skip
