"""Ranks a scheduler starts without torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; no agent):
ranks given different settings are refused before step 1 on every rank, naming the keys; a MASTER_PORT another
program holds is one line on each rank within `train.dist_timeout_min` (no traceback, no silent wait); and when
rank 0, the store's host, is SIGKILLed, rank 1's stderr holds its one line and none of torch's C++ stack dumps.
Two gloo processes of `sharpclip train` per case, each launch bounded by LIMIT."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from _support.tiny_files import write_generic
from sharpclip.config import load_config
from sharpclip.train.rank_agreement import PER_RANK, check_same_config, compared, differences, digest

LIMIT = 240  # seconds per launch: a healthy run takes a fraction; a hang fails the test instead of the CI
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _train_args(data: Path, out: Path, *extra: str, timeout_min: float = 5) -> list[str]:
    return ["-m", "sharpclip", "train", "model.name=tiny-clip", "data.format=generic", f"data.root={data}",
            "data.num_workers=0", f"train.output_dir={out}", "train.device=cpu", "train.batch_size=4",
            "train.micro_batch_size=2", "train.max_steps=4", "train.epochs=2", "train.eval_every=0",
            "train.checkpoint_every=1", "train.progress=false", f"train.dist_timeout_min={timeout_min}",
            *extra]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(port: int, args: list[list[str]], env: list[dict] | None = None) -> list[tuple[int, str]]:
    """Start rank 0 and rank 1 with their own words; (exit status, stderr) of each."""
    procs = []
    for rank, words in enumerate(args):
        extra = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port), **(env[rank] if env else {})}  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, *words], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env={**ENV, **extra}))  # fmt: skip
    errs = [p.communicate(timeout=LIMIT)[1] for p in procs]
    return [(p.returncode, err) for p, err in zip(procs, errs, strict=True)]


def _own_lines(err: str) -> list[str]:
    """stderr without the run's log lines (HH:MM:SS LEVEL ...)."""
    return [line for line in err.splitlines() if line.strip() and not line[:2].isdigit()]


def test_the_compared_settings_leave_out_only_the_per_rank_keys():
    a, b = load_config(None, ["train.lr=1e-5"]), load_config(None, ["train.lr=1e-2", "train.progress=false"])
    assert set(PER_RANK) == {"train.progress", "eval.progress", "train.output_dir"}
    assert "train.device" in compared(a) and "train.lr" in compared(a) and "train.output_dir" not in compared(a)
    assert differences([compared(a), compared(b)]) == "train.lr (1e-05 on rank 0, 0.01 on rank 1)"
    check_same_config(a, lambda value: [value, value])  # one config on both "ranks"

    def two_ranks(value):  # rank 1 holds `b`: its digest, then (on a mismatch) its settings as JSON
        theirs = compared(b)
        other = digest(theirs) if len(value) == 64 else json.dumps(theirs, sort_keys=True, default=repr)
        return [value, other]

    with pytest.raises(ValueError, match=r"different settings: train\.lr \(1e-05 on rank 0, 0\.01 on rank 1\);"):
        check_same_config(a, two_ranks)


@pytest.mark.parametrize(
    ("rank0", "rank1"),
    [
        ("data.root=~/data", "data.root=HOME/data/"),  # `~` on one rank, the absolute path with a `/` on the other
        ("data.root=/srv/d", "data.root=/srv/./x/../d"),
        ("data.shards=[/srv/s/a.tar]", "data.shards=[/srv/s//a.tar]"),
        ("eval.roots={docci: /srv/docci/}", "eval.roots={docci: /srv/docci}"),
    ],
)
def test_ranks_naming_one_folder_in_two_spellings_agree(rank0, rank1):
    home = os.path.expanduser("~")
    a, b = load_config(None, [rank0]), load_config(None, [rank1.replace("HOME", home)])
    assert digest(compared(a)) == digest(compared(b)), differences([compared(a), compared(b)])
    elsewhere = load_config(None, [rank0, "data.root=/srv/elsewhere/"])
    assert "data.root" in differences([compared(a), compared(elsewhere)])


def test_a_store_whose_host_ended_is_found_unreachable_without_a_store_call(monkeypatch, capfd):
    import gc

    import torch.distributed as dist

    from sharpclip.train.rendezvous import store_reachable

    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    host = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    client = dist.PrefixStore("run", dist.TCPStore("127.0.0.1", host.port, 2, is_master=False))
    assert store_reachable(client) and store_reachable(dist.HashStore())  # not a TCP store: nothing to ask
    del host
    gc.collect()  # the host's server ends with it
    deadline = time.monotonic() + 10
    while store_reachable(client) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not store_reachable(client)
    assert "frame #" not in capfd.readouterr().err  # found without a call on the dead store
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # torchrun: its launcher hosts the store
    assert store_reachable(client)


def test_only_what_is_written_inside_the_silenced_block_is_dropped(capfd):
    from sharpclip.train.rendezvous import c10d_stderr_silenced

    os.write(2, b"before\n")
    with c10d_stderr_silenced():
        os.write(2, b"[W TCPStore.cpp:115] frame #0: dump\n")  # as torch's C++ writes it
    print("after", file=sys.stderr)
    assert capfd.readouterr().err == "before\nafter\n"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("setting", "key"), [("train.lr=1e-2", "train.lr"), ("train.batch_size=8", "train.batch_size")]
)
def test_ranks_started_with_different_settings_are_refused_on_every_rank_before_step_1(tmp_path, setting, key):
    data = write_generic(tmp_path / "data")
    run = tmp_path / "run"
    results = _launch(_free_port(), [_train_args(data, run), _train_args(data, run, setting)])
    for rank, (status, err) in enumerate(results):
        lines = _own_lines(err)
        assert status == 2 and len(lines) == 1 and "Traceback" not in err, f"rank {rank}: {err[-3000:]}"
        assert "ranks were started with different settings" in lines[0] and f"{key} (" in lines[0], lines
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()


@pytest.mark.slow
def test_a_master_port_in_use_is_one_line_on_each_rank_and_rank_1_does_not_wait_past_its_timeout(tmp_path):
    """Another program listens on MASTER_PORT: rank 0 cannot host the store there, rank 1 connects to that program
    and gets no answer; train.dist_timeout_min=0.25 bounds rank 1's wait."""
    data = write_generic(tmp_path / "data")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(5)
        port = listener.getsockname()[1]
        results = _launch(port, [_train_args(data, tmp_path / "run", timeout_min=0.25)] * 2)
    (status0, err0), (status1, err1) = results
    assert status0 == 2 and _own_lines(err0) == [line for line in _own_lines(err0) if "sharpclip train:" in line]
    assert len(_own_lines(err0)) == 1 and f"127.0.0.1:{port}" in err0 and "already in use" in err0, err0
    assert status1 == 2 and len(_own_lines(err1)) == 1 and "Traceback" not in err0 + err1, err1
    assert "could not join the process group within 0.25 min" in err1 and f"127.0.0.1:{port}" in err1


@pytest.mark.slow
def test_rank_1s_stderr_holds_one_line_and_no_stack_dump_when_rank_0_is_killed(tmp_path):
    """SIGKILL of rank 0 (the store's host) at step 2 (SHARPCLIP_FAULT, rank 0's environment only)."""
    data = write_generic(tmp_path / "data")
    run = tmp_path / "run"
    start = time.monotonic()
    results = _launch(_free_port(), [_train_args(data, run)] * 2, env=[{"SHARPCLIP_FAULT": "step:2"}, {}])
    (status0, _), (status1, err1) = results
    assert status0 == -9 and status1 != 0 and time.monotonic() - start < LIMIT
    lines = _own_lines(err1)
    assert "frame #" not in err1 and "TCPStore" not in err1 and "Traceback" not in err1, err1
    assert len(lines) == 1 and lines[0].startswith("sharpclip: rank 1 "), err1


def _distill_args(captions: Path, tmp_path: Path, *extra: str) -> list[str]:
    return ["-m", "sharpclip", "distill", "model.name=tiny-clip", f"--captions={captions}", f"--to={tmp_path / 'st'}",
            f"train.output_dir={tmp_path / 'run'}", "train.device=cpu", "train.batch_size=4",
            "train.micro_batch_size=2", "train.max_steps=2", "train.epochs=1", "train.eval_every=0",
            "train.progress=false", "train.dist_timeout_min=5", *extra]  # fmt: skip


@pytest.mark.slow
def test_distill_ranks_started_with_different_settings_or_captions_are_refused_on_every_rank(tmp_path):
    """`sharpclip distill` joined the process group without the ranks' agreement: rank 1's own train.lr (or its own
    captions file) trained silently."""
    captions, other = tmp_path / "captions.txt", tmp_path / "other.txt"
    captions.write_text("".join(f"a red square number {i} beside a blue circle\n" for i in range(40)))
    other.write_text("".join(f"a green triangle number {i}\n" for i in range(40)))
    for rank1, expect in [((captions, "train.lr=1e-2"), "train.lr ("), ((other,), "different --captions")]:
        results = _launch(_free_port(), [_distill_args(captions, tmp_path), _distill_args(*rank1[:1], tmp_path,
                                                                                          *rank1[1:])])  # fmt: skip
        for rank, (status, err) in enumerate(results):
            lines = _own_lines(err)
            assert status == 2 and len(lines) == 1 and "Traceback" not in err, f"rank {rank}: {err[-3000:]}"
            assert expect in lines[0], lines
        assert not (tmp_path / "st").exists() and not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_rank_1_answered_by_another_program_on_its_port_prints_one_line_and_no_stack_dump(tmp_path):
    """Rank 1 given a MASTER_PORT where another program answers (an HTTP server or proxy): each retry of torch's store
    client printed a C++ stack dump, 99 lines and 70 `frame #` before the one line; rank 0 waits for it alone."""
    data = write_generic(tmp_path / "data")
    with socket.socket() as talker:
        talker.bind(("127.0.0.1", 0))
        talker.listen(50)
        stop = threading.Event()

        def answer() -> None:
            talker.settimeout(0.5)
            while not stop.is_set():
                with contextlib.suppress(OSError):
                    conn, _ = talker.accept()
                    with conn:
                        conn.recv(64)
                        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        try:
            args = [_train_args(data, tmp_path / "run", timeout_min=0.25)] * 2
            results = _launch(_free_port(), args, env=[{}, {"MASTER_PORT": str(talker.getsockname()[1])}])
        finally:
            stop.set()
            thread.join()
    for rank, (status, err) in enumerate(results):
        lines = _own_lines(err)
        assert status == 2 and len(lines) == 1 and "frame #" not in err and "Traceback" not in err, f"{rank}: {err}"
        assert f"rank {rank} could not join the process group within 0.25 min" in lines[0], lines


@pytest.mark.slow
def test_training_data_rank_0_cannot_read_ends_every_rank_with_its_one_line(tmp_path):
    """Rank 0 reads the training data first while the others wait (a generated corpus is written once): its error (a
    group of 5 rows, more than a rank's batch of 2) left rank 1 at the barrier, dying in the broken collective with a
    gloo traceback. Now rank 0 prints its line and rank 1 stops with nothing of its own to add."""
    data = write_generic(tmp_path / "data")
    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    for i, row in enumerate(rows):
        row["group"] = "big" if i < 5 else f"single-{i}"
    (data / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (status0, err0), (status1, err1) = _launch(_free_port(), [_train_args(data, tmp_path / "run")] * 2)
    assert (status0, status1) == (2, 2), err0[-2000:] + err1[-2000:]
    assert _own_lines(err0) == ["sharpclip train: a group has 5 rows but a batch holds 2 (train.batch_size 4 over 2 "
                                "ranks), and a group's rows share a batch; raise train.batch_size, or set "
                                "data.group_batches=false (--debug for the traceback)"]  # fmt: skip
    assert _own_lines(err1) == [] and "Traceback" not in err1 and "gloo" not in err1, err1
