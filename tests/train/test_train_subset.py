"""A run on a training subset (data.train_fraction) records it in its run directory (train_subset.json: sizes, seed,
sha256 of the ids), resumes on the same subset, and refuses to resume when the split changed on disk."""

from __future__ import annotations

import json

import pytest

from _support.tiny_files import tiny_config, write_generic
from sharpclip.config import ConfigError
from sharpclip.data import read_samples
from sharpclip.data.subset import ids_digest, select_subset
from sharpclip.train.resume import load_resume_config
from sharpclip.train.run import SUBSET_RECORD, run_train


def test_the_subset_is_recorded_kept_on_resume_and_a_changed_split_refused(tmp_path):
    data = write_generic(tmp_path / "data", n=8)
    run = tmp_path / "run"
    cfg = tiny_config(data, run, "data.train_fraction=0.5", "data.subset_seed=3", "train.epochs=5")
    run_train(cfg)
    record = json.loads((run / SUBSET_RECORD).read_text())
    # independently: the 4 of 8 ids ranked first by sha256("3:id"), digested sorted
    want, _ = select_subset(read_samples(cfg.data, "train"), 0.5, seed=3)
    assert (record["selected"], record["total"], record["subset_seed"]) == (4, 8, 3)
    assert record["ids_sha256"] == ids_digest([s.id for s in want])
    trained = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # one batch of 4 an epoch (the subset; the whole split would make two): step 2 is the second epoch's
    assert [(r["step"], r["epoch"]) for r in trained if "loss" in r] == [(1, 0), (2, 1)]

    run_train(load_resume_config(run, [], ["train.max_steps=3"]), resume=run)
    assert json.loads((run / SUBSET_RECORD).read_text()) == record  # the same subset after the resume

    rows = (data / "train.jsonl").read_text().replace('"id": "train-', '"id": "renamed-')
    (data / "train.jsonl").write_text(rows)  # the split changed on disk: other ids, another subset
    with pytest.raises(ConfigError, match=r"the files under data\.root changed"):
        run_train(load_resume_config(run, [], ["train.max_steps=4"]), resume=run)


def test_a_run_on_the_whole_split_writes_no_subset_record(tmp_path):
    data = write_generic(tmp_path / "data", n=8)
    run_train(tiny_config(data, tmp_path / "run"))
    assert not (tmp_path / "run" / SUBSET_RECORD).exists()


def test_a_resume_reads_a_damaged_subset_record_as_one_error_naming_the_file(tmp_path):
    data = write_generic(tmp_path / "data", n=8)
    run = tmp_path / "run"
    run_train(tiny_config(data, run, "data.train_fraction=0.5", "train.epochs=2"))
    (run / SUBSET_RECORD).write_text('{"total": 0, "selected": 0}')
    with pytest.raises(ValueError, match=rf"{run / SUBSET_RECORD}: damaged training-subset record \(no 'fraction'\)"):
        run_train(load_resume_config(run, [], ["train.max_steps=3"]), resume=run)
