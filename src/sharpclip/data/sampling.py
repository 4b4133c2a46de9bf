"""Group-aware batch sampling: which rows share a contrastive batch, the same global batches at every world size.

Rows come in units: the two halves of an edit pair (CLIP-IN's hard negatives need both in the batch), the members of a
group (a SynthDense family) when grouping is on, or single rows. Each epoch the units are shuffled with a generator
seeded by (seed, epoch), then spread over the epoch's global batches (`batch_size` × `world_size` rows) largest first,
each into the emptiest batch where it fits (so groups spread evenly and single rows fill the gaps); the batch order
is shuffled too. Without shuffling (evaluation) units are packed in order. With `distinct_captions`, a unit
does not go into a batch that already holds one of its captions (an exact duplicate would be a false negative of
InfoNCE and a zero-margin pair of HN-CLIP). Packing, grouping and `distinct_captions` act on the global batch, which
depends on the seed, the epoch and the global batch size only, never on the world size.

Each global batch is then dealt to the ranks, every rank computing the same packing (no communication):
- `whole_units=False` (per_micro_batch accumulation, where each micro-batch is its own contrastive matrix): rank r
  takes rows r·b … r·b + b − 1 (b = `batch_size`), i.e. with k micro-batches a rank it takes micro-batches
  r·k … r·k + k − 1 of the global batch, the very micro-batches one process cuts from it;
- `whole_units=True` (default; exact accumulation, where the step's matrix is the whole global batch): consecutive
  whole units, cut at the unit boundary nearest to r·n/W for n rows, so an edit pair never straddles two ranks (its
  edit indices are per rank); a rank's share then differs from b by less than the largest unit.
Either way the ranks' shares, in rank order, are the global batch, so a W-rank run's step t trains the rows of a
1-process run's step t (tests/train/test_train_same_rows.py).

The guarantee: every global batch holds at most `batch_size` × `world_size` rows, and whole units only. Units need not
add up to the batch (families of 6 never fill a batch of 16), so a batch counts as complete when it holds more
than its size minus the largest unit: no unit of the largest size could still join it. Under `drop_last` only
batches short of that are dropped (the leftover tail of the packing); the epoch's dropped rows are logged on the
`sharpclip.data` logger. Batch sizes therefore vary by less than the largest unit, which the trainer and the losses
accept (the contrastive matrix is whatever rows the ranks gather); as a unit holds at most `batch_size` rows, no
rank's share of a complete batch is empty. Without `drop_last` (evaluation) every row is used exactly once, and a
rank whose share of the last, short batch is empty skips it.

The sampler is resumable: `state_dict()` records (epoch, global batches already dealt, seed), the same on every rank.
"""

from __future__ import annotations

import heapq
import logging
import numbers
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

import torch

log = logging.getLogger("sharpclip.data")

MAX_OPEN = 16  # batches kept open while packing: enough to place groups, few enough to keep the shuffle's order


@dataclass
class _Open:
    rows: list[int] = field(default_factory=list)
    captions: set[str] = field(default_factory=set)


class GroupBatchSampler:
    """Yields lists of row indices (this rank's share of each global batch) for `DataLoader(batch_sampler=...)`.

    units: (N,) unit id per row; rows with equal ids always share a batch.
    captions: (N,) caption per row, needed only for `distinct_captions`.
    batch_size: rows per rank (b); the global batch is b × world_size rows; a unit larger than b is an error.
    whole_units: deal each rank whole units (exact accumulation) rather than rows r·b … r·b + b − 1
    (per_micro_batch: the micro-batches of one process); see the module docstring.
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
        whole_units: bool = True,
    ):
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be a whole number >= 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        if distinct_captions and captions is None:
            raise ValueError("distinct_captions needs the caption of every row")
        self.units, self.members = list(units), _members(units)
        largest = max((len(m) for m in self.members), default=0)
        if largest > batch_size:
            share = f" (train.batch_size {batch_size * world_size} over {world_size} ranks)" if world_size > 1 else ""
            raise ValueError(
                f"a group has {largest} rows but a batch holds {batch_size}{share}, and a group's rows share a batch; "
                "raise train.batch_size, or set data.group_batches=false"
            )
        self.batch_size, self.captions, self.distinct = batch_size, captions, distinct_captions
        self.shuffle, self.drop_last, self.seed = shuffle, drop_last, seed
        self.rank, self.world_size, self.whole_units = rank, world_size, whole_units
        self.epoch, self.start = 0, 0
        self._cache: tuple[int, list[list[int]]] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's shuffle (call before each epoch, as with DistributedSampler)."""
        if epoch != self.epoch:
            self.epoch, self.start = epoch, 0

    def state_dict(self) -> dict[str, int]:
        """Epoch, batches already yielded on this rank (the global batches dealt, under drop_last) and seed."""
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
            batches = self._epoch_batches()
            self._log_dropped(batches)
            shares = [self._deal(b)[self.rank] for b in batches]
            self._cache = (self.epoch, [s for s in shares if s])  # empty only in the short last batch of evaluation
        return self._cache[1]

    def _deal(self, batch: list[int]) -> list[list[int]]:
        """Each rank's share of a global batch: consecutive rows, in rank order (see the module docstring)."""
        if self.world_size == 1:
            return [batch]
        if not self.whole_units:
            b = self.batch_size
            return [batch[r * b : (r + 1) * b] for r in range(self.world_size)]
        starts = [k for k in range(len(batch)) if k == 0 or self.units[batch[k]] != self.units[batch[k - 1]]]
        cuts = _balanced_cuts([*starts, len(batch)], self.world_size)
        return [batch[a:z] for a, z in pairwise(cuts)]

    def _epoch_batches(self) -> list[list[int]]:
        """The current epoch's global batches, in order (the same at every world size)."""
        captions, size = self._unit_captions(), self.batch_size * self.world_size
        if not self.shuffle:
            order = list(range(len(self.members)))
            return _pack(order, self.members, size, captions, self.drop_last)
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) % 2**64)  # torch takes 64 bits
        batches = _spread(self._order(g), self.members, size, captions, self.drop_last)
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


def _balanced_cuts(bounds: list[int], world: int) -> list[int]:
    """`world` + 1 cut positions among the unit boundaries `bounds` (0 … n rows, ascending), cut r the boundary
    nearest to r·n/world, strictly after cut r − 1 and leaving a unit for each later rank while units last."""
    n, units = bounds[-1], len(bounds) - 1
    cuts = [0]
    for r in range(1, world):
        low, high = cuts[-1] + 1, max(cuts[-1] + 1, units - (world - r))  # indices into bounds
        allowed = range(min(low, units), min(high, units) + 1)
        cuts.append(min(allowed, key=lambda k: (abs(bounds[k] * world - r * n), k)))
    return [bounds[k] for k in cuts] + [n]
