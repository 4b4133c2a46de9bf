"""Run directories: a fresh run refuses a non-empty directory, --overwrite empties only a run directory and only what
a run writes, pruning keeps the newest and the best, keep_last >= 1, and an atomic flock-held lock keeps a second run
out (a stale one is taken over, 50 simultaneous starts let one in)."""

from __future__ import annotations

import fcntl
import json
import logging
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _support.tiny_files import tiny_config, write_generic
from sharpclip.config import ConfigError, load_config
from sharpclip.models.factory import CHECKPOINT_CONFIG, WEIGHTS, run_checkpoint
from sharpclip.train import checkpoint
from sharpclip.train.resume import load_resume_config
from sharpclip.train.run import run_train
from sharpclip.train.run_dir import (
    LOCK,
    MARKER,
    STALE_COPY_SECONDS,
    RunDirError,
    RunLock,
    contents,
    open_run_dir,
)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_generic(tmp_path_factory.mktemp("data"))


def _steps(run: Path) -> list[int]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records if "loss" in r]


def _fake_old_run(run: Path, steps: tuple[int, ...]) -> None:
    """What an older, longer run leaves behind: higher-numbered checkpoints, its config and metrics."""
    for step in steps:
        folder = run / "checkpoints" / checkpoint.checkpoint_name(step)
        folder.mkdir(parents=True)
        (folder / checkpoint.TRAINER_STATE).write_text(json.dumps({"step": step, "loader": {}}))
    (run / "config.yaml").write_text("train:\n  seed: 123\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 50, "loss": 1.0}) + "\n")


def test_a_fresh_run_refuses_a_non_empty_directory_and_says_how_to_go_on(data, tmp_path):
    run = tmp_path / "run"
    _fake_old_run(run, (40, 50))
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    with pytest.raises(RunDirError, match=r"not empty.*--resume.*--overwrite"):
        run_train(tiny_config(data, run))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before  # nothing touched
    assert (run / "config.yaml").read_text() == "train:\n  seed: 123\n"
    assert not (run / LOCK).exists()


def test_overwrite_empties_the_old_run_so_the_new_one_keeps_its_checkpoints(data, tmp_path):
    run = tmp_path / "run"
    _fake_old_run(run, (40, 50))
    state = run_train(tiny_config(data, run, "train.keep_last=1"), overwrite=True)
    assert state.step == 2
    ckpts = run / "checkpoints"
    names = [p.name for p in checkpoint.all_checkpoints(ckpts)]
    assert "step-000002" in names and not any(n in names for n in ("step-000040", "step-000050"))
    assert checkpoint.best(ckpts).is_dir()  # best.json names a folder that exists
    assert _steps(run) == [1, 2]  # metrics.jsonl holds this run only
    assert load_config(run / "config.yaml").train.seed == 0


def test_overwrite_refuses_a_folder_that_is_not_a_run_directory(data, tmp_path):
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "holiday.jpg").write_bytes(b"not a run")
    with pytest.raises(RunDirError, match="not a sharpclip run directory"):
        run_train(tiny_config(data, folder), overwrite=True)
    assert (folder / "holiday.jpg").is_file()


def test_a_run_that_fails_to_start_leaves_its_new_directory_empty(data, tmp_path):
    run = tmp_path / "run"
    with pytest.raises(ConfigError):
        run_train(tiny_config(data, run, "data.eval_split=nosuchsplit"))
    assert not run.exists() or not list(run.iterdir())
    assert run_train(tiny_config(data, run)).step == 2  # so trying again needs no --overwrite


def _fake_checkpoints(directory: Path, steps: tuple[int, ...]) -> list[Path]:
    paths = []
    for step in steps:
        folder = directory / checkpoint.checkpoint_name(step)
        folder.mkdir(parents=True)
        (folder / checkpoint.TRAINER_STATE).write_text("{}")
        paths.append(folder)
    return paths


def test_prune_keeps_the_checkpoint_just_written_and_the_best_even_beside_higher_steps(tmp_path):
    old_best, old_newest, written = _fake_checkpoints(tmp_path, (10, 90, 2))
    checkpoint.mark_best(tmp_path, old_best, 0.5)
    checkpoint.prune(tmp_path, keep_last=1, keep=(written,))
    assert written.is_dir() and old_best.is_dir() and old_newest.is_dir()  # newest by number, just written, best
    checkpoint.mark_best(tmp_path, written, 0.9)
    checkpoint.prune(tmp_path, keep_last=1, keep=(written,))
    assert written.is_dir() and old_newest.is_dir() and not old_best.exists()


def test_checkpoints_past_step_999999_are_the_newest_for_resume_pruning_and_model_name(tmp_path):
    """Names are padded to 6 digits: step-1000000 sorted before step-999999 by name, so a resume would take the
    older one as the newest (and cut the logs back to it), and pruning would delete the newer ones."""
    older, newer = _fake_checkpoints(tmp_path / "checkpoints", (999_999, 1_000_000))
    assert checkpoint.latest(tmp_path / "checkpoints") == newer
    checkpoint.prune(tmp_path / "checkpoints", keep_last=1)
    assert newer.is_dir() and not older.exists()
    for folder in (newer, newer.with_name(checkpoint.checkpoint_name(999_998))):
        folder.mkdir(exist_ok=True)
        (folder / CHECKPOINT_CONFIG).write_text("{}")
        (folder / WEIGHTS).write_bytes(b"")
    assert run_checkpoint(tmp_path) == newer


@pytest.mark.parametrize("keep_last", [0, -1])
def test_keep_last_below_one_is_refused(keep_last, tmp_path):
    with pytest.raises(ConfigError, match=r"train\.keep_last"):
        load_config(None, [f"train.keep_last={keep_last}"])
    (only,) = _fake_checkpoints(tmp_path, (3,))
    with pytest.raises(ValueError, match="keep_last"):
        checkpoint.prune(tmp_path, keep_last)
    assert only.is_dir()


def _hold_lock(run: str, ready, stop) -> None:
    RunLock(Path(run)).acquire()
    ready.set()
    stop.wait(60)


@pytest.fixture
def live_holder(tmp_path):
    """A live process holding `tmp_path/run`'s lock (its flock); yields its pid."""
    ctx = multiprocessing.get_context("fork")
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_hold_lock, args=(str(tmp_path / "run"), ready, stop))
    proc.start()
    assert ready.wait(30)
    yield proc.pid
    stop.set()
    proc.join(30)


def _write_lock(run: Path, pid: int) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": pid}))


def test_a_second_training_into_a_locked_directory_names_the_pid(data, tmp_path, live_holder):
    run = tmp_path / "run"
    with pytest.raises(RunDirError, match=f"pid {live_holder}"):
        run_train(tiny_config(data, run))
    assert json.loads((run / LOCK).read_text())["pid"] == live_holder  # the holder's lock is left alone
    with pytest.raises(RunDirError, match=f"pid {live_holder}"):
        RunLock(run).acquire()


def test_a_stale_lock_is_taken_over_with_a_warning(data, tmp_path, caplog):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # its pid is now free
    run = tmp_path / "run"
    _write_lock(run, proc.pid)
    with caplog.at_level(logging.WARNING, logger="sharpclip.train"):
        assert run_train(tiny_config(data, run)).step == 2
    assert any("stale lock" in r.getMessage() and str(proc.pid) in r.getMessage() for r in caplog.records)
    assert not (run / LOCK).exists()  # released when the run ended


def test_a_lock_naming_a_live_pid_whose_flock_is_free_is_taken_over(tmp_path, caplog):
    """A container's entrypoint is pid 1 in every run: the dead run's pid is alive again, its flock is not."""
    run = tmp_path / "run"
    _write_lock(run, 1)
    with caplog.at_level(logging.WARNING, logger="sharpclip.train"):
        lock = RunLock(run).acquire()
    assert json.loads((run / LOCK).read_text())["pid"] == os.getpid()
    assert any("stale lock" in r.getMessage() for r in caplog.records)
    lock.release()
    assert not (run / LOCK).exists()


def test_taking_the_lock_deletes_the_temporary_copies_killed_writers_left_but_not_a_live_or_young_one(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    dead, young, live = (run / f"{LOCK}.{pid}.0badc0de" for pid in (11, 12, 13))
    for copy in (dead, young, live):
        copy.write_text(json.dumps({"host": socket.gethostname(), "pid": 1}))
    old = time.time() - 2 * STALE_COPY_SECONDS
    for copy in (dead, live):
        os.utime(copy, (old, old))
    held = os.open(live, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a process still starting holds its copy
    try:
        lock = RunLock(run).acquire()
        assert not dead.exists() and young.exists() and live.exists()
        lock.release()
    finally:
        os.close(held)


@pytest.mark.parametrize("text", ["", '{"pid": '])
def test_an_unreadable_lock_is_treated_as_live(tmp_path, text):
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK).write_text(text)
    with pytest.raises(RunDirError, match="unreadable"):
        RunLock(run).acquire()
    assert (run / LOCK).read_text() == text


def _race(run: str, barrier, results) -> None:
    barrier.wait(60)
    try:
        lock = open_run_dir(run, "fresh")
    except RunDirError as err:
        results.put(("refused", str(err)))
        return
    results.put(("took", os.getpid()))
    time.sleep(0.3)  # as a run would: it holds the folder while it trains
    lock.release()


def test_fifty_simultaneous_starts_into_one_folder_let_exactly_one_in(tmp_path):
    ctx = multiprocessing.get_context("fork")
    run, barrier, results = str(tmp_path / "run"), ctx.Barrier(50), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(run, barrier, results)) for _ in range(50)]
    for proc in procs:
        proc.start()
    outcomes = [results.get(timeout=60) for _ in procs]
    for proc in procs:
        proc.join(30)
    took = [o for o in outcomes if o[0] == "took"]
    assert len(took) == 1, took
    assert all("in use" in o[1] or "not empty" in o[1] for o in outcomes if o[0] == "refused")
    assert contents(Path(run)) == [MARKER] and not list(Path(run).glob(LOCK + "*"))


def _project(folder: Path) -> None:
    """A user's project that happens to have a config.yaml."""
    (folder / "src").mkdir(parents=True)
    (folder / "src" / "main.py").write_text("print('mine')\n")
    (folder / "README.md").write_text("# my project\n")
    (folder / "config.yaml").write_text("train:\n  lr: 0.1\n")


def test_a_project_folder_with_a_config_yaml_is_not_a_run_directory(data, tmp_path):
    folder = tmp_path / "project"
    _project(folder)
    with pytest.raises(RunDirError) as fresh:
        run_train(tiny_config(data, folder))
    assert "not a sharpclip run directory" in str(fresh.value) and "--overwrite" not in str(fresh.value)
    with pytest.raises(RunDirError, match="not a sharpclip run directory"):
        run_train(tiny_config(data, folder), overwrite=True)
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "config.yaml", "src"]
    assert (folder / "src" / "main.py").read_text() == "print('mine')\n"


def test_overwrite_refuses_a_run_directory_that_also_holds_other_files_and_names_them(data, tmp_path):
    run = tmp_path / "run"
    _fake_old_run(run, (40,))
    (run / "thesis.tex").write_text("years of work")
    (run / "checkpoints" / "notes.txt").write_text("mine")
    with pytest.raises(RunDirError, match="--resume") as fresh:
        run_train(tiny_config(data, run))
    assert "--overwrite" not in str(fresh.value)  # it would refuse: not suggested
    with pytest.raises(RunDirError, match=r"checkpoints/notes\.txt, thesis\.tex"):
        run_train(tiny_config(data, run), overwrite=True)
    assert (run / "thesis.tex").is_file() and (run / "checkpoints" / "step-000040").is_dir()


def _sink_folders(run: Path) -> None:
    """What TensorBoard's SummaryWriter and wandb (dir=RUN) leave in a run directory."""
    (run / "tensorboard" / "1700000000.123").mkdir(parents=True)  # add_hparams' sub-folder
    (run / "tensorboard" / "events.out.tfevents.1700000000.host.1.0").write_bytes(b"\x00events")
    (run / "tensorboard" / "1700000000.123" / "events.out.tfevents.1700000001.host.1.1").write_bytes(b"\x00")
    (run / "wandb" / "run-20261205_040000-abc123" / "files").mkdir(parents=True)
    (run / "wandb" / "run-20261205_040000-abc123" / "files" / "config.yaml").write_text("wandb_version: 1\n")
    (run / "wandb" / "latest-run").symlink_to("run-20261205_040000-abc123")
    (run / "wandb" / "debug.log").write_text("log\n")


@pytest.mark.parametrize("mine", ["tensorboard/my_notes.txt", "tensorboard/1700000000.123/plot.png",
                                  "wandb/analysis.ipynb"])  # fmt: skip
def test_overwrite_keeps_a_users_file_among_the_sinks_folders_and_names_it(data, tmp_path, mine):
    """tensorboard/ and wandb/ hold what those sinks write (event files, wandb's run folders and logs); a user's
    file beside them makes --overwrite refuse, naming it, and nothing is deleted."""
    run = tmp_path / "run"
    _fake_old_run(run, (40,))
    _sink_folders(run)
    user = run / mine
    user.write_text("mine")
    with pytest.raises(RunDirError, match=re.escape(mine)):
        run_train(tiny_config(data, run), overwrite=True)
    assert user.read_text() == "mine" and (run / "tensorboard" / "events.out.tfevents.1700000000.host.1.0").is_file()


def test_overwrite_removes_the_sinks_folders_when_they_hold_only_the_sinks_files(data, tmp_path):
    run = tmp_path / "run"
    _fake_old_run(run, (40,))
    _sink_folders(run)
    assert run_train(tiny_config(data, run), overwrite=True).step == 2
    assert not (run / "tensorboard").exists() and not (run / "wandb").exists()


def test_a_run_killed_during_start_up_is_started_again_with_overwrite(data, tmp_path):
    run = tmp_path / "run"
    lock = open_run_dir(run, "fresh")  # what a run does first; then it is killed while loading the model
    (run / "train.log").write_text("12:00:00 INFO world size 1\n")
    os.close(lock._fd)  # the kill: the flock goes, the lock file stays
    with pytest.raises(RunDirError, match="--overwrite"):
        run_train(tiny_config(data, run))
    with pytest.raises(ConfigError, match="start it again with --overwrite"):
        load_resume_config(run)
    assert run_train(tiny_config(data, run), overwrite=True).step == 2


def test_an_unreadable_best_json_does_not_stop_pruning(tmp_path, caplog):
    old, new = _fake_checkpoints(tmp_path, (1, 2))
    (tmp_path / checkpoint.BEST).write_text('{"name": ')  # a crash while writing it by hand, a bad copy
    with caplog.at_level(logging.WARNING, logger="sharpclip.train"):
        checkpoint.prune(tmp_path, keep_last=1, keep=(new,))
    assert new.is_dir() and not old.exists()
    assert any("best.json" in r.getMessage() for r in caplog.records)


def test_pruning_skips_and_names_linked_and_foreign_checkpoints_and_prunes_the_rest(data, tmp_path, capsys):
    """A symlinked oldest checkpoint (its target holds a trainer_state.json, as a copied checkpoint does) and a
    foreign folder among the checkpoints: the resume trains, prunes its own old checkpoints and touches neither."""
    from sharpclip.cli import main

    run = tmp_path / "run"
    run_train(tiny_config(data, run, "train.eval_every=0"))  # step-1, step-2; no best to keep
    user = tmp_path / "user-files"
    user.mkdir()
    (user / "keep.txt").write_text("mine")
    (user / checkpoint.TRAINER_STATE).write_text("{}")
    ckpts = run / "checkpoints"
    (ckpts / "step-000000").symlink_to(user, target_is_directory=True)
    foreign = ckpts / "step-backup"
    foreign.mkdir()
    (foreign / checkpoint.TRAINER_STATE).write_text("{}")
    (ckpts / "notes").mkdir()
    assert main(["train", "--resume", str(run), "train.max_steps=4", "train.keep_last=1"]) == 0
    err = capsys.readouterr().err
    assert "step-000000" in err and "step-backup" in err and "symbolic link" in err
    assert (ckpts / "step-000000").is_symlink() and (user / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in user.iterdir()) == ["keep.txt", checkpoint.TRAINER_STATE]
    assert foreign.is_dir() and (ckpts / "notes").is_dir()
    assert sorted(p.name for p in ckpts.iterdir()) == ["notes", "step-000000", "step-000004", "step-backup"]
    assert checkpoint.latest(ckpts) == ckpts / "step-000004"  # a link is never taken for the run's own checkpoint


def test_a_link_where_a_checkpoint_is_written_is_refused_naming_it(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "ckpts").mkdir()
    (tmp_path / "ckpts" / checkpoint.checkpoint_name(3)).symlink_to(target, target_is_directory=True)
    with pytest.raises(checkpoint.CheckpointError, match=r"step-000003.*symbolic link"):
        checkpoint.save(tmp_path / "ckpts", 3, lambda d: None, {}, {})
    assert target.is_dir() and not any(target.iterdir())
