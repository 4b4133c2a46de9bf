"""`sharpclip train RECIPE ... --resume auto`: one command that starts a run or continues it, for a job that a
cluster may stop and start again (requeue) any number of times.

`train.output_dir` (from the recipe and overrides) decides:

- absent or empty: a fresh run, as `sharpclip train RECIPE ...`;
- a run directory with a complete checkpoint: `--resume` of that directory with the recipe and overrides layered
  over its saved config, with every refusal of `--resume RUN` (a changed model, data, objective, batch, ... is an
  error listing saved → new); a run that has already finished prints its one line and exits 0;
- a run directory whose checkpoints are all unusable (marked diverged, symbolic links): refused, naming each;
- a run directory whose checkpoints are gone though it wrote some (its best.json, or a save in train.log: moved to
  archive storage, deleted): refused, naming that evidence and the steps metrics.jsonl records; nothing is emptied;
- a run directory with no complete checkpoint yet (the job stopped before its first one): started over
  (`--overwrite`, which deletes only what a run writes), after the same check of its saved config.yaml, if it has
  one, so a different experiment is refused rather than wiped;
- anything else (a folder that is not a run directory): a fresh run, which refuses it with its usual message.

Every rank reads the folder before any rank writes into it (the writes wait for every rank to join the process
group), so every rank decides the same.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from pathlib import Path

from sharpclip.config import Config, ConfigError, load_config
from sharpclip.train import checkpoint, run_dir
from sharpclip.train import resume as resume_policy
from sharpclip.train.logging import log

AUTO = "auto"  # the --resume value that means "start or continue train.output_dir"
SAVED = re.compile(r"checkpoint (step-\d+) (?:written|updated)")  # train.log's line for each save


@dataclass
class Start:
    """How `train --resume auto` opens its run: the config, the run to continue (None: start), and whether the
    folder is emptied first."""

    cfg: Config
    resume: Path | None
    overwrite: bool


def decide(files: list[str], overrides: list[str]) -> Start:
    """The start of `sharpclip train FILES OVERRIDES --resume auto` (see the module docstring)."""
    fresh = load_config(files, overrides)
    directory = Path(fresh.train.output_dir)
    if not run_dir.contents(directory) or not run_dir.is_run_dir(directory):
        return Start(fresh, None, False)
    if checkpoint.latest(directory / run_dir.CHECKPOINTS) is not None:
        return Start(resume_policy.load_resume_config(directory, files, overrides), directory, False)
    if (directory / resume_policy.RESOLVED_CONFIG).is_file():
        resume_policy.reconcile(directory, fresh)  # a different experiment is refused, not wiped
    if unusable := unusable_checkpoints(directory / run_dir.CHECKPOINTS):
        raise ConfigError(
            f"--resume auto: {directory} has no checkpoint to continue from: {unusable}. Nothing was changed: put a "
            "linked checkpoint's folder itself in its place and resume, start the run over with --overwrite (which "
            "deletes what it wrote), or train into another train.output_dir"
        )
    if (lost := checkpoints_gone(directory)) is not None:
        raise ConfigError(
            f"--resume auto: {directory} has no checkpoint left in {directory / run_dir.CHECKPOINTS}, but the run "
            f"wrote some ({lost}): they were moved or deleted. Put them back to continue it, or train into another "
            "train.output_dir; nothing was changed (--overwrite would delete its metrics and logs)"
        )
    log.warning("--resume auto: %s holds a run that stopped before its first checkpoint; starting it over", directory)
    return Start(fresh, None, True)


def unusable_checkpoints(folder: Path) -> str:
    """Why each `step-*` entry of `folder` that resume does not read is not read (marked diverged, a symbolic link,
    no trainer state), in words; "" when there is none. Such a run wrote checkpoints that are still there."""
    why = []
    for path in sorted(folder.glob("step-*")):
        if path.is_symlink():
            why.append(f"{path.name} is a symbolic link, which sharpclip neither resumes from nor writes through")
        elif (path / checkpoint.DIVERGED).exists():
            why.append(f"{path.name} is marked diverged (its {checkpoint.DIVERGED} says why)")
        elif not (path / checkpoint.TRAINER_STATE).is_file():
            why.append(f"{path.name} has no {checkpoint.TRAINER_STATE} (incomplete)")
    return "; ".join(why)


def checkpoints_gone(directory: Path) -> str | None:
    """The evidence that the run in `directory` wrote checkpoints (its best.json, or a save in train.log) and the
    steps its metrics.jsonl records, in words; None when it never wrote one (it stopped before its first)."""
    found = []
    if (directory / run_dir.CHECKPOINTS / checkpoint.BEST).is_file():
        found.append(f"{run_dir.CHECKPOINTS}/{checkpoint.BEST} is there")
    with contextlib.suppress(OSError), open(directory / "train.log", encoding="utf-8", errors="replace") as log_file:
        saves = [m.group(1) for line in log_file if (m := SAVED.search(line))]
        if saves:
            found.append(f"train.log: checkpoint {saves[-1]} written")
    if not found:
        return None
    with contextlib.suppress(OSError), open(directory / "metrics.jsonl", encoding="utf-8", errors="replace") as f:
        steps = sum(1 for line in f if '"loss"' in line)
        found.append(f"metrics.jsonl records {steps} steps")
    return "; ".join(found)
