"""Training subsets (data.subset): nested, the size rule, identical whatever reads them (objective, training seed,
rank and world size), recorded by a digest of their ids, and refused where they cannot apply."""

from __future__ import annotations

import hashlib
import inspect
import math

import pytest
from data_helpers import cfg_for, prep

from _support.tiny_files import write_generic
from sharpclip.config import ConfigError, load_config
from sharpclip.data import build_dataset, build_loader
from sharpclip.data.schema import PairSample
from sharpclip.data.subset import ids_digest, select_subset, subset_key, subset_order, subset_size
from sharpclip.models.tokenizer import build_word_tokenizer

TOK = build_word_tokenizer(["a small large red green blue yellow purple orange white black square circle triangle "
                            "star hexagon diamond cross ring left of and at the top ."])  # fmt: skip


def _samples(n: int) -> list[PairSample]:
    return [PairSample(id=f"img-{i:04d}", image=f"{i}.png", caption=f"caption {i}") for i in range(n)]


def test_subsets_are_nested_and_keep_release_order():
    samples = _samples(400)
    ids = {f: [s.id for s in select_subset(samples, f, seed=7)[0]] for f in (0.05, 0.2, 0.5, 1.0)}
    assert [len(v) for v in ids.values()] == [20, 80, 200, 400]
    assert set(ids[0.05]) < set(ids[0.2]) < set(ids[0.5]) < set(ids[1.0])
    for v in ids.values():  # release order: the subset is a filter, not a shuffle
        assert v == sorted(v)
    assert ids[1.0] == [s.id for s in samples]  # 100 %: the full split, row for row
    by_count = [s.id for s in select_subset(samples, count=80, seed=7)[0]]
    assert by_count == ids[0.2]  # a count picks the same prefix of the same ranking
    assert ids[0.2] != [s.id for s in select_subset(samples, 0.2, seed=8)[0]]  # another subset_seed, another subset


def test_the_ranking_is_sha256_of_seed_and_id_by_an_independent_computation():
    ids = [f"x{i}" for i in range(50)]
    want = sorted(ids, key=lambda i: hashlib.sha256(f"3:{i}".encode()).hexdigest())[:10]
    assert sorted(ids[k] for k in subset_order(ids, 3)[:10]) == sorted(want)
    assert subset_key(3, "x1") == hashlib.sha256(b"3:x1").hexdigest()
    assert ids_digest(["b", "a"]) == ids_digest(["a", "b"]) == hashlib.sha256(b"a\nb").hexdigest()


def test_the_size_rule():
    assert subset_size(9450, 0.05) == math.ceil(0.05 * 9450) == 473  # DOCCI's 9,450 training images at 5 %
    assert subset_size(100, 0.07) == 7  # 0.07 · 100 = 7.000000000000001 in floating point: still 7
    assert subset_size(10, 0.01) == 1  # at least one sample
    assert subset_size(10, 1.0, count=3) == 3
    with pytest.raises(ValueError, match="train_count 11 is larger than the 10 samples"):
        subset_size(10, count=11)


def test_the_selection_reads_no_rank_world_size_objective_or_training_seed():
    # the proof by inputs: what select_subset can see is the samples, the size and the subset's own seed
    assert list(inspect.signature(select_subset).parameters) == ["samples", "fraction", "count", "seed"]
    # ... and by the real loaders: a fraction of a generic dataset read for 1 process and for each of 2 ranks, with
    # two training seeds, holds the same samples; the ranks' batches of an epoch together cover the subset's rows
    # exactly as the single process's do


@pytest.fixture()
def generic(tmp_path):
    return write_generic(tmp_path / "generic", n=40, splits=("train",))


def _epoch_ids(cfg, rank: int, world: int, seed: int) -> list[str]:
    loader = build_loader(cfg, "train", prep(TOK, 8), batch_size=8 // world, rank=rank, world_size=world, seed=seed)
    return [i for batch in loader for i in batch.ids]


def test_one_and_two_ranks_and_two_training_seeds_read_the_same_subset(generic):
    cfg = cfg_for("generic", generic, train_fraction=0.4, subset_seed=1)
    dataset = build_dataset(cfg, "train", prep(TOK, 8).image)
    subset = sorted(s.id for s in dataset.samples)
    assert len(subset) == 16 and dataset.subset.selected == 16 and dataset.subset.total == 40
    assert dataset.subset.ids_sha256 == ids_digest(subset)
    one = _epoch_ids(cfg, 0, 1, seed=0)
    two = _epoch_ids(cfg, 0, 2, seed=0) + _epoch_ids(cfg, 1, 2, seed=0)
    other_seed = _epoch_ids(cfg, 0, 1, seed=5)
    assert sorted(one) == sorted(two) == sorted(other_seed) == subset  # 16 rows = 2 full batches of 8
    assert one != other_seed  # the training seed orders the batches, it does not choose the samples
    full = build_dataset(cfg_for("generic", generic), "train", prep(TOK, 8).image)
    assert full.subset is None and len(full.samples) == 40


def test_evaluation_splits_are_never_cut(generic):
    cfg = cfg_for("generic", generic, train_fraction=0.1, train_split="train", eval_split="train")
    assert len(build_loader(cfg, "train", prep(TOK, 8), batch_size=4, train=False).dataset) == 4
    other = cfg_for("generic", generic, train_fraction=0.1, train_split="other")
    assert len(build_dataset(other, "train", prep(TOK, 8).image).samples) == 40  # not the train split: every row


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.train_fraction=0"], "data.train_fraction: must be > 0, got 0"),
        (["data.train_fraction=1.5"], "data.train_fraction: must be <= 1, got 1.5"),
        (["data.train_count=-1"], "data.train_count: must be >= 0, got -1"),
        (["data.train_count=5", "data.train_fraction=0.5"], "both choose the subset's size"),
        (["data.format=webdataset", "data.train_fraction=0.5"], "webdataset shards stream"),
    ],
)
def test_bad_subset_settings_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
