"""A sweep file: the settings of a study (HN-CLIP Fig. 6 / Table A9: fractions × objectives × seeds) as axes, each
value a name and the overrides that set it; task i of the study is the i-th combination (the last axis fastest), as a
SLURM array task reads it from `SLURM_ARRAY_TASK_ID` (examples/slurm/sweep.sbatch).

    root: runs/sweep                  # task i trains into root/<name of each axis's value, joined by _>
    axes:
      objective:
        infonce: ["loss.terms:={clip: {loss: infonce}}"]
        hn: ["loss.terms:={hn: {loss: hn_clip, params: {gamma: 0.5}}}"]
      fraction:
        f0.5: [data.train_fraction=0.5]
      seed:
        s0: [train.seed=0]
        s1: [train.seed=1]

`sharpclip sweep FILE` lists the tasks; `--task I` prints task I's overrides, one a line, `train.output_dir` last.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.+-]*$")  # a value's name: part of a folder name


@dataclass(frozen=True)
class Task:
    index: int
    name: str
    overrides: tuple[str, ...]  # the values' overrides in axis order, then train.output_dir=root/name


def _axes(file: Path, raw: object) -> dict[str, dict[str, list[str]]]:
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{file}: `axes` must map each axis to its values ({{name: [overrides]}})")
    axes: dict[str, dict[str, list[str]]] = {}
    for axis, values in raw.items():
        if not isinstance(values, dict) or not values:
            raise ValueError(f"{file}: axis {axis!r} must map each value's name to its list of overrides")
        for name, overrides in values.items():
            if not NAME.match(str(name)):
                raise ValueError(f"{file}: {axis}.{name}: a value's name is part of a folder name: letters, digits .+-")
            if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
                raise ValueError(f"{file}: {axis}.{name}: give a list of overrides, e.g. [train.seed=0]")
        axes[str(axis)] = {str(k): list(v) for k, v in values.items()}
    return axes


def read_sweep(file: str | Path) -> tuple[Path, list[Task]]:
    """(root, every task in index order) of sweep file `file`; a malformed file is a one-line ValueError."""
    file = Path(file)
    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"{file}: not a readable sweep file ({' '.join(str(err).split())})") from None
    if not isinstance(data, dict) or not isinstance(data.get("root"), str) or not data["root"]:
        raise ValueError(f"{file}: a sweep file has `root:` (the folder of the runs) and `axes:`")
    root, axes = Path(data["root"]).expanduser(), _axes(file, data.get("axes"))
    tasks = []
    for index, combo in enumerate(itertools.product(*(values.items() for values in axes.values()))):
        name = "_".join(value for value, _ in combo)
        overrides = (*(o for _, values in combo for o in values), f"train.output_dir={root / name}")
        tasks.append(Task(index, name, overrides))
    return root, tasks


def task(file: str | Path, index: int) -> Task:
    """Task `index` of the sweep (a SLURM array index); out of range: a ValueError naming the array to submit."""
    _, tasks = read_sweep(file)
    if not 0 <= index < len(tasks):
        raise ValueError(f"{file}: task {index} of {len(tasks)}: submit with sbatch --array=0-{len(tasks) - 1}")
    return tasks[index]
