"""Streamed training data (webdataset shards): each sample once per epoch over ranks × workers, resumable.

    loader = build_stream_loader(cfg, "train", tokenize, batch_size=B, image_transform=t, rank=r, world_size=w)

Sharding: the shards are dealt to the `world_size × num_workers` reader slots once, shard i to slot i mod slots,
so every sample belongs to exactly one slot and the slots' sample counts do not change between epochs. Each epoch a
slot reads its shards in an order drawn from (seed, epoch, slot), through a shuffle buffer of `data.shuffle_buffer`
encoded samples (webdataset's), decodes, and batches; a slot's last partial batch is dropped in training
(`drop_last`) and kept in evaluation.

Epoch length: every rank yields the same number of batches, or a collective would wait forever: the smallest of the
ranks' capacities (from the shards' sample counts: `sizes.json`, img2dataset's `*_stats.json`, else the tar
headers), capped by `data.epoch_samples / (batch × world size)` when that is set. What a larger rank holds beyond
the common length is not seen that epoch (logged; a warning past 10 % of the samples). Bad samples, or counts that
overstate a shard, leave a rank short of that length at run time: the trainer then ends the epoch on every rank
together (train.trainer).

Resume: every batch carries its reader slots' read positions (shard, samples read in it, samples taken from the
slot's shuffled stream). `state_dict()` holds the position of each slot's last consumed batch and the layout the
epoch is read in (ranks × workers slots, rows per slot batch); `resume_epoch` restarts each slot there, in the same
shard order, so the rest of the epoch is what the uninterrupted run would have seen, in its order (batches
prefetched but not consumed are read again). Without a shuffle buffer the reader seeks to the saved shard and
sample; through one (`data.shuffle_buffer` > 1, the default) the slot's stream is replayed from the epoch's start
with the same seeded draw and the samples taken before the position are read but not decoded, so the samples that
sat in the buffer are neither lost nor seen twice (the cost: reading that part of the epoch's tars again).

On another number of ranks or loader workers the rest of the saved epoch is read in the layout it was saved in
(`ReadLayout`): the saved run's global batch at each step is its ranks' batches in rank order, and each rank of the
resumed run reads the saved slots whose rows its share of that global batch covers, with the saved worker count,
keeping its rows (the other rows' images are decoded, to tell bad samples from good as the saved run did, but not
transformed). Every later step of that epoch trains the rows of the uninterrupted run; the next epoch is dealt to
this run's own slots. The price, for the rest of that one epoch only: a slot read by k ranks is read k times.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from PIL import Image
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from sharpclip.config import DataConfig
from sharpclip.data.augment import augmented
from sharpclip.data.dataset import Collator, Item, Row
from sharpclip.data.formats import webdataset as wds_format
from sharpclip.data.images import ImageLoadError, load_image
from sharpclip.data.schema import SHORT_CAPTIONS, BadSample, BadSampleError, BadSampleReport, Batch, PairSample, log
from sharpclip.data.transforms import TextTokenizer
from sharpclip.data.workers import ignore_stop_signals
from sharpclip.devices import resolve_num_workers

ImageTransform = Callable[[Image.Image], Tensor]


def slot_shards(n_shards: int, slot: int, slots: int) -> list[int]:
    """The shard indices of reader slot `slot` of `slots` (fixed over epochs)."""
    return list(range(slot, n_shards, slots))


def shard_order(shards: list[int], seed: int, epoch: int, slot: int, shuffle: bool) -> list[int]:
    """The order a slot reads its shards in this epoch (the same on every run with the same seed)."""
    if not shuffle:
        return list(shards)
    order = list(shards)
    random.Random(f"{seed}:{epoch}:{slot}").shuffle(order)
    return order


def _unit(sample: PairSample, serial: int) -> int:
    """Rows of one group share a unit (the batch's group id); others get their own (negative serials)."""
    if sample.group is None:
        return -1 - serial
    return int.from_bytes(hashlib.sha1(sample.group.encode()).digest()[:7], "big")


@dataclass
class StreamSettings:
    """What a stream needs besides its shards."""

    batch_size: int
    rank: int = 0
    world_size: int = 1
    seed: int = 0
    train: bool = True
    draft_size: int | None = None  # JPEG draft decoding to sides >= this (data.jpeg_draft), as the map-style loader


@dataclass(frozen=True)
class ReadLayout:
    """How an epoch's samples are dealt: `ranks` × `workers` reader slots, each batching `batch` samples."""

    ranks: int
    workers: int
    batch: int

    @property
    def slots(self) -> int:
        """Reader slots in all."""
        return self.ranks * self.workers

    def readers(self, worker: int, rows: range) -> list[tuple[int, range, bool]]:
        """(slot, the rows of its batches in `rows`, whether its batches' first row is in `rows`) for each slot of
        `worker` whose rows of the global batch (rank r's batch: rows r·batch … (r + 1)·batch − 1) meet `rows`."""
        found = []
        for rank in range(self.ranks):
            first = rank * self.batch
            mine = range(max(rows.start, first) - first, min(rows.stop, first + self.batch) - first)
            if len(mine):
                found.append((rank * self.workers + worker, mine, first in rows))
        return found


class ShardStream(IterableDataset):
    """Batches of one rank: its reader slots' shards, shuffled, decoded, collated in the loader workers."""

    def __init__(self, urls, cfg: DataConfig, transform, collate: Collator, settings: StreamSettings):
        self.urls, self.cfg, self.transform, self.collate, self.settings = list(urls), cfg, transform, collate, settings
        self.epoch = 0
        # slot -> (position in its shard order, samples read there, samples taken from the (shuffled) stream;
        # None in a position saved before the last was recorded)
        self.start: dict[int, tuple[int, int, int | None]] = {}
        self.rotation = 0  # DataLoader worker i reads worker (i + rotation) mod workers's slots (see StreamLoader)
        self.layout: ReadLayout | None = None  # a saved epoch read in its saved layout (see the module docstring)

    @property
    def shuffled(self) -> bool:
        """Whether samples pass webdataset's shuffle buffer (training, data.shuffle, data.shuffle_buffer > 1)."""
        return self.settings.train and self.cfg.shuffle and self.cfg.shuffle_buffer > 1

    def _raw(self, order: list[int], first: int, skip: int, report: BadSampleReport, cursor: list[int]):
        """Raw samples in shard order from shard `first`, sample `skip`; `cursor` follows the read position."""
        for pos in range(first, len(order)):
            url = self.urls[order[pos]]
            cursor[:] = [pos, skip if pos == first else 0]
            for raw in wds_format.iter_raw(url, report, skip=cursor[1]):
                cursor[1] += 1
                yield url, raw

    def _item(self, url: str, raw: dict, serial: int, report: BadSampleReport, transform: bool = True):
        """The sample as an `Item` (its image transformed only with `transform`), a `BadSample`, or None."""
        sample = wds_format.to_sample(raw, self.cfg, report, url)
        if sample is None:
            return report.items.pop() if report.items else None
        row = Row(serial, sample.id, sample.image, None, sample.short_caption, _unit(sample, serial))
        caption = wds_format.pick_caption(sample, self.cfg, self.settings.seed, self.epoch)
        try:
            image = load_image(sample.image, self.settings.draft_size, self.cfg.max_image_pixels)
            pixels = augmented(self.transform, image, self.settings.seed, self.epoch, sample.id) if transform else None
            return Item(replace(row, caption=caption), pixels, caption)
        except ImageLoadError as err:  # returned, not raised: StreamLoader applies the policy in the main process
            return BadSample(sample.source, sample.id, err.reason)

    def __iter__(self) -> Iterator[Batch | list[BadSample]]:
        """This rank's batches from one loader worker: its own slot's, or in a saved layout the rows of its share
        of each global batch, taken from the saved slots of this worker that hold them."""
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        worker = (worker + self.rotation) % workers
        s = self.settings
        layout = self.layout or ReadLayout(s.world_size, workers, s.batch_size)
        readers = layout.readers(worker, range(s.rank * s.batch_size, (s.rank + 1) * s.batch_size))
        streams = [self._slot_batches(slot, layout, mine) for slot, mine, _ in readers]
        for parts in zip(*streams, strict=False):  # up to the first stream's end
            rows, bads, positions = [], [], {}
            for (slot, mine, reports), (items, position) in zip(readers, parts, strict=True):
                good = [it for it in items if isinstance(it, Item)]
                rows += good if position is None else [good[i] for i in mine]
                bads += [it for it in items if isinstance(it, BadSample)] if reports else []
                positions[slot] = position
            if None in positions.values():  # a stream's end: an evaluation's last partial batch, bad samples left
                if rows and not s.train:
                    yield self._batch(rows + bads, worker, {})  # never resumed
                elif bads:
                    yield bads
                return
            yield self._batch(rows + bads, worker, positions)

    def _slot_batches(self, slot: int, layout: ReadLayout, mine: range):
        """(items, read position after them) for each batch of `layout.batch` good samples of reader slot `slot`,
        from its start position; the images of rows outside `mine` are checked but not transformed. Last: (the
        partial batch or bad samples left at the stream's end, None)."""
        s = self.settings
        shards = slot_shards(len(self.urls), slot, layout.slots)
        order = shard_order(shards, s.seed, self.epoch, slot, s.train and self.cfg.shuffle)
        report = BadSampleReport("skip")  # bad samples travel to StreamLoader, which raises them under `error`
        cursor = [0, 0]
        items, good = [], 0
        for serial, (url, sample) in self._positioned(order, self.start.get(slot, (0, 0, 0)), slot, report, cursor):
            item = self._item(url, sample, serial, report, transform=good in mine)
            if item is not None:
                items.append(item)
                good += isinstance(item, Item)
            if good == layout.batch:
                yield items, (cursor[0], cursor[1], serial + 1)
                items, good = [], 0
        yield items, None

    def _positioned(self, order: list[int], start: tuple, slot: int, report: BadSampleReport, cursor: list[int]):
        """(serial, (url, raw sample)) of a slot from its resume position `start`, through the shuffle buffer if any.

        Unshuffled, the reader seeks to the saved shard and sample. Through a shuffle buffer the samples after the
        position are those the buffer would have drawn next, so the epoch's stream is replayed from its start with
        the same seeded draw and its first `taken` samples are read but neither decoded nor batched: exact, at the
        cost of reading the epoch's shards up to the position again."""
        first, skip, taken = start
        replay = self.shuffled and taken is not None
        raw = self._raw(order, 0, 0, report, cursor) if replay else self._raw(order, first, skip, report, cursor)
        if self.shuffled:
            from webdataset.filters import _shuffle  # heavy: loads only when a streamed split is shuffled

            s = self.settings
            rng = random.Random(f"{s.seed}:{self.epoch}:{slot}:buffer")
            raw = _shuffle(raw, self.cfg.shuffle_buffer, self.cfg.shuffle_buffer, rng=rng)
        if replay:
            return itertools.islice(enumerate(raw), taken, None)
        return enumerate(raw, taken or 0)

    def _batch(self, items: list, worker: int, positions: dict[int, tuple[int, int, int]]) -> Batch:
        batch = self.collate(items)
        batch.stream_position = (worker, positions)
        return batch


class StreamLoader(DataLoader):
    """A DataLoader over a `ShardStream`: `len()` batches per epoch on every rank, resumable, bad samples gathered.

    The same interface as `SampleLoader` (set_epoch, state_dict, load_state_dict, report) for the trainer, and
    `resume_epoch` to continue from every saved rank's state on another number of ranks or workers.
    """

    def __init__(self, stream: ShardStream, length: int, counts: list[int], num_workers: int = 0,
                 pin_memory: bool = False):  # fmt: skip
        # no persistent workers: each epoch's shard order and start positions are set on the stream in this process
        super().__init__(
            stream, batch_size=None, num_workers=num_workers, pin_memory=pin_memory, worker_init_fn=ignore_stop_signals
        )  # the rank decides on a stop (data.workers)
        self.stream, self.length, self.counts, self.workers = stream, length, counts, max(num_workers, 1)
        self.native = (length, num_workers)  # this run's own epoch length and workers (see _read_in)
        self.report = BadSampleReport("skip")
        self.consumed = 0
        self.positions: dict[int, tuple[int, int, int | None]] = {}  # slot -> read position after its last batch
        self.next_worker = 0  # the worker whose batch comes next (the DataLoader takes them in turn)
        self._resumed_epoch: int | None = None

    def __len__(self) -> int:
        return self.length

    @property
    def provides(self) -> frozenset[str]:
        """What the batches carry beyond images and captions: short captions when the first sample has one."""
        return frozenset({SHORT_CAPTIONS} if self.stream.collate.with_short else ())

    @property
    def layout(self) -> ReadLayout:
        """The layout this epoch is read in: this run's own, or a resumed epoch's saved one."""
        s = self.stream.settings
        return self.stream.layout or ReadLayout(s.world_size, self.workers, s.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's shard order and buffer draw; a resumed epoch keeps its start positions."""
        if epoch != self._resumed_epoch:
            self._start_epoch()
        self.stream.epoch = epoch

    def _start_epoch(self) -> None:
        """A new epoch: from its start, in this run's own layout."""
        self.stream.start, self.consumed, self.positions, self.next_worker = {}, 0, {}, 0
        self._resumed_epoch = None
        self._read_in(None)

    def state_dict(self) -> dict:
        """Epoch, batches consumed in it, the layout it is read in, each of this rank's slots' read position after
        its last consumed batch, and the worker whose batch comes next."""
        layout = self.layout
        slots = {str(slot): list(p) for slot, p in self.positions.items()}
        return {"epoch": self.stream.epoch, "batches_done": self.consumed, "ranks": layout.ranks,
                "workers": layout.workers, "batch": layout.batch, "slots": slots,
                "next_worker": self.next_worker}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        """Continue the epoch from this rank's saved state (on as many ranks as it was saved on)."""
        self.resume_epoch([state], self.stream.settings.world_size, ranks=[self.stream.settings.rank])

    def resume_epoch(self, states: list[dict], saved_world: int, ranks: list[int] | None = None) -> None:
        """Continue the saved epoch from the saved ranks' states (`ranks`: whose they are; default every rank's, in
        rank order), read in the saved layout when it is not this run's own and the epoch had begun (see the module
        docstring); an epoch saved before its first batch is read in this run's own layout."""
        first = states[0]
        self.stream.epoch = self._resumed_epoch = int(first["epoch"])
        self.consumed = int(first.get("batches_done", 0))
        self.next_worker = int(first.get("next_worker", 0))
        s = self.stream.settings
        workers = int(first.get("workers", 1))
        saved = ReadLayout(int(first.get("ranks", saved_world)), workers,
                           int(first.get("batch", s.batch_size * s.world_size // saved_world)))  # fmt: skip
        self.positions = {}
        for rank, state in zip(ranks or range(len(states)), states, strict=True):
            self.positions.update(_slot_positions(state, rank, workers))
        self.stream.start = dict(self.positions)
        own = saved == ReadLayout(s.world_size, max(self.native[1], 1), s.batch_size)
        self._read_in(None if own or not self.consumed else saved)  # an epoch not begun: this run's own layout

    def _read_in(self, saved: ReadLayout | None) -> None:
        """Read this epoch in the `saved` layout (its length and worker count), or in this run's own (None)."""
        if saved == self.stream.layout:
            return
        self.stream.layout = saved
        length, num_workers = self.native
        if saved is not None:
            length = epoch_length(self.stream.cfg, self.counts, saved.batch, saved.ranks, saved.workers)
            num_workers = saved.workers if saved.workers > 1 else min(num_workers, 1)
            if self.stream.settings.rank == 0:
                log.warning("data: the rest of streamed epoch %d is read as it was saved (%d ranks x %d workers, "
                            "batches of %d), so each step trains the rows of the uninterrupted run; this run's own "
                            "layout starts with the next epoch", self.stream.epoch, saved.ranks, saved.workers,
                            saved.batch)  # fmt: skip
        self.length, self.num_workers, self.workers = length, num_workers, max(num_workers, 1)
        if num_workers and self.prefetch_factor is None:  # built without workers: the DataLoader's default
            self.prefetch_factor = 2

    def __iter__(self) -> Iterator[Batch]:
        if self.consumed >= self.length:
            return
        # the DataLoader asks its workers in turn from worker 0: rotate the slots so that worker 0 reads the one
        # whose batch came next in the interrupted run, and a resumed epoch keeps its batch order
        self.stream.rotation = self.next_worker
        for batch in super().__iter__():
            bads = batch if isinstance(batch, list) else batch.skipped
            if bads and self.stream.cfg.on_bad_sample != "skip":  # raised here, not in a worker's traceback
                raise BadSampleError(bads[0])
            if isinstance(batch, list):  # a worker's last bad samples, in no batch
                self._record(batch)
                continue
            self.consumed += 1
            worker, positions = batch.stream_position
            self.positions.update(positions)
            self.next_worker = (worker + 1) % self.workers
            self._record(batch.skipped)
            yield batch
            if self.consumed >= self.length:
                break
        self.stream.epoch += 1
        self._start_epoch()

    def _record(self, bads: list[BadSample]) -> None:
        known = {(b.where, b.record) for b in self.report.items}
        self.report.items += [b for b in bads if (b.where, b.record) not in known]


def _slot_positions(state: dict, rank: int, workers: int) -> dict[int, tuple[int, int, int | None]]:
    """slot -> read position in rank `rank`'s saved loader state (positions by worker before the slots were
    saved: slot = rank × workers + worker)."""
    if "slots" in state:
        found = state["slots"].items()
    else:
        found = ((rank * workers + int(w), p) for w, p in state.get("positions", {}).items())
    return {int(slot): (int(p[0]), int(p[1]), int(p[2]) if len(p) > 2 and p[2] is not None else None)
            for slot, p in found}  # fmt: skip


def rank_capacity(counts: list[int], batch_size: int, rank: int, world_size: int, workers: int) -> int:
    """Full batches rank `rank`'s slots can fill from their shards' counts (drop_last per slot)."""
    slots = world_size * workers
    total = 0
    for worker in range(workers):
        slot = rank * workers + worker
        total += sum(counts[i] for i in slot_shards(len(counts), slot, slots)) // batch_size
    return total


def epoch_length(cfg: DataConfig, counts: list[int], batch_size: int, world_size: int, workers: int) -> int:
    """Batches per rank per epoch: the least rank capacity, capped by data.epoch_samples (see the docstring)."""
    capacity = min(rank_capacity(counts, batch_size, r, world_size, workers) for r in range(world_size))
    if cfg.epoch_samples:
        wanted = cfg.epoch_samples // (batch_size * world_size)
        if wanted > capacity:
            raise ValueError(
                f"data.epoch_samples={cfg.epoch_samples} needs {wanted} batches of {batch_size} per rank, but the "
                f"shards fill only {capacity} on every rank ({sum(counts)} samples in {len(counts)} shards, "
                f"{world_size} ranks × {workers} workers): lower data.epoch_samples"
            )
        return wanted
    return capacity


def build_stream_loader(
    cfg: DataConfig,
    split: str,
    tokenize: TextTokenizer,
    *,
    batch_size: int,
    image_transform: ImageTransform,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    train: bool = True,
    pin_memory: bool = False,
    draft_size: int | None = None,
) -> StreamLoader:
    """A `StreamLoader` of `split`'s shards for this rank (see the module docstring); images decode as the map-style
    loader's: JPEG draft to `draft_size` (data.jpeg_draft), refused over `data.max_image_pixels`."""
    urls = wds_format.shard_urls(cfg, split)
    num_workers = resolve_num_workers(cfg.num_workers)
    workers = max(num_workers, 1)
    if len(urls) < world_size * workers:
        log.warning("data: %d shards for %d ranks × %d workers: some readers get none", len(urls), world_size, workers)
    checked = BadSampleReport(cfg.on_bad_sample)  # a shard that is not a complete tar: raised here under `error`
    counts = [wds_format.count_samples(u, checked) for u in urls]
    if checked.items and rank == 0:  # under `skip`: read as empty, counted once in the loader's report
        log.warning("data: %d of %d shards skipped (data.on_bad_sample=skip): %s", len(checked.items), len(urls),
                    "; ".join(f"{b.where}: {b.reason}" for b in checked.items[:3]))  # fmt: skip
    length = epoch_length(cfg, counts, batch_size, world_size, workers) if train else _eval_length(counts, batch_size)
    unused = sum(counts) - length * batch_size * world_size
    if train and unused > 0 and rank == 0:  # every rank computes the same numbers: rank 0 speaks for all
        level = logging.WARNING if unused > 0.1 * sum(counts) else logging.INFO
        log.log(level, "data: each epoch uses %d batches of %d per rank (%d of %d samples); %d samples (%.0f%%) are "
                "not seen that epoch (the ranks' shares are uneven, or the last partial batches are dropped)",
                length, batch_size, length * batch_size * world_size, sum(counts), unused,
                100 * unused / sum(counts))  # fmt: skip
    with_short = _has_short(urls[0], cfg)
    settings = StreamSettings(batch_size, rank, world_size, seed, train, draft_size)
    stream = ShardStream(urls, cfg, image_transform, Collator(tokenize, with_short), settings)
    loader = StreamLoader(stream, length, counts, num_workers, pin_memory)
    loader._record(checked.items)  # counted from the start: the epoch may end before the stream reaches them
    return loader


def _eval_length(counts: list[int], batch_size: int) -> int:
    return -(-sum(counts) // batch_size) + len(counts)  # an upper bound: partial batches per slot are kept


def _has_short(url: str, cfg: DataConfig) -> bool:
    """Whether the first sample of the first shard has a short caption (then batches carry short tokens); its first
    samples' caption key is checked here, before training (`check_fields`)."""
    report = BadSampleReport("skip")
    for raw in wds_format.check_fields(wds_format.iter_raw(url, report), cfg, url):  # a caption key mismatch: here
        sample = wds_format.to_sample(raw, cfg, report, url)
        return sample is not None and sample.short_caption is not None
    return False
