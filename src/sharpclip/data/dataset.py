"""From samples to batches: the map-style dataset of rows, the collator, and the loader that reports bad samples.

A row is what one line of the contrastive matrix needs: one image and its caption(s). A `PairSample` is one row
(or one per caption with `caption_choice: all`); an `EditSample` is two rows, source then edited, in one unit so the
sampler keeps them together. Image decoding and preprocessing run in the DataLoader workers; tokenisation runs once
per batch in the collator (the fast tokenizer is batched).

Bad samples: reading the annotation files reports malformed records and empty captions (`BadSampleReport`); a
missing or corrupt image is found when the row is loaded, raises `BadSampleError` under `on_bad_sample: error`, and
under `skip` is dropped from its batch and listed in `Batch.skipped`. `SampleLoader` gathers both kinds into
`loader.report`, each bad sample once (by file and record) however many epochs skip it; `loader.times_skipped`
counts the skips. The summary is logged at the end of an epoch that met a bad sample not reported before.

A batch whose every sample is bad is not yielded at all: `loader.batches_skipped` counts it (the resume position
still moves past it). That rank then yields one batch fewer than its `len()`; on several ranks the trainer ends the
epoch on every rank when the first runs out (train.trainer), so no rank waits in a collective the others never join.
Skipped samples shrink their batch rather than borrowing rows from the next one (which would change every later
batch and break exact resume); instead, each epoch that shrank a batch logs the effective batch size
(`loader.epoch_sizes`: batches, smallest, mean, nominal), so a run never trains on smaller batches silently.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from sharpclip.data.augment import augmented
from sharpclip.data.images import ImageLoadError, describe, load_image
from sharpclip.data.schema import (
    EDIT_PAIRS,
    SHORT_CAPTIONS,
    BadSample,
    BadSampleError,
    BadSampleReport,
    Batch,
    EditSample,
    ImageSource,
    PairSample,
    Sample,
    log,
)
from sharpclip.data.subset import SubsetRecord
from sharpclip.data.transforms import MemoTokenizer, TextTokenizer
from sharpclip.data.workers import ignore_stop_signals

ImageTransform = Callable[[Image.Image], Tensor]
OWN_ROWS = {"rank_own": True}  # each rank reads its own rows: its bad samples are its own to report (cli.OtherRanks)


@dataclass(frozen=True)
class Row:
    """One line of the batch before loading: which sample, which image and caption."""

    sample: int  # index into the dataset's samples
    id: str
    image: ImageSource
    caption: str | None  # None: drawn per epoch from the sample's captions (caption_choice: random)
    short_caption: str | None
    unit: int  # rows with equal units share a batch
    edit_half: int = -1  # 0 = source, 1 = edited, -1 = not an edit


@dataclass
class Item:
    """A loaded row (in a worker)."""

    row: Row
    pixels: Tensor  # (3, H, W)
    caption: str


def _pair_rows(i: int, s: PairSample, choice: str, unit: int) -> list[Row]:
    if s.captions and choice == "all":
        return [Row(i, f"{s.id}#{k}", s.image, c, s.short_caption, unit) for k, c in enumerate(s.captions)]
    caption = None if s.captions and choice == "random" else s.caption
    return [Row(i, s.id, s.image, caption, s.short_caption, unit)]


def _edit_rows(i: int, s: EditSample, unit: int) -> list[Row]:
    return [
        Row(i, f"{s.id}/source", s.source_image, s.source_caption, None, unit, 0),
        Row(i, f"{s.id}/edited", s.edited_image, s.target_caption, None, unit, 1),
    ]


def build_rows(samples: Sequence[Sample], caption_choice: str = "random", group_batches: bool = True) -> list[Row]:
    """The rows of `samples`, with units: an edit's halves always; a pair group when `group_batches`;
    the captions of one image under `caption_choice: all` (so they stay together for per-image retrieval)."""
    units: dict[str, int] = {}
    rows: list[Row] = []
    for i, s in enumerate(samples):
        key = f"sample:{i}"
        if isinstance(s, PairSample) and s.group is not None and group_batches:
            key = f"group:{s.group}"
        unit = units.setdefault(key, len(units))
        rows += _edit_rows(i, s, unit) if isinstance(s, EditSample) else _pair_rows(i, s, caption_choice, unit)
    return rows


class SampleDataset(Dataset):
    """Rows of samples; `dataset[i]` is an `Item`, or a `BadSample` (SampleLoader raises it under `on_bad_sample:
    error`, in the training process rather than in a loader worker, whose traceback would wrap the message)."""

    def __init__(
        self,
        samples: Sequence[Sample],
        transform: ImageTransform,
        *,
        on_bad_sample: str = "error",
        caption_choice: str = "random",
        group_batches: bool = True,
        seed: int = 0,
        report: BadSampleReport | None = None,
        draft_size: int | None = None,
        max_image_pixels: int | None = None,
    ):
        self.samples = list(samples)
        self.max_image_pixels = max_image_pixels
        self.rows = build_rows(self.samples, caption_choice, group_batches)
        self.transform, self.on_bad_sample, self.seed = transform, on_bad_sample, seed
        self.draft_size = draft_size  # JPEG draft decoding to this side (data.images.request_draft); None: off
        # in shared memory, so persistent DataLoader workers see the epoch the main process sets
        self._epoch = torch.zeros(1, dtype=torch.long).share_memory_()
        self.report = report or BadSampleReport(on_bad_sample)  # bad records met while reading the files
        self.preloaded: list[Tensor | BadSample] | None = None  # every row's pixels (or why not), after `preload`
        self.subset: SubsetRecord | None = None  # set by data.build_dataset when the rows are a training subset

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def epoch(self) -> int:
        """The epoch whose caption draw `caption_of` makes."""
        return int(self._epoch[0])

    def set_epoch(self, epoch: int) -> None:
        """Select the per-epoch caption draw (caption_choice: random), in every worker too."""
        self._epoch.fill_(epoch)

    def caption_of(self, i: int) -> str:
        """Row i's caption; for a several-caption sample, one drawn by (seed, epoch, i)."""
        row = self.rows[i]
        if row.caption is not None:
            return row.caption
        captions = self.samples[row.sample].captions
        return captions[random.Random(hash((self.seed, self.epoch, i))).randrange(len(captions))]

    def _pixels(self, i: int) -> Tensor | BadSample:
        row = self.rows[i]
        try:
            image = load_image(row.image, self.draft_size, self.max_image_pixels)
            return augmented(self.transform, image, self.seed, self.epoch, i)
        except ImageLoadError as err:  # returned, not raised: a loader worker would wrap it in its traceback
            return BadSample(self.samples[row.sample].source or describe(row.image), row.id, err.reason)

    def preload(self) -> int:
        """Decode and preprocess every row's image now and keep it (data.preload); a bad image stays a `BadSample`,
        met as usual when its row is read. Returns the bytes kept."""
        self.preloaded = [self._pixels(i) for i in range(len(self.rows))]
        return sum(p.numel() * p.element_size() for p in self.preloaded if isinstance(p, Tensor))

    def __getitem__(self, i: int) -> Item | BadSample:
        pixels = self._pixels(i) if self.preloaded is None else self.preloaded[i]
        if isinstance(pixels, BadSample):
            return pixels
        return Item(self.rows[i], pixels, self.caption_of(i))


class Collator:
    """Items → `Batch`: stack pixels, tokenise captions (and short captions), index the complete edit pairs."""

    def __init__(self, tokenize: TextTokenizer | MemoTokenizer, with_short: bool = False):
        self.tokenize, self.with_short = tokenize, with_short

    def __call__(self, items: list[Item | BadSample]) -> Batch:
        """Tokenise and stack the good items into a `Batch`; bad ones go to `Batch.skipped`."""
        good = [it for it in items if isinstance(it, Item)]
        skipped = [it for it in items if isinstance(it, BadSample)]
        if not good:  # every sample bad (on_bad_sample: skip): an empty batch the loader counts and drops
            empty = torch.zeros(0, dtype=torch.long)
            return Batch(ids=[], pixel_values=torch.zeros(0), input_ids=empty, attention_mask=empty, groups=empty,
                         skipped=skipped)  # fmt: skip
        ids, mask = self.tokenize([it.caption for it in good])
        batch = Batch(
            ids=[it.row.id for it in good],
            pixel_values=torch.stack([it.pixels for it in good]),
            input_ids=ids,
            attention_mask=mask,
            groups=_groups(good),
            skipped=skipped,
        )
        if self.with_short:
            batch.short_input_ids, batch.short_attention_mask = self.tokenize(
                [it.row.short_caption or it.caption for it in good]
            )
        batch.edit_source, batch.edit_target = _edit_index(good)
        return batch


def _groups(items: list[Item]) -> Tensor:
    """(B,) small ints: equal for rows of one unit."""
    ids: dict[int, int] = {}
    return torch.tensor([ids.setdefault(it.row.unit, len(ids)) for it in items], dtype=torch.long)


def _edit_index(items: list[Item]) -> tuple[Tensor, Tensor]:
    """Row indices of the source and edited halves of each edit whose two halves are both in the batch."""
    halves: dict[int, dict[int, int]] = {}
    for pos, it in enumerate(items):
        if it.row.edit_half >= 0:
            halves.setdefault(it.row.sample, {})[it.row.edit_half] = pos
    pairs = [(h[0], h[1]) for h in halves.values() if len(h) == 2]
    src = torch.tensor([p[0] for p in pairs], dtype=torch.long)
    tgt = torch.tensor([p[1] for p in pairs], dtype=torch.long)
    return src, tgt


class SampleLoader(DataLoader):
    """A DataLoader of `Batch`es that gathers skipped samples into `report` and logs them at the end of each epoch.

    `state_dict()` gives the position in batches actually consumed (prefetched ones excluded), for resuming.
    """

    def __init__(self, dataset: SampleDataset, **kwargs):
        # its own generator, seeded per epoch (set_epoch): the DataLoader draws its workers' base seed from it, never
        # from the global torch RNG, which a resume restores and dropout draws from
        kwargs.setdefault("generator", torch.Generator())
        kwargs.setdefault("worker_init_fn", ignore_stop_signals)  # the rank decides on a stop (data.workers)
        super().__init__(dataset, **kwargs)
        self.report = BadSampleReport("skip")
        self.times_skipped: Counter[tuple[str, str]] = Counter()  # (where, record) -> skips over all epochs
        self._record(dataset.report.items)
        self.consumed = 0
        self._yielding: int | None = None  # the epoch whose batches the loader yields (set_epoch, __iter__)
        self.batches_skipped = 0  # batches whose every sample was bad, over all epochs
        self.epoch_sizes: dict[str, float] = {}  # the last epoch's effective batch sizes

    def _record(self, bads: Sequence[BadSample]) -> int:
        """Count each skip; add a bad sample to the report the first time it is met. Returns how many were new."""
        new = 0
        for bad in bads:
            key = (bad.where, bad.record)
            if key not in self.times_skipped:
                self.report.items.append(bad)
                new += 1
            self.times_skipped[key] += 1
        return new

    @property
    def provides(self) -> frozenset[str]:
        """What the batches carry beyond images and captions: SHORT_CAPTIONS, EDIT_PAIRS (data.schema)."""
        short = {SHORT_CAPTIONS} if self.collate_fn.with_short else set()
        edits = {EDIT_PAIRS} if any(isinstance(s, EditSample) for s in self.dataset.samples) else set()
        return frozenset(short | edits)

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the dataset (caption draw), of the batch sampler (order) and of the workers' seeds."""
        # per rank too: workers that augment must not draw the same crops on every rank
        seed, rank = (int(getattr(self.batch_sampler, name, 0)) for name in ("seed", "rank"))
        self.generator.manual_seed(((seed * 1_000_003 + epoch) * 65_537 + rank) % 2**64)  # torch takes 64 bits
        self.dataset.set_epoch(epoch)
        self._yielding = epoch
        if hasattr(self.batch_sampler, "set_epoch"):
            self.batch_sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, int]:
        """The batch sampler's state with the epoch and batches this loader has yielded. The epoch is the one the
        yielded batches belong to: with workers, the sampler runs ahead (prefetching) and may already have moved on
        to the next epoch, which a resume must not skip."""
        state = self.batch_sampler.state_dict()
        epoch = state["epoch"] if self._yielding is None else self._yielding
        return {**state, "epoch": epoch, "batches_done": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume mid-epoch from `state_dict()`'s output."""
        self.batch_sampler.load_state_dict(state)
        self.dataset.set_epoch(state["epoch"])
        self._yielding = state["epoch"]
        self.consumed = state["batches_done"]

    def __iter__(self) -> Iterator[Batch]:
        self._yielding = self.batch_sampler.epoch  # the epoch of the batches this iteration yields
        self.dataset.set_epoch(self.batch_sampler.epoch)
        self.consumed = self.batch_sampler.start
        new, sizes, nominal, empty, shrunk = 0, [], 0, 0, 0
        for batch in super().__iter__():
            if batch.skipped and self.dataset.on_bad_sample != "skip":  # raised here, in the training process
                raise BadSampleError(batch.skipped[0])
            self.consumed += 1  # counts an all-bad batch too, so a resume lands after it
            new += self._record(batch.skipped)
            nominal = max(nominal, len(batch) + len(batch.skipped))
            if not len(batch):
                self.batches_skipped += 1
                empty += 1
                log.warning("data: skipped a batch whose %d samples were all bad", len(batch.skipped), extra=OWN_ROWS)
                continue
            sizes.append(len(batch))
            shrunk += bool(batch.skipped)
            yield batch
        self.consumed, self._yielding = 0, self.batch_sampler.epoch  # the sampler has moved on to the next epoch
        self._log_sizes(sizes, nominal, empty, shrunk)
        if new:
            log.warning("data: %s", self.report.summary(), extra=OWN_ROWS)

    def _log_sizes(self, sizes: list[int], nominal: int, empty: int, shrunk: int) -> None:
        """Record this epoch's effective batch sizes; log them when skipped samples shrank (`shrunk` batches) or
        dropped (`empty` batches) any batch."""
        self.epoch_sizes = {"batches": len(sizes), "smallest": min(sizes, default=0),
                            "mean": sum(sizes) / max(1, len(sizes)), "nominal": nominal,
                            "skipped_batches": empty}  # fmt: skip
        if shrunk or empty:
            log.warning(
                "data: skipped samples shrank batches this epoch: effective batch size mean %.1f, smallest %d, of "
                "%d rows; %d batches dropped entirely", self.epoch_sizes["mean"], self.epoch_sizes["smallest"], nominal,
                empty, extra=OWN_ROWS,
            )  # fmt: skip
