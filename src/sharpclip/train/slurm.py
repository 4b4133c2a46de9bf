"""Ranks started by SLURM's `srun` without torchrun: the process group's environment read from SLURM's own.

torchrun gives each rank RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT. `srun` with one task per GPU
gives SLURM_PROCID (the rank), SLURM_LOCALID (the rank on its node), SLURM_STEP_NUM_TASKS / SLURM_NTASKS (the
number of ranks) and the step's node list. When RANK and WORLD_SIZE are absent and a task of several is running
under srun, `adopt` sets torch's variables from these: the rendezvous host is the first node of the step
(SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST) and the port MASTER_PORT if set, else one derived from the job id
(`PORT_BASE` + job id mod `PORT_SPAN`), so two jobs sharing a node do not meet on one port. Variables already set
are never changed.
"""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping

PORT_BASE, PORT_SPAN = 20000, 20000
NODE = re.compile(r"^([^,\[]+)(?:\[([^\]]+)\])?")  # "gpu[003-004,010],cpu01" → "gpu", "003-004,010"


def first_node(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[003-004,010],cpu01' → 'gpu003'; 'node7' → 'node7'."""
    found = NODE.match(nodelist.strip())
    if found is None:
        raise ValueError(f"cannot read the SLURM node list {nodelist!r}; set MASTER_ADDR to the first node's name")
    prefix, ranges = found.groups()
    return prefix + (ranges.split(",")[0].split("-")[0] if ranges else "")


def launch_env(environ: MutableMapping[str, str]) -> dict[str, str]:
    """The torch variables to add for a task that srun started (empty when torchrun's are there or not srun's)."""
    if "RANK" in environ or "WORLD_SIZE" in environ or "SLURM_PROCID" not in environ:
        return {}
    world = environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS")
    if "SLURM_LOCALID" not in environ or not world or int(world) < 2:
        return {}
    nodes = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or "127.0.0.1"
    port = PORT_BASE + int(environ.get("SLURM_JOB_ID", "0") or 0) % PORT_SPAN
    found = {"RANK": environ["SLURM_PROCID"], "WORLD_SIZE": world, "LOCAL_RANK": environ["SLURM_LOCALID"],
             "MASTER_ADDR": environ.get("MASTER_ADDR") or first_node(nodes),
             "MASTER_PORT": environ.get("MASTER_PORT") or str(port)}  # fmt: skip
    return {k: v for k, v in found.items() if k not in environ}


class NotAStepTask(ValueError):
    """A process of a several-task SLURM allocation that srun did not start: its peers will never come."""


def check_step(environ: MutableMapping[str, str]) -> None:
    """Refuse, in one line naming srun, a process that SLURM's variables make one rank of several when no srun
    step started it: the batch script's own process (SLURM_NTASKS > 1, no SLURM_STEP_NUM_TASKS) or a one-task step
    of a larger allocation. It would otherwise wait train.dist_timeout_min (60 minutes) for ranks never started."""
    if "RANK" in environ or "WORLD_SIZE" in environ or "SLURM_JOB_ID" not in environ:
        return
    tasks, step = environ.get("SLURM_NTASKS", ""), environ.get("SLURM_STEP_NUM_TASKS")
    if not tasks.isdigit() or int(tasks) < 2 or (step is not None and step != "1"):
        return
    where = "outside any srun step (no SLURM_STEP_NUM_TASKS)" if step is None else "in a one-task srun step"
    raise NotAStepTask(
        f"SLURM_NTASKS={tasks} but this process runs {where}: its {int(tasks) - 1} other ranks will never start. "
        "Start every rank with srun (`srun python -m sharpclip train ...`, as examples/slurm/train.sbatch does) or "
        "one torchrun per node under srun; for one process, submit with --ntasks=1"
    )


def adopt(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set torch's process-group variables from SLURM's when srun started this task without torchrun; whether any
    was set. A process srun did not start, in an allocation of several tasks, is refused (`check_step`)."""
    environ = os.environ if environ is None else environ
    check_step(environ)
    found = launch_env(environ)
    environ.update(found)
    return bool(found)
