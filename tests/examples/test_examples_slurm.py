"""The SLURM batch script (examples/slurm/train.sbatch) survives a stop before the time limit: run as sbatch would
run it, with stand-ins for `srun` (2 tasks on this host, signals passed on, SLURM_PROCID / SLURM_LOCALID set as srun
sets them) and `scontrol` (records the requeue). USR1 to the script mid-run (SLURM's `--signal=B:USR1@...`): every
rank stops after a step with a checkpoint, exit 75, the job is requeued; the requeued job (the same command)
finishes the run; a third run says it has finished, exits 0 and asks for no requeue. The final weights equal those
of the script run without a stop. Also: SLURM's variables alone start the process group (train.slurm)."""

from __future__ import annotations

import os
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

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "slurm" / "train.sbatch"
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
SCONTROL = '#!/bin/bash\necho "$@" >> "$SCONTROL_LOG"\n'


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


def _env(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    if not bin_dir.is_dir():
        bin_dir.mkdir()
        for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
    path = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    return {**env, "PATH": path, "OMP_NUM_THREADS": "1", "SLURM_JOB_ID": "77", "SLURM_NTASKS": "2",
            "SLURM_CPUS_PER_TASK": "1", "SLURM_JOB_NODELIST": "localhost", "MASTER_PORT": str(_free_port()),
            "SCONTROL_LOG": str(tmp_path / "scontrol.log")}  # fmt: skip


def _args(data: Path, run: Path) -> list[str]:
    return ["bash", str(SCRIPT), "model.name=tiny-clip", "data.format=generic", f"data.root={data}",
            "data.num_workers=0", f"train.output_dir={run}", "train.device=cpu", "train.batch_size=4",
            "train.micro_batch_size=2", "train.max_steps=8", "train.epochs=2", "train.eval_every=0",
            "train.checkpoint_every=2", "train.keep_last=10", "train.log_every=0"]  # fmt: skip


def _requeues(tmp_path: Path) -> list[str]:
    log = tmp_path / "scontrol.log"
    return log.read_text().splitlines() if log.is_file() else []


@pytest.mark.slow
def test_the_batch_script_stopped_requeued_and_run_again_ends_at_the_uninterrupted_weights(tmp_path):
    data = write_generic(tmp_path / "data", n=16)  # 4 steps an epoch
    ref, run = tmp_path / "ref", tmp_path / "run"
    done = subprocess.run(_args(data, ref), capture_output=True, text=True, env=_env(tmp_path), timeout=LIMIT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _requeues(tmp_path) == []

    env = {**_env(tmp_path), "SHARPCLIP_DELAY": "step:2:5"}  # every rank pauses after saving step 2
    job = subprocess.Popen(_args(data, run), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + LIMIT
    while not (run / "checkpoints" / "step-000002").is_dir() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    job.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@300 sends the batch script before the time limit
    # every rank finishes the step it is in (3, mid-epoch), writes its checkpoint and exits 75
    out, err = job.communicate(timeout=LIMIT)
    assert job.returncode == 75, err[-3000:]
    assert "stopped by a signal after step 3; checkpoint step-000003 written" in out
    assert _requeues(tmp_path) == ["requeue 77"]
    assert not (run / "checkpoints" / "step-000004").exists()

    again = subprocess.run(_args(data, run), capture_output=True, text=True, env=_env(tmp_path), timeout=LIMIT)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "trained 8 steps" in again.stdout
    final = subprocess.run(_args(data, run), capture_output=True, text=True, env=_env(tmp_path), timeout=LIMIT)
    assert final.returncode == 0 and f"{run} already finished at step 8" in final.stdout
    assert _requeues(tmp_path) == ["requeue 77"]  # neither later run asked for another

    weights = load_file(run / "checkpoints" / "step-000008" / "model.safetensors")
    expected = load_file(ref / "checkpoints" / "step-000008" / "model.safetensors")
    assert weights.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(weights[key], value), key
