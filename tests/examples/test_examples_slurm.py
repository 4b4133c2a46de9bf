"""The SLURM batch scripts (examples/slurm/train.sbatch, one task per rank; train_torchrun.sbatch, torchrun
--nproc_per_node from the allocation) survive a stop before the time limit and a preemption: run as sbatch would run
them, with stand-ins for `srun` (its tasks on this host, signals passed on, SLURM_PROCID / SLURM_LOCALID set as srun
sets them) and `scontrol` (answers `show hostnames`, records the requeue). USR1 to the script mid-run (SLURM's
`--signal=B:USR1@...`): every rank stops after a step with a checkpoint and the job is requeued; the requeued job
(the same command) is then preempted, SIGTERM to every process of the job (batch shell, srun, torchrun, ranks and
their DataLoader workers): the same again; the next job finishes the run; one more says it has finished, exits 0
and asks for no requeue. The final weights equal those of the script run without a stop. Also: SLURM's variables
alone start the process group (train.slurm)."""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _support.tiny_files import write_generic
from sharpclip.train.slurm import first_node, launch_env

SCRIPTS = Path(__file__).resolve().parents[2] / "examples" / "slurm"
LIMIT = 300  # seconds per script run
SRUN = """#!/bin/bash
# srun stand-in: the command as $SLURM_NTASKS tasks on this host; USR1 and TERM passed on to every task
while [[ "$1" == -* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
    SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_STEP_NUM_TASKS=$SLURM_NTASKS "$@" &
    pids+=($!)
done
got=0
trap 'got=1; kill -USR1 "${pids[@]}" 2>/dev/null' USR1
trap 'got=1; kill -TERM "${pids[@]}" 2>/dev/null' TERM
code=0
for p in "${pids[@]}"; do
    while :; do got=0; wait "$p"; c=$?; [ "$got" = 0 ] && break; done
    if [ "$c" -gt "$code" ]; then code=$c; fi
done
exit "$code"
"""
SCONTROL = '#!/bin/bash\nif [ "$1" = show ]; then echo localhost; exit 0; fi\necho "$@" >> "$SCONTROL_LOG"\n'


def test_the_first_node_of_a_slurm_node_list():
    assert first_node("gpu[003-004,010],cpu01") == "gpu003"
    assert first_node("node7,node8") == "node7"
    assert first_node("localhost") == "localhost"


def test_srun_variables_become_torchs_unless_torchrun_set_them():
    env = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "123456",
           "SLURM_JOB_NODELIST": "gpu[07-08]"}  # fmt: skip
    assert launch_env(env) == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "gpu07",
                               "MASTER_PORT": str(20000 + 123456 % 20000)}  # fmt: skip
    assert launch_env({**env, "RANK": "0", "WORLD_SIZE": "8"}) == {}  # torchrun's
    assert launch_env({**env, "SLURM_NTASKS": "1"}) == {}  # one task: no process group
    assert launch_env({k: v for k, v in env.items() if k != "SLURM_LOCALID"}) == {}  # not a task srun started
    assert "MASTER_PORT" not in launch_env({**env, "MASTER_PORT": "29400"})  # set already: left as it is


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job_id() -> int:
    """A job id whose derived port (20000 + id mod 20000, as both scripts derive it) is free here."""
    while True:
        job = random.randrange(1, 20000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 20000 + job))
                return job
            except OSError:
                continue


def _env(tmp_path: Path, job: int, tasks: int = 2) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    if not bin_dir.is_dir():
        bin_dir.mkdir()
        for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
    path = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    return {**env, "PATH": path, "OMP_NUM_THREADS": "1", "SLURM_JOB_ID": str(job), "SLURM_NTASKS": str(tasks),
            "SLURM_NNODES": "1", "SLURM_GPUS_ON_NODE": "2", "SLURM_CPUS_PER_TASK": "1",
            "SLURM_JOB_NODELIST": "localhost", "MASTER_PORT": str(_free_port()),
            "SCONTROL_LOG": str(tmp_path / "scontrol.log")}  # fmt: skip


def _args(script: str, data: Path, run: Path, *extra: str) -> list[str]:
    return ["bash", str(SCRIPTS / script), "model.name=tiny-clip", "data.format=generic", f"data.root={data}",
            "data.num_workers=0", f"train.output_dir={run}", "train.device=cpu", "train.batch_size=4",
            "train.micro_batch_size=2", "train.max_steps=8", "train.epochs=2", "train.eval_every=0",
            "train.checkpoint_every=2", "train.keep_last=10", "train.log_every=0", *extra]  # fmt: skip


def _requeues(tmp_path: Path) -> list[str]:
    log = tmp_path / "scontrol.log"
    return log.read_text().splitlines() if log.is_file() else []


def _job_processes(root: int) -> list[int]:
    """`root` and every process below it (what slurmstepd signals: a job's processes, whatever their session)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _stopped_job(args: list[str], env: dict, ready: Path, whole_job: bool) -> tuple[int, str, str]:
    """Run the batch script; once `ready` exists, USR1 to the script (the time limit's --signal=B:USR1) or SIGTERM to
    every process of the job (a preemption). Returns (status, stdout, stderr) once every process has ended."""
    job = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + LIMIT
    while not ready.is_dir() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = _job_processes(job.pid) if whole_job else [job.pid]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM if whole_job else signal.SIGUSR1)
    out, err = job.communicate(timeout=LIMIT)
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)  # a rank outliving its launcher would still hold the run
    return job.returncode, out, err


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The srun script's run of 8 steps on 2 ranks without a stop: its final weights."""
    tmp = tmp_path_factory.mktemp("slurm_ref")
    data, ref = write_generic(tmp / "data", n=16), tmp / "ref"  # 4 steps an epoch
    done = subprocess.run(_args("train.sbatch", data, ref), capture_output=True, text=True, env=_env(tmp, _job_id()),
                          timeout=LIMIT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert _requeues(tmp) == []
    return data, load_file(ref / "checkpoints" / "step-000008" / "model.safetensors")


def _ends_at(run: Path, expected: dict) -> None:
    weights = load_file(run / "checkpoints" / "step-000008" / "model.safetensors")
    assert weights.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=1e-6, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["train.sbatch", "train_torchrun.sbatch"])
def test_a_batch_script_signalled_preempted_and_requeued_ends_at_the_uninterrupted_weights(reference, tmp_path, script):
    data, expected = reference
    run, job = tmp_path / "run", _job_id()
    torchrun = script == "train_torchrun.sbatch"
    env = _env(tmp_path, job, tasks=1 if torchrun else 2)  # torchrun: one task, 2 ranks from SLURM_GPUS_ON_NODE
    ckpts = run / "checkpoints"
    # the time limit: every rank pauses after saving step 2; USR1 reaches them during step 3, which they finish
    code, out, err = _stopped_job(_args(script, data, run), {**env, "SHARPCLIP_DELAY": "step:2:5"},
                                  ckpts / "step-000002", whole_job=False)  # fmt: skip
    assert "stopped by a signal after step 3; checkpoint step-000003 written" in out, err[-3000:]
    assert code == (1 if torchrun else 75) and _requeues(tmp_path) == [f"requeue {job}"]
    assert not (ckpts / "step-000004").exists()
    # the requeued job, preempted: SIGTERM to every process, loader workers included (they ignore it)
    code, out, err = _stopped_job(
        _args(script, data, run, "data.num_workers=1"),
        {**env, "SHARPCLIP_DELAY": "step:4:5"},
        ckpts / "step-000004",
        whole_job=True,
    )
    # the stop is agreed at the epoch's end after step 4, or in step 5's agreement: a checkpoint of that step
    assert re.search(r"stopped by a signal after step ([45]); checkpoint step-00000\1 written", out), err[-3000:]
    assert "CheckpointException" not in err and "killed by signal" not in err
    assert code == (1 if torchrun else 75) and _requeues(tmp_path) == [f"requeue {job}"] * 2
    assert "requeueing" in out and ("with its checkpoint written" in out) != torchrun  # said only when known

    again = subprocess.run(_args(script, data, run), capture_output=True, text=True, env=env, timeout=LIMIT)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "trained 8 steps" in again.stdout
    final = subprocess.run(_args(script, data, run), capture_output=True, text=True, env=env, timeout=LIMIT)
    assert final.returncode == 0 and f"{run} already finished at step 8" in final.stdout
    assert _requeues(tmp_path) == [f"requeue {job}"] * 2  # neither later run asked for another
    _ends_at(run, expected)


@pytest.mark.parametrize("step", [None, "1"])
def test_a_rank_that_srun_did_not_start_says_so_at_once(tmp_path, monkeypatch, capsys, step):
    """A user's sbatch without srun: the batch shell's own process looks like rank 0 of SLURM_NTASKS and would wait
    train.dist_timeout_min (60 min) for peers that never start; it ends at once with one line naming srun."""
    from sharpclip.cli import main

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(key, raising=False)
    slurm = {"SLURM_JOB_ID": "6161", "SLURM_JOB_NODELIST": "localhost", "SLURM_NTASKS": "2", "SLURM_PROCID": "0",
             "SLURM_LOCALID": "0", **({"SLURM_STEP_NUM_TASKS": step} if step else {})}  # fmt: skip
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    assert main(["train", "model.name=tiny-clip", f"train.output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "SLURM_NTASKS=2" in err[0] and "srun" in err[0], err
    assert "RANK" not in os.environ and not (tmp_path / "run").exists()  # nothing started, nothing written
    assert launch_env({**slurm, "SLURM_STEP_NUM_TASKS": "2"})["WORLD_SIZE"] == "2"  # an srun step's task: a rank
