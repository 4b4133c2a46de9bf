"""webdataset shards as img2dataset writes them: reading, sharding over ranks × workers, resume, bad samples."""

from __future__ import annotations

import io
import json
import re
from collections import Counter
from pathlib import Path

import pytest
from data_helpers import prep
from PIL import Image

from sharpclip.config import DataConfig
from sharpclip.data import build_loader, read_samples
from sharpclip.data.formats.webdataset import count_samples, shard_urls
from sharpclip.data.schema import BadSampleError
from sharpclip.models.tokenizer import build_word_tokenizer

TOK = build_word_tokenizer(["a photo of sample number short group"])
PREP = prep(TOK, 8)


def _jpeg(i: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (10, 8), (i * 7 % 256, 40, 90)).save(buf, "JPEG")
    return buf.getvalue()


def write_shard(path: Path, members: list[tuple[str, bytes]]) -> Path:
    """A tar shard with these members, written by webdataset's own TarWriter-compatible layout (tarfile)."""
    import tarfile

    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def img2dataset(root: Path, shards: int, per_shard: int, json_caption: bool = False) -> list[str]:
    """img2dataset's output: NNNNN.tar of <key>.jpg/.txt/.json, beside NNNNN_stats.json; returns every key."""
    keys = []
    for s in range(shards):
        members = []
        for j in range(per_shard):
            key = f"{s:05d}{j:04d}"
            meta = {"key": key, "url": f"http://x/{key}.jpg", "status": "success", "width": 10, "height": 8}
            if json_caption:
                meta |= {"caption": f"a photo of sample {key}", "short_caption": "short", "group": s}
            members += [(f"{key}.jpg", _jpeg(j)), (f"{key}.txt", f"a photo of number {key}".encode())]
            members.append((f"{key}.json", json.dumps(meta).encode()))
            keys.append(key)
        write_shard(root / f"{s:05d}.tar", members)
        (root / f"{s:05d}_stats.json").write_text(json.dumps({"count": per_shard, "successes": per_shard}))
        (root / f"{s:05d}.parquet").write_bytes(b"PAR1")  # img2dataset's per-shard metadata table (not read)
    return keys


def cfg(root: Path, **kw) -> DataConfig:
    return DataConfig(format="webdataset", root=str(root), **kw)


def test_img2dataset_output_reads_as_is_txt_caption_and_json_fields(tmp_path):
    img2dataset(tmp_path, 2, 3)
    samples = read_samples(cfg(tmp_path), "train")
    assert [s.id for s in samples] == ["000000000", "000000001", "000000002", "000010000", "000010001", "000010002"]
    assert samples[0].caption == "a photo of number 000000000" and samples[0].source.endswith("00000.tar:000000000")
    img2dataset(tmp_path / "j", 1, 2, json_caption=True)
    first = read_samples(cfg(tmp_path / "j"), "train")[0]
    assert (first.caption, first.short_caption, first.group) == ("a photo of sample 000000000", "short", "0")


def test_img2dataset_folder_is_detected_as_webdataset_despite_its_parquet_files(tmp_path):
    from sharpclip.data.validate import detect_format

    img2dataset(tmp_path, 1, 1)
    assert detect_format(tmp_path) == "webdataset"


def test_brace_patterns_and_lists_of_patterns_select_shards(tmp_path):
    img2dataset(tmp_path, 4, 1)
    assert [Path(u).name for u in shard_urls(cfg(tmp_path, shards=["{00001..00002}.tar"]), "train")] == [
        "00001.tar",
        "00002.tar",
    ]
    both = shard_urls(cfg(tmp_path, shards=["00000.tar", "0000{2,3}.tar"]), "train")
    assert [Path(u).name for u in both] == ["00000.tar", "00002.tar", "00003.tar"]
    with pytest.raises(FileNotFoundError, match=r"00004.tar: shard not found \(6 of 10 missing\)"):
        shard_urls(cfg(tmp_path, shards=["{00000..00009}.tar"]), "train")


def test_counts_come_from_stats_files_or_the_tar_headers(tmp_path):
    img2dataset(tmp_path, 1, 5)
    assert count_samples(str(tmp_path / "00000.tar")) == 5
    (tmp_path / "00000_stats.json").unlink()
    write_shard(tmp_path / "00000.tar", [("a.jpg", b"x"), ("a.txt", b"t"), ("b.png", b"y"), ("c.txt", b"only text")])
    assert count_samples(str(tmp_path / "00000.tar")) == 2


def _epoch_ids(root: Path, world: int, workers: int, batch: int, epoch: int = 0, **kw) -> Counter:
    seen: Counter = Counter()
    for rank in range(world):
        loader = build_loader(cfg(root, num_workers=workers, shuffle_buffer=4, **kw), "train", PREP,
                              batch_size=batch, rank=rank, world_size=world, seed=1)  # fmt: skip
        loader.set_epoch(epoch)
        batches = list(loader)
        assert len(batches) == len(loader)  # every rank yields the same number of batches
        seen.update(i for b in batches for i in b.ids)
    return seen


def test_two_ranks_by_two_workers_see_every_sample_exactly_once_per_epoch(tmp_path):
    keys = img2dataset(tmp_path, 8, 6)  # 4 slots × 2 shards × 6 samples; batch 4 divides every slot's 12
    for epoch in (0, 1):
        seen = _epoch_ids(tmp_path, world=2, workers=2, batch=4, epoch=epoch)
        assert sorted(seen) == sorted(keys) and set(seen.values()) == {1}


def test_uneven_shards_give_equal_lengths_and_no_sample_twice(tmp_path):
    img2dataset(tmp_path, 5, 5)  # slots of 10, 5, 5, 5 samples: capacities differ, the common length is the least
    seen = _epoch_ids(tmp_path, world=2, workers=2, batch=2)
    assert max(seen.values()) == 1 and len(seen) == 2 * 4 * 2  # rank 0: 5 + 2 = 7 batches, capped at rank 1's 4


def test_shuffle_changes_order_between_epochs_not_between_runs(tmp_path):
    img2dataset(tmp_path, 2, 8)
    loader = build_loader(cfg(tmp_path, shuffle_buffer=8), "train", PREP, batch_size=4, seed=5)
    orders = []
    for epoch in (0, 1, 0):
        loader.set_epoch(epoch)
        orders.append([i for b in loader for i in b.ids])
    assert orders[0] == orders[2] and orders[0] != orders[1] and sorted(orders[0]) == sorted(orders[1])


def test_epoch_samples_sets_the_length_and_cannot_exceed_the_shards(tmp_path):
    img2dataset(tmp_path, 4, 6)
    assert len(build_loader(cfg(tmp_path, epoch_samples=8), "train", PREP, batch_size=2, world_size=2)) == 2
    with pytest.raises(ValueError, match=r"data\.epoch_samples=100"):
        build_loader(cfg(tmp_path, epoch_samples=100), "train", PREP, batch_size=2)


def _interrupted_epoch(make, taken: int = 3):
    """(the uninterrupted epoch 1's batch ids, those of a loader stopped after `taken` batches, those of a new loader
    resumed from its state dict as a checkpoint stores it, the resumed loader)."""
    full = make()
    full.set_epoch(1)
    reference = [b.ids for b in full]
    first = make()
    first.set_epoch(1)
    it = iter(first)
    done = [next(it).ids for _ in range(taken)]
    state = json.loads(json.dumps(first.state_dict()))
    del it
    second = make()
    second.load_state_dict(state)
    second.set_epoch(1)
    return reference, done, [b.ids for b in second], second


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_continues_the_epoch_from_the_saved_positions(tmp_path, workers):
    keys = img2dataset(tmp_path, 4, 6)
    make = lambda: build_loader(cfg(tmp_path, num_workers=workers, shuffle_buffer=0), "train", PREP,  # noqa: E731
                                batch_size=3, seed=2)  # fmt: skip
    reference, done, rest, second = _interrupted_epoch(make)
    assert sorted(i for b in done + rest for i in b) == sorted(keys)  # nothing twice, nothing lost
    assert done + rest == reference  # in the same order, also with workers (the DataLoader's turn is restored)
    assert second.state_dict()["epoch"] == 2  # the epoch ended: the next one starts fresh


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_through_the_default_shuffle_buffer_loses_nothing_and_repeats_the_order(tmp_path, workers):
    """A buffer larger than every shard holds a slot's whole epoch when its first batch is made: resuming from the
    read position alone would lose the rest of the epoch; the replay from the epoch's start keeps it, in order."""
    keys = img2dataset(tmp_path, 4, 6)
    data = cfg(tmp_path, num_workers=workers)
    assert data.shuffle_buffer >= 12  # the default: more than a slot's samples
    make = lambda: build_loader(data, "train", PREP, batch_size=3, seed=2)  # noqa: E731
    reference, done, rest, _ = _interrupted_epoch(make)
    assert done + rest == reference and sorted(i for b in reference for i in b) == sorted(keys)


def _ranks(root: Path, world: int, workers: int, **kw) -> list:
    """Every rank's loader of a run on `world` ranks with `workers` loader workers each; global batches of 8."""
    return [build_loader(cfg(root, num_workers=workers, **kw), "train", PREP, batch_size=8 // world, rank=rank,
                         world_size=world, seed=3) for rank in range(world)]  # fmt: skip


def _global_batches(loaders: list, epoch: int) -> list[list[str]]:
    """Each step's global batch (the ranks' batches in rank order) of `epoch`, from where the loaders stand."""
    for loader in loaders:
        loader.set_epoch(epoch)
    per_rank = [[b.ids for b in loader] for loader in loaders]
    assert len({len(batches) for batches in per_rank}) == 1  # every rank the same number of steps
    return [[i for ids in step for i in ids] for step in zip(*per_rank, strict=True)]


@pytest.mark.parametrize("buffer", [0, None])  # seek to the position; replay through the default shuffle buffer
@pytest.mark.parametrize("saved, resumed", [((2, 2), (1, 2)), ((1, 2), (2, 0)), ((2, 1), (4, 2)), ((2, 2), (2, 0))])
def test_a_streamed_epoch_continues_exactly_on_another_number_of_ranks_or_workers(tmp_path, saved, resumed, buffer):
    """A run on S ranks × K workers stopped after 2 of epoch 1's 6 steps, resumed from every rank's saved state on W
    ranks × K' workers: each later step of that epoch has the uninterrupted run's global batch, rows in order; the
    next epoch is dealt to the resumed run's own slots."""
    keys = img2dataset(tmp_path, 8, 6)
    kw = {} if buffer is None else {"shuffle_buffer": buffer}
    (ranks, workers), (new_ranks, new_workers) = saved, resumed
    uninterrupted = _ranks(tmp_path, ranks, workers, **kw)
    reference = _global_batches(uninterrupted, 1)
    assert len(reference) == 6 and sorted(i for step in reference for i in step) == sorted(keys)
    stopped = _ranks(tmp_path, ranks, workers, **kw)
    for loader in stopped:
        loader.set_epoch(1)
    iterators = [iter(loader) for loader in stopped]
    done = [[i for it in iterators for i in next(it).ids] for _ in range(2)]
    states = [json.loads(json.dumps(loader.state_dict())) for loader in stopped]  # as a checkpoint stores them
    del iterators
    continued = _ranks(tmp_path, new_ranks, new_workers, **kw)
    for loader in continued:
        loader.resume_epoch(states, ranks)
    assert done + _global_batches(continued, 1) == reference
    fresh = _global_batches(_ranks(tmp_path, new_ranks, new_workers, **kw), 2)
    assert _global_batches(continued, 2) == fresh
    # saved at the end of epoch 1: epoch 2 has not begun, and is read in the resumed run's own layout
    at_end = [json.loads(json.dumps(loader.state_dict())) for loader in uninterrupted]
    assert {(state["epoch"], state["batches_done"]) for state in at_end} == {(2, 0)}
    at_boundary = _ranks(tmp_path, new_ranks, new_workers, **kw)
    for loader in at_boundary:
        loader.resume_epoch(at_end, ranks)
    assert _global_batches(at_boundary, 2) == fresh


def _take(loaders: list, steps: int) -> tuple[list[list[str]], list[dict]]:
    """`steps` global batches from where the loaders stand in epoch 1, then every rank's state as a checkpoint holds
    it."""
    for loader in loaders:
        loader.set_epoch(1)
    iterators = [iter(loader) for loader in loaders]
    taken = [[i for it in iterators for i in next(it).ids] for _ in range(steps)]
    states = [json.loads(json.dumps(loader.state_dict())) for loader in loaders]
    del iterators
    return taken, states


@pytest.mark.parametrize("buffer", [0, None])
def test_a_streamed_epoch_stopped_twice_on_three_layouts_still_trains_the_uninterrupted_rows(tmp_path, buffer):
    """2 ranks × 2 workers stopped after 2 steps, resumed on 1 rank (reading the saved layout) and stopped again after
    1 more, resumed on 4 ranks × 1 worker: the checkpoint of the second stop keeps the first layout and every slot's
    position, and the epoch's 6 global batches are the uninterrupted run's."""
    img2dataset(tmp_path, 8, 6)
    kw = {} if buffer is None else {"shuffle_buffer": buffer}
    reference = _global_batches(_ranks(tmp_path, 2, 2, **kw), 1)
    first, states = _take(_ranks(tmp_path, 2, 2, **kw), 2)
    one = _ranks(tmp_path, 1, 2, **kw)
    one[0].resume_epoch(states, 2)
    second, states = _take(one, 1)
    assert (states[0]["ranks"], states[0]["workers"], states[0]["batch"]) == (2, 2, 4)  # still the first layout
    assert sorted(states[0]["slots"], key=int) == ["0", "1", "2", "3"]  # the one rank read every saved slot
    four = _ranks(tmp_path, 4, 1, **kw)
    for loader in four:
        loader.resume_epoch(states, 1)
    assert first + second + _global_batches(four, 1) == reference


def test_a_saved_slot_read_by_two_ranks_is_reported_bad_by_one(tmp_path):
    """Saved on 1 rank, resumed on 2: both read the saved slot; its bad sample is counted once, by rank 0."""
    members = []
    for j in range(10):
        members += [(f"k{j}.jpg", b"not a jpeg" if j == 6 else _jpeg(j)), (f"k{j}.txt", b"a photo")]
    write_shard(tmp_path / "train-0.tar", members)
    data = cfg(tmp_path, on_bad_sample="skip", shuffle=False)
    one = build_loader(data, "train", PREP, batch_size=4, seed=3)
    one.set_epoch(0)
    first = next(iter(one)).ids
    state = json.loads(json.dumps(one.state_dict()))
    two = [build_loader(data, "train", PREP, batch_size=2, rank=r, world_size=2, seed=3) for r in (0, 1)]
    for loader in two:
        loader.resume_epoch([state], 1)
        loader.set_epoch(0)
    rests = [[b.ids for b in loader] for loader in two]
    assert first == ["k0", "k1", "k2", "k3"] and rests == [[["k4", "k5"]], [["k7", "k8"]]]
    assert [[b.record for b in loader.report.items] for loader in two] == [["k6"], []]


def test_bad_samples_are_named_by_shard_and_key_and_skipped_by_policy(tmp_path):
    good = [("k1.jpg", _jpeg(1)), ("k1.txt", b"a photo")]
    bad = [("k2.jpg", b"not a jpeg"), ("k2.txt", b"a photo"), ("k3.txt", b"no image"), ("k4.jpg", _jpeg(4))]
    write_shard(tmp_path / "train-0.tar", good + bad + [("k5.jpg", _jpeg(5)), ("k5.json", b"{oops")])
    with pytest.raises(BadSampleError, match=r"train-0.tar:k2"):
        list(build_loader(cfg(tmp_path, shuffle=False), "train", PREP, batch_size=1))
    loader = build_loader(cfg(tmp_path, on_bad_sample="skip", shuffle=False), "train", PREP, batch_size=1)
    assert [b.ids for b in loader] == [["k1"]]
    reasons = {b.record: b.reason for b in loader.report.items}
    assert set(reasons) == {"k2", "k3", "k4", "k5"}
    assert reasons["k2"].startswith("unreadable image") and reasons["k3"].startswith("missing file")
    assert reasons["k4"].startswith("empty caption") and reasons["k5"].startswith("malformed record")


def test_validate_data_on_shards_counts_per_shard_and_names_bad_keys(tmp_path, capsys):
    from sharpclip.cli import main

    img2dataset(tmp_path, 2, 3)
    write_shard(tmp_path / "00002.tar", [("x1.jpg", b"broken"), ("x1.txt", b"a photo")])
    assert main(["validate-data", str(tmp_path), "--json", str(tmp_path / "r.json")]) == 1  # was: 0 samples, OK
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["format"] == "webdataset" and report["samples"] == 7
    assert [n for n in report["shards"].values()] == [3, 3, 1]
    assert len(report["errors"]) == 1 and "00002.tar:x1: record x1: unreadable image" in report["errors"][0]
    out = capsys.readouterr().out
    assert "3 shards: 00000.tar 3, 00001.tar 3, 00002.tar 1" in out


def test_validate_data_on_an_empty_folder_fails(tmp_path, capsys):
    from sharpclip.cli import main

    (tmp_path / "empty").mkdir()
    assert main(["validate-data", str(tmp_path / "empty"), "--json", str(tmp_path / "r.json")]) == 2
    assert "no train.jsonl, train.csv or train.tsv" in capsys.readouterr().err  # names what it looked for


def test_validate_data_shows_progress_and_says_how_many_shards_it_left_out(tmp_path, capsys, monkeypatch):
    """Shards as webdataset's own ShardWriter writes them (maxcount 2 → 10 shards of 20 samples)."""
    import webdataset as wds

    monkeypatch.setattr("sharpclip.progress.on_terminal", lambda: True)  # bars draw on a terminal only

    from sharpclip.cli import main

    with wds.ShardWriter(str(tmp_path / "shards-%06d.tar"), maxcount=2, verbose=0) as sink:
        for i in range(20):
            sink.write({"__key__": f"{i:06d}", "jpg": _jpeg(i), "txt": f"a photo of number {i}"})
    assert main(["validate-data", str(tmp_path), "--json", str(tmp_path / "r.json")]) == 0
    captured = capsys.readouterr()
    assert (
        "10 shards: shards-000000.tar 2," in captured.out and ", ... and 2 more (see the JSON report)" in captured.out
    )
    assert re.search(r"read shards: 100%.*10/10.*samples=20", captured.err), captured.err
    assert len(json.loads((tmp_path / "r.json").read_text())["shards"]) == 10
    assert main(["validate-data", str(tmp_path), "--no-progress", "--json", str(tmp_path / "r.json")]) == 0
    assert "read shards" not in capsys.readouterr().err


@pytest.mark.parametrize("draft", [True, False])
def test_streams_decode_as_the_map_style_loader_does(tmp_path, monkeypatch, draft):
    """data.jpeg_draft and data.max_image_pixels apply to webdataset shards too (decoded in this process here)."""
    from sharpclip.data import stream

    img2dataset(tmp_path, shards=1, per_shard=4)
    calls = []
    load = stream.load_image
    monkeypatch.setattr(stream, "load_image", lambda src, *a: calls.append(a) or load(src, *a))
    loader = build_loader(cfg(tmp_path, num_workers=0, jpeg_draft=draft, max_image_pixels=1000), "train", PREP,
                          batch_size=2)  # fmt: skip
    assert len(next(iter(loader))) == 2
    size = PREP.image.size
    assert calls and set(calls) == {(size if draft else None, 1000)}
    with pytest.raises(BadSampleError, match="pixels"):  # 10 × 8 = 80 pixels > 79: every sample is refused
        next(iter(build_loader(cfg(tmp_path, num_workers=0, max_image_pixels=79), "train", PREP, batch_size=2)))
