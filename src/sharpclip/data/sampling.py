"""Group-aware batch sampling: which rows share a contrastive batch, identically on every rank, per seed and epoch.

Rows come in units: the two halves of an edit pair (CLIP-IN's hard negatives need both in the batch), the members of a
group (a SynthDense family) when grouping is on, or single rows. Each epoch the units are shuffled with a generator
seeded by (seed, epoch), then spread over the epoch's batches largest first, each into the emptiest batch where it
fits (so groups spread evenly and single rows fill the gaps); the batch order is shuffled too.
Without shuffling (evaluation) units are packed in order. With `distinct_captions`, a unit
does not go into a batch that already holds one of its captions (an exact duplicate would be a false negative of
InfoNCE and a zero-margin pair of HN-CLIP). Batch k goes to rank k mod world_size, so ranks see disjoint rows and the
same number of batches; every rank computes the same packing, so no communication is needed.

The guarantee: every batch holds at most `batch_size` rows, and whole units only. Units need not add up to
`batch_size` (families of 6 never fill a batch of 16), so a batch counts as complete when it holds more than
`batch_size - largest unit` rows: no unit of the largest size could still join it. Under `drop_last` only
batches short of that are dropped (the leftover tail of the packing), plus the fewest rows that leave every rank the
same number of batches; the epoch's dropped rows are logged on the `sharpclip.data` logger. Batch sizes therefore
vary by less than the largest unit, which the trainer and the losses accept (the contrastive matrix is whatever rows
the ranks gather). Without `drop_last` every row is used exactly once.

The sampler is resumable: `state_dict()` records (epoch, batches already yielded on this rank).
"""

from __future__ import annotations

import heapq
import logging
import numbers
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

log = logging.getLogger("sharpclip.data")

MAX_OPEN = 16  # batches kept open while packing: enough to place groups, few enough to keep the shuffle's order


@dataclass
class _Open:
    rows: list[int] = field(default_factory=list)
    captions: set[str] = field(default_factory=set)


class GroupBatchSampler:
    """Yields lists of row indices (this rank's batches) for `DataLoader(batch_sampler=...)`.

    units: (N,) unit id per row; rows with equal ids always share a batch.
    captions: (N,) caption per row, needed only for `distinct_captions`.
    batch_size: rows per batch on this rank; a unit larger than it is an error.
    """

    def __init__(
        self,
        units: Sequence[int],
        batch_size: int,
        *,
        captions: Sequence[str] | None = None,
        distinct_captions: bool = False,
        shuffle: bool = True,
        drop_last: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ):
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be a whole number >= 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        if distinct_captions and captions is None:
            raise ValueError("distinct_captions needs the caption of every row")
        self.members = _members(units)
        largest = max((len(m) for m in self.members), default=0)
        if largest > batch_size:
            raise ValueError(f"a group has {largest} rows but a batch holds {batch_size}; raise the batch size")
        self.batch_size, self.captions, self.distinct = batch_size, captions, distinct_captions
        self.shuffle, self.drop_last, self.seed = shuffle, drop_last, seed
        self.rank, self.world_size = rank, world_size
        self.epoch, self.start = 0, 0
        self._cache: tuple[int, list[list[int]]] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's shuffle (call before each epoch, as with DistributedSampler)."""
        if epoch != self.epoch:
            self.epoch, self.start = epoch, 0

    def state_dict(self) -> dict[str, int]:
        """Epoch, batches already yielded on this rank and seed: enough to resume."""
        return {"epoch": self.epoch, "batches_done": self.start, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume: the next iteration continues the recorded epoch after the batches already done."""
        self.epoch, self.start, self.seed = state["epoch"], state["batches_done"], state.get("seed", self.seed)

    def __len__(self) -> int:
        return len(self._rank_batches()) - self.start

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._rank_batches()
        while self.start < len(batches):
            self.start += 1
            yield batches[self.start - 1]
        self.epoch, self.start = self.epoch + 1, 0  # a finished epoch moves on even without set_epoch

    def _order(self, g: torch.Generator) -> list[int]:
        """Units shuffled, then stably sorted largest first (placing big units first is what lets batches fill)."""
        order = torch.randperm(len(self.members), generator=g).tolist()
        return sorted(order, key=lambda u: -len(self.members[u]))

    def _rank_batches(self) -> list[list[int]]:
        if self._cache is None or self._cache[0] != self.epoch:
            batches = _equal_per_rank(self._epoch_batches(), self.world_size, self.drop_last)
            self._log_dropped(batches)
            self._cache = (self.epoch, batches[self.rank :: self.world_size])
        return self._cache[1]

    def _epoch_batches(self) -> list[list[int]]:
        """All ranks' batches of the current epoch, in the order they are dealt out."""
        captions = self._unit_captions()
        if not self.shuffle:
            order = list(range(len(self.members)))
            return _pack(order, self.members, self.batch_size, captions, self.drop_last)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        batches = _spread(self._order(g), self.members, self.batch_size, captions, self.drop_last)
        return [batches[k] for k in torch.randperm(len(batches), generator=g).tolist()]

    def _log_dropped(self, batches: list[list[int]]) -> None:
        """Log how many rows the epoch leaves out (every rank packs alike, so rank 0 speaks for all)."""
        rows = sum(len(m) for m in self.members)
        dropped = rows - len({r for b in batches for r in b})
        if self.rank == 0 and rows:
            level = logging.WARNING if dropped > 0.1 * rows else logging.INFO
            log.log(
                level, "epoch %d: %d of %d rows dropped (partial batches under drop_last)", self.epoch, dropped, rows
            )

    def _unit_captions(self) -> list[set[str]] | None:
        if not self.distinct:
            return None
        return [{self.captions[r] for r in rows} for rows in self.members]


def _members(units: Sequence[int]) -> list[list[int]]:
    """Rows of each unit, units in order of first appearance."""
    index: dict[int, list[int]] = {}
    for row, unit in enumerate(units):
        index.setdefault(unit, []).append(row)
    return list(index.values())


def _fits(batch: _Open, rows: list[int], caps: set[str] | None, size: int) -> bool:
    return len(batch.rows) + len(rows) <= size and (caps is None or not (caps & batch.captions))


def _spread(
    order: list[int], members: list[list[int]], size: int, captions: list[set[str]] | None, drop_last: bool
) -> list[list[int]]:
    """Each unit (in `order`) into the emptiest of the epoch's batches where it fits; leftovers form extra batches."""
    rows = sum(len(m) for m in members)
    n = rows // size if drop_last else -(-rows // size)
    batches = [_Open() for _ in range(n)]
    heap = [(0, k) for k in range(n)]  # (rows used, batch index): the emptiest first
    leftover = []
    for u in order:
        caps = captions[u] if captions is not None else None
        skipped, placed = [], None
        while heap and placed is None:
            used, k = heapq.heappop(heap)
            if used + len(members[u]) > size:
                heapq.heappush(heap, (used, k))  # the emptiest has no room: none has
                break
            if _fits(batches[k], members[u], caps, size):
                placed = k
            else:
                skipped.append((used, k))
        for item in skipped:
            heapq.heappush(heap, item)
        if placed is None:
            leftover.append(u)
            continue
        batches[placed].rows.extend(members[u])
        batches[placed].captions |= caps or set()
        heapq.heappush(heap, (len(batches[placed].rows), placed))
    return _pack(leftover, members, size, captions, drop_last, [b.rows for b in batches])


def _pack(
    order: list[int],
    members: list[list[int]],
    size: int,
    captions: list[set[str]] | None,
    drop_last: bool,
    done: list[list[int]] | None = None,
) -> list[list[int]]:
    """First-fit packing of units (in `order`) into `size`-row batches after `done`.

    A batch is complete when it holds more than `size` minus the largest unit's rows; the others (the packing's
    leftovers) come last, or are dropped under `drop_last`.
    """
    done = [b for b in done or [] if b]
    open_: list[_Open] = []
    for u in order:
        caps = captions[u] if captions is not None else None
        target = next((b for b in open_ if _fits(b, members[u], caps, size)), None)
        if target is None:
            if len(open_) >= MAX_OPEN:  # flush the fullest open batch rather than grow without bound
                open_.sort(key=lambda b: -len(b.rows))
                done.append(open_.pop(0).rows)
            target = _Open()
            open_.append(target)
        target.rows.extend(members[u])
        target.captions |= caps or set()
        if len(target.rows) == size:
            done.append(target.rows)
            open_.remove(target)
    done += [b.rows for b in open_ if b.rows]
    complete = size - max((len(m) for m in members), default=1)  # no unit of the largest size could still join
    kept = [b for b in done if len(b) > complete]
    return kept if drop_last else kept + [b for b in done if len(b) <= complete]


def _equal_per_rank(batches: list[list[int]], world: int, drop_last: bool) -> list[list[int]]:
    """A batch count divisible by `world` (batch k goes to rank k mod world): drop the smallest batches under
    `drop_last` (the latest of equal ones), else wrap around to the first ones."""
    extra = len(batches) % world
    if world == 1 or not extra:
        return batches
    if drop_last:
        smallest = set(sorted(range(len(batches)), key=lambda k: (len(batches[k]), -k))[:extra])
        return [b for k, b in enumerate(batches) if k not in smallest]
    return batches + batches[: world - extra]
