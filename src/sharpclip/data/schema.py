"""What flows out of the data layer: samples as read from disk, bad-sample records, and the collated `Batch`.

Two kinds of sample cover both papers:

- `PairSample` — one image with its caption (HN-CLIP: DOCCI, DCI, Urban-1K, ShareGPT4V, ...), optionally a short
  caption (CLIP-IN's short/long pair), several captions (COCO/Flickr, 5 per image) and a group key (a SynthDense
  family, the two halves of an edit) that the batch sampler keeps together.
- `EditSample` — an instruction-edit pair (CLIP-IN, UltraEdit): source image + caption, edited image + caption.

In a batch an edit becomes two rows (source, edited) with the same group; `Batch.edit_source[k]` and
`Batch.edit_target[k]` are the row indices of edit k, so `edit_negatives` reads `image[edit_source]` etc. without
encoding anything twice. `Loader` is what the trainer needs of whatever yields the batches.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from PIL import Image
from torch import Tensor

from sharpclip.data.files import check_regular

log = logging.getLogger("sharpclip.data")

# what a loader's batches may carry beyond images and captions (a loader's `provides`; train.features' needs)
SHORT_CAPTIONS = "short_captions"  # Batch.short_input_ids: a short caption per row
EDIT_PAIRS = "edit_pairs"  # Batch.edit_source / edit_target: instruction-edit pairs


@dataclass(frozen=True)
class ParquetCell:
    """An image in a parquet file (HF Image struct `{bytes, path}`), read lazily: file, row group, row, column."""

    file: str
    row_group: int
    row: int  # index within the row group
    column: str


@dataclass(frozen=True)
class ArrowCell:
    """An image in an Arrow file that `datasets.save_to_disk` wrote (memory-mapped, read lazily): file, row, column."""

    file: str
    row: int
    column: str


ImageSource = str | Path | bytes | Image.Image | ParquetCell | ArrowCell  # a path, bytes, a decoded image, a cell


@dataclass
class PairSample:
    """One image and its caption(s). `caption` is the one used for training; `captions` lists all when several."""

    id: str
    image: ImageSource
    caption: str
    short_caption: str | None = None
    captions: list[str] | None = None  # every reference caption (COCO/Flickr: 5); `caption` is one of them
    group: str | None = None  # samples with the same group go into the same batch
    source: str = ""  # where it was read from, "file:line" or "file[record]", for error messages


@dataclass
class EditSample:
    """An instruction-edit pair: (source image, source caption) and (edited image, target caption)."""

    id: str
    source_image: ImageSource
    edited_image: ImageSource
    source_caption: str
    target_caption: str
    instruction: str = ""
    source: str = ""


Sample = PairSample | EditSample


@dataclass(frozen=True)
class BadSample:
    """A sample that could not be used: where it is, which record, and why."""

    where: str  # file (and line or record index)
    record: str  # sample id, or "?" when the record is too malformed to have one
    reason: str  # missing file | unreadable image | empty caption | malformed record

    def __str__(self) -> str:
        return f"{self.where}: record {self.record}: {self.reason}"


class BadSampleError(ValueError):
    """A bad sample under `on_bad_sample: error`; the message names the file, the record and what to do."""

    def __init__(self, bad: BadSample, setting: str = "data.on_bad_sample"):
        self.bad = bad
        super().__init__(f"{bad}. Fix or remove the record, or set {setting}=skip to skip and count it.")


@dataclass
class BadSampleReport:
    """What a reader met: bad samples under a policy (`error` raises at the first, `skip` records and goes on), and
    the annotation files it opened, in first-read order (`files`: what the eval manifest hashes)."""

    policy: str = "error"  # error | skip
    items: list[BadSample] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    setting: str = "data.on_bad_sample"  # the key that sets `policy`, named in the error (eval: per suite)
    _seen: set[Path] = field(default_factory=set, init=False, repr=False, compare=False)

    def read_file(self, path: Path) -> Path:
        """Record that annotation file `path` is being read (once, however often it is opened); returns `path`.
        A path that exists but is not a regular file (a FIFO, a directory) raises NotRegularFileError: never read."""
        if path not in self._seen:
            if os.path.lexists(path):
                check_regular(path)
            self._seen.add(path)
            self.files.append(path)
        return path

    def add(self, bad: BadSample) -> None:
        """Raise `BadSampleError` under `error`; record `bad` under `skip`."""
        if self.policy != "skip":
            raise BadSampleError(bad, self.setting)
        self.items.append(bad)

    def extend(self, bads: list[BadSample]) -> None:
        """`add` each of `bads`."""
        for bad in bads:
            self.add(bad)

    def summary(self) -> str:
        """Counts per reason and the first ten bad samples, for the log."""
        if not self.items:
            return "no bad samples"
        counts = Counter(b.reason.split(":")[0] for b in self.items)
        kinds = ", ".join(f"{n} {reason}" for reason, n in sorted(counts.items()))
        shown = "\n".join(f"  {b}" for b in self.items[:10])
        more = f"\n  ... and {len(self.items) - 10} more" if len(self.items) > 10 else ""
        return f"skipped {len(self.items)} bad samples ({kinds}):\n{shown}{more}"


@dataclass
class Batch:
    """A collated, tokenised batch of B rows (a pair sample is one row, an edit sample two).

    pixel_values: (B, 3, H, W) float32, normalised with the model's mean/std
    input_ids, attention_mask: (B, L) long; L = the context length; eos is the last non-pad token of every row
    short_input_ids, short_attention_mask: (B, L) or None; rows without a short caption repeat the long one
    groups: (B,) long; equal values = the same group (family, edit pair), unique values otherwise
    edit_source, edit_target: (E,) long row indices of the source and edited halves of each complete edit
    ids: B sample ids ("<edit id>/source", "<edit id>/edited" for edit rows); instructions: E edit instructions
    skipped: bad samples dropped from this batch under `on_bad_sample: skip`
    stream_position: (loader worker, {reader slot: (shard position, samples read in that shard, samples taken from
        the slot's shuffled stream)}) of a streamed batch (data.stream)
    """

    ids: list[str]
    pixel_values: Tensor
    input_ids: Tensor
    attention_mask: Tensor
    groups: Tensor
    short_input_ids: Tensor | None = None
    short_attention_mask: Tensor | None = None
    edit_source: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    edit_target: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    instructions: list[str] = field(default_factory=list)
    skipped: list[BadSample] = field(default_factory=list)
    stream_position: tuple[int, dict[int, tuple[int, int, int]]] | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def to(self, device: torch.device | str) -> Batch:
        """A copy with every tensor on `device` (non-blocking where the source is pinned)."""
        moved = {k: v.to(device, non_blocking=True) if isinstance(v, Tensor) else v for k, v in vars(self).items()}
        return Batch(**moved)

    def pin_memory(self) -> Batch:
        """Called by DataLoader(pin_memory=True) on custom batch types."""
        pinned = {k: v.pin_memory() if isinstance(v, Tensor) else v for k, v in vars(self).items()}
        return Batch(**pinned)


@runtime_checkable
class Loader(Protocol):
    """What train.Trainer needs of its batches' source (data.SampleLoader, data.StreamLoader, data.CaptionLoader):
    this rank's batches of one epoch at a time, resumable exactly from a saved position. A loader may also carry a
    `report` (BadSampleReport) of the samples it skipped; the trainer logs it at the end."""

    def __len__(self) -> int:
        """Batches per epoch on this rank."""

    def __iter__(self) -> Iterator[Batch]:
        """The current epoch's batches from the current position (its start, or where `load_state_dict` put it)."""

    def set_epoch(self, epoch: int) -> None:
        """Select `epoch`'s order (a new epoch starts at its first batch)."""

    def state_dict(self) -> dict[str, Any]:
        """The position to resume from: epoch and batches already yielded (JSON-serialisable)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position `state_dict` returned."""
