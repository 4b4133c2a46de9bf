"""Group-aware batches: groups and edit halves together, no duplicate captions, disjoint ranks, determinism, resume."""

from __future__ import annotations

import pytest

from sharpclip.data.sampling import GroupBatchSampler


def _units(n_groups: int, size: int, singles: int) -> list[int]:
    return [g for g in range(n_groups) for _ in range(size)] + list(range(n_groups, n_groups + singles))


def _epoch(sampler: GroupBatchSampler, epoch: int = 0) -> list[list[int]]:
    sampler.set_epoch(epoch)
    return list(sampler)


def test_every_group_lands_in_one_batch_and_batches_are_full():
    units = _units(n_groups=20, size=6, singles=40)  # 160 rows: families of 6 and single rows
    batches = _epoch(GroupBatchSampler(units, 16, seed=1))
    where = {row: k for k, batch in enumerate(batches) for row in batch}
    for g in range(20):
        assert len({where.get(r) for r in range(6 * g, 6 * g + 6)}) == 1
    assert all(len(b) == 16 for b in batches)
    assert len(where) >= 160 - 16  # at most the last partial batch is dropped


def test_edit_pairs_stay_together_without_drop_last_every_row_once():
    units = _units(n_groups=25, size=2, singles=7)
    batches = _epoch(GroupBatchSampler(units, 8, shuffle=True, drop_last=False, seed=3))
    rows = sorted(r for b in batches for r in b)
    assert rows == list(range(57))
    for b in batches:
        for r in b:
            if r < 50:
                assert (r ^ 1) in b  # rows 2k and 2k+1 are one edit


def test_distinct_captions_keeps_exact_duplicates_apart():
    captions = [f"caption {i % 10}" for i in range(80)]  # each text 8 times
    batches = _epoch(GroupBatchSampler(list(range(80)), 10, captions=captions, distinct_captions=True, seed=0))
    assert batches
    for b in batches:
        texts = [captions[r] for r in b]
        assert len(set(texts)) == len(texts)
    plain = _epoch(GroupBatchSampler(list(range(80)), 10, seed=0))
    assert any(len({captions[r] for r in b}) < len(b) for b in plain)  # without the option duplicates do meet


def _shards(units: list[int], b: int, world: int, **kw) -> list[list[list[int]]]:
    return [_epoch(GroupBatchSampler(units, b, rank=r, world_size=world, **kw)) for r in range(world)]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("whole", [True, False])
def test_every_world_size_deals_the_global_batches_of_one_process(world, whole):
    """Rank r's share of step t, in rank order, is one process's batch t of b·W rows: the same rows at every W."""
    units = _units(n_groups=30, size=2, singles=60) + _units(n_groups=10, size=3, singles=0)
    single = _epoch(GroupBatchSampler(units, 8 * world, seed=5))
    shards = _shards(units, 8, world, seed=5, whole_units=whole)
    assert [len(s) for s in shards] == [len(single)] * world
    for t, batch in enumerate(single):
        assert [row for s in shards for row in s[t]] == batch
        if not whole:  # per_micro_batch: rank r holds rows r·b … r·b + b − 1, its micro-batches of the global batch
            assert [s[t] for s in shards] == [batch[r * 8 : (r + 1) * 8] for r in range(world)]


def test_whole_unit_shares_keep_edit_pairs_on_one_rank_and_balance_rows():
    units = _units(n_groups=40, size=2, singles=0) + _units(n_groups=8, size=5, singles=0)
    for step in zip(*_shards(units, 8, 2, seed=1), strict=True):
        for share in step:
            assert all(units.count(units[r]) == [units[x] for x in share].count(units[r]) for r in share)
        assert abs(len(step[0]) - len(step[1])) <= 5  # cut at the unit boundary nearest the middle


def test_grouping_and_distinct_captions_hold_over_the_global_batch():
    """Families of 4 and single captions repeated 4 times: on 2 ranks of 8 rows, each family lies in one global batch
    and no global batch (both ranks' rows) repeats a caption."""
    units = _units(n_groups=20, size=4, singles=80)
    captions = [f"family {u}" if u < 20 else f"caption {u % 20}" for u in units]
    shards = _shards(units, 8, 2, seed=2, captions=captions, distinct_captions=True, whole_units=False)
    where = {row: t for s in shards for t, b in enumerate(s) for row in b}
    for g in range(20):
        assert len({where.get(r) for r in range(4 * g, 4 * g + 4)} - {None}) == 1
    for step in zip(*shards, strict=True):
        rows = [r for b in step for r in b]
        singles = [captions[r] for r in rows if units[r] >= 20]
        assert len(singles) == len(set(singles))


def test_a_resume_on_another_world_size_continues_the_same_global_batches():
    """The position a 2-rank sampler saves (global batches dealt) is where a 1-process sampler continues."""
    units = list(range(100))
    full = _epoch(GroupBatchSampler(units, 20, seed=2), 1)
    ranks = [GroupBatchSampler(units, 10, seed=2, rank=r, world_size=2) for r in (0, 1)]
    for sampler in ranks:
        sampler.set_epoch(1)
    its = [iter(s) for s in ranks]
    done = [[*next(its[0]), *next(its[1])] for _ in range(2)]
    assert ranks[0].state_dict() == ranks[1].state_dict() == {"epoch": 1, "batches_done": 2, "seed": 2}
    one = GroupBatchSampler(units, 20)
    one.load_state_dict(ranks[0].state_dict())
    assert done + list(one) == full


def test_evaluation_on_several_ranks_uses_every_row_once():
    """20 rows in release order, global batches of 16: the last 4 go 2 + 2 as whole units, 4 + 0 as rows (rank 1
    skips its empty share)."""
    for whole, lengths in ((True, [2, 2]), (False, [2, 1])):
        shards = _shards(list(range(20)), 8, 2, shuffle=False, drop_last=False, whole_units=whole)
        assert [len(s) for s in shards] == lengths
        assert [r for t in range(2) for s in shards for r in (s[t] if t < len(s) else [])] == list(range(20))


def test_deterministic_per_seed_and_epoch_and_different_across_epochs_and_seeds():
    units = _units(n_groups=10, size=3, singles=50)
    a, b = GroupBatchSampler(units, 8, seed=7), GroupBatchSampler(units, 8, seed=7)
    assert _epoch(a, 2) == _epoch(b, 2)
    assert _epoch(a, 3) != _epoch(b, 2)
    assert _epoch(GroupBatchSampler(units, 8, seed=8), 2) != _epoch(b, 2)


def test_resume_continues_after_the_batches_done():
    units = list(range(100))
    full = _epoch(GroupBatchSampler(units, 10, seed=2), 4)
    first = GroupBatchSampler(units, 10, seed=2)
    first.set_epoch(4)
    it = iter(first)
    done = [next(it) for _ in range(3)]
    resumed = GroupBatchSampler(units, 10)
    resumed.load_state_dict(first.state_dict())
    assert len(resumed) == len(full) - 3
    assert done + list(resumed) == full


def test_a_group_larger_than_the_batch_is_an_error():
    with pytest.raises(ValueError, match="a group has 6 rows but a batch holds 4"):
        GroupBatchSampler([0] * 6, 4)


def _coverage(units: list[int], batch_size: int, world_size: int, whole: bool) -> tuple[float, list[int]]:
    """Share of rows an epoch uses over all ranks, and each rank's batch count (checking sizes and whole units)."""
    shards = [
        _epoch(GroupBatchSampler(units, batch_size, seed=4, rank=r, world_size=world_size, whole_units=whole))
        for r in range(world_size)
    ]
    rows = [row for shard in shards for batch in shard for row in batch]
    assert len(rows) == len(set(rows))
    largest = max(units.count(u) for u in set(units))
    for step in zip(*shards, strict=True):
        assert all(step) and len([r for b in step for r in b]) <= batch_size * world_size
        # whole units per rank, or rows r·b … r·b + b − 1 of the global batch; whole units per global batch always
        assert all(len(b) < batch_size + largest if whole else len(b) <= batch_size for b in step)
        for group in step if whole else [[r for b in step for r in b]]:
            assert all([units[x] for x in group].count(units[r]) == units.count(units[r]) for r in group)
    return len(rows) / len(units), [len(s) for s in shards]


@pytest.mark.parametrize("whole", [True, False])
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize(
    ("units", "batch_size"),
    [
        (_units(n_groups=100, size=6, singles=0), 16),  # families only, 16 not a multiple of 6
        (_units(n_groups=250, size=2, singles=0), 15),  # edit pairs only, odd batch size
        (_units(n_groups=100, size=6, singles=100), 16),  # families and single rows
    ],
)
def test_drop_last_keeps_nearly_every_row_when_units_do_not_fill_a_batch(units, batch_size, world_size, whole):
    used, counts = _coverage(units, batch_size, world_size, whole)
    assert used >= 0.9
    assert len(set(counts)) == 1 and counts[0] > 0


def test_the_rows_an_epoch_drops_are_logged(caplog):
    with caplog.at_level("INFO", logger="sharpclip.data"):
        _epoch(GroupBatchSampler(list(range(95)), 10, seed=0))
    assert "5 of 95 rows dropped" in caplog.text


def test_pairs_among_single_rows_fill_the_first_micro_batches_of_every_batch():
    # the demo's fine-tuning set: 320 detail pairs + 1,920 single scenes, batches of 128 split into micro-batches of 16
    units = [i // 2 for i in range(640)] + list(range(320, 320 + 1920))
    sampler = GroupBatchSampler(units, 128, seed=3)
    batches = list(sampler)
    assert len(batches) == 20
    for batch in batches:
        assert sorted(r < 640 for r in batch[:32]) == [True] * 32 and not any(r < 640 for r in batch[32:])
        micro = [batch[k : k + 16] for k in range(0, 128, 16)]
        for m in micro[:2]:  # both halves of each pair share a micro-batch
            assert all(sum(units[q] == units[r] for q in m) == 2 for r in m)


@pytest.mark.parametrize("batch_size", [0, -4, 2.5, True])
def test_a_batch_size_that_is_not_a_whole_number_at_least_1_is_refused(batch_size):
    with pytest.raises(ValueError, match=r"batch_size=.* must be a whole number >= 1"):
        GroupBatchSampler([0, 1, 2, 3], batch_size)


@pytest.mark.parametrize("seed", [1_234_567_890, 2**63 - 1])
def test_a_large_train_seed_orders_batches_without_overflow(seed):
    # train.seed=1234567890 was "Overflow when unpacking long long": the epoch's seed seed·1,000,003 + epoch
    # passed 2^64, torch's limit; it is taken modulo 2^64, so every seed the config allows orders the batches
    units = _units(n_groups=10, size=3, singles=50)
    a, b = GroupBatchSampler(units, 8, seed=seed), GroupBatchSampler(units, 8, seed=seed)
    assert _epoch(a, 3) == _epoch(b, 3)
    assert sorted(i for batch in _epoch(a, 4) for i in batch) == list(range(len(units)))
