"""What `sharpclip train --resume` continues, where it writes, which changed settings it may apply, and how each
rank takes up its saved state (`rank_states`; on another number of ranks: train.reshard).

`--resume RUN` continues the run directory RUN (its newest complete checkpoint) and writes into RUN, wherever the
run was first started: `train.output_dir` in RUN/config.yaml is only where it started. `--resume
RUN/checkpoints/step-N` continues from that checkpoint, with RUN/config.yaml two levels up.

A resume may change only what does not make the saved state a different experiment. Every config key is classified
by its longest prefix in `APPLIED` or `REFUSED` (tests/train/test_train_resume.py checks that every key is):

- applied: the learning rate and its schedule (`train.lr`, `warmup_steps`, `schedule`, `min_lr_ratio`, `epochs`,
  `max_steps`), the evaluation and checkpoint cadence, clipping, diagnostics, progress and sinks, the device, TF32
  and compilation, the process-group timeout, the parameters' layout over ranks (`train.layout`, `keep_gathered`: the
  optimiser state is resharded by torch.distributed.checkpoint) and asynchronous saves, loader workers and
  prefetching, `eval.*`.
  The optimiser's moments are kept; the learning rate becomes the new config's schedule evaluated at the current
  step (`lr × lr_factor(step; warmup_steps, total steps, min_lr_ratio, schedule)`), as if the run had used that
  schedule from the start;
- refused (the saved state would not mean what the new value says): the model, the data, the objective, the batch
  and micro-batch sizes, accumulation, seed, precision, weight decay, AdamW's betas and eps, per-module learning
  rates, the best metric, the guards. A refused change is an error listing saved → new for each key; start a new
  run from the checkpoint instead (`model.name=RUN/checkpoints/step-N train.output_dir=NEW`).

A recipe given again on resume (`sharpclip train RECIPE --resume RUN`) layers over the run's saved config, not over
the defaults, so a setting the run was started with (`train.keep_last=20`) is not reverted by a recipe that does not
mention it; a recipe that lowers `train.keep_last` (which prunes checkpoints at the next save) is refused unless the
new value is also given as an explicit override.

Every checkpoint holds the resolved config it was trained with (`run_config.yaml`), and a resume is reconciled
against that, not against config.yaml: a hand edit of config.yaml is then a change like any override (a refused key
is refused, an applied one recorded). The applied changes are logged and appended to RUN/resumes.jsonl; config.yaml
is rewritten only once the resume has succeeded, so it never records a value the run did not use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from sharpclip.config import Config, ConfigError, load_config
from sharpclip.train import checkpoint
from sharpclip.train.logging import log
from sharpclip.train.run_dir import MARKER

RESOLVED_CONFIG = "config.yaml"
CHECKPOINT_RUN_CONFIG = "run_config.yaml"  # in each checkpoint: the resolved config its weights were trained with
APPLIED = (
    "train.lr", "train.warmup_steps", "train.min_lr_ratio", "train.schedule", "train.epochs", "train.max_steps",
    "train.eval_every", "train.checkpoint_every", "train.keep_last", "train.grad_clip", "train.grad_checkpointing",
    "train.diagnostics_every", "train.nan_patience", "train.progress",
    "train.tensorboard", "train.wandb", "train.wandb_project", "train.wandb_name", "train.device", "train.tf32",
    "train.dist_timeout_min", "train.layout", "train.checkpoint_every_min", "train.stop_signals",
    "train.hang_timeout_min", "train.log_every", "train.async_checkpoint",
    "train.compile", "train.compile_fullgraph", "train.keep_gathered", "train.encode_batch_size", "data.num_workers",
    "data.prefetch_factor", "data.preload", "eval",
)  # fmt: skip
REFUSED = (
    "model", "data", "loss", "train.seed", "train.batch_size", "train.micro_batch_size", "train.accumulation",
    "train.precision", "train.weight_decay", "train.module_lr", "train.best_metric", "train.guards",
    "train.beta1", "train.beta2", "train.eps",
)  # fmt: skip
WHERE = "train.output_dir"  # not a setting: a resume writes into the directory it was given


def classify(key: str) -> str | None:
    """'applied' or 'refused' by the longest matching prefix of `key` (dotted); None for an unclassified key."""
    matches = [(len(p), kind) for kind, table in (("applied", APPLIED), ("refused", REFUSED)) for p in table
               if key == p or key.startswith(p + ".")]  # fmt: skip
    return max(matches)[1] if matches else None


def flatten(cfg: Config) -> dict[str, Any]:
    """Every leaf of `cfg` as {dotted key: value} (lists stay values)."""
    out: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = node

    walk("", OmegaConf.to_container(OmegaConf.structured(cfg)))
    return out


def changes(saved: Config, new: Config) -> dict[str, tuple[Any, Any]]:
    """{key: (saved, new)} for every leaf that differs (train.output_dir excluded)."""
    a, b = flatten(saved), flatten(new)
    missing = object()
    diff = {k: (a.get(k, missing), b.get(k, missing)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)}
    return {k: tuple(None if v is missing else v for v in pair) for k, pair in diff.items() if k != WHERE}


def locate(target: str | Path) -> tuple[Path, Path | None]:
    """(run directory, the checkpoint named by `target` or None for the newest) for `--resume target`."""
    path = Path(target)
    if (path / checkpoint.TRAINER_STATE).exists() or path.name.startswith("step-"):
        run_dir = path.parent.parent
        if path.parent.name != "checkpoints" or not (run_dir / RESOLVED_CONFIG).is_file():
            raise ConfigError(
                f"--resume {path}: a checkpoint must sit in RUN/checkpoints/ with RUN/{RESOLVED_CONFIG}; to start a "
                f"new run from it use model.name={path} with a new train.output_dir"
            )
        return run_dir, path
    if not (path / RESOLVED_CONFIG).is_file() and (path / MARKER).is_file():
        raise ConfigError(
            f"--resume {path}: this run stopped during start-up, before it wrote {RESOLVED_CONFIG} or any "
            "checkpoint; start it again with --overwrite"
        )
    if not (path / RESOLVED_CONFIG).is_file():
        raise ConfigError(f"--resume {path}: not a run directory (no {RESOLVED_CONFIG}) nor RUN/checkpoints/step-N")
    return path, None


def load_resume_config(target: str | Path, files: list[str] = (), overrides: list[str] = ()) -> Config:
    """The config to resume with: the run's config.yaml, then the recipe `files` (if given), then `overrides`;
    `train.output_dir` is the run directory. A recipe lowering train.keep_last without the override is refused."""
    run_dir, named = locate(target)
    cfg = load_config([run_dir / RESOLVED_CONFIG, *files], overrides, saved=True)
    cfg.train.output_dir = str(run_dir)
    if not files or any(o.split("=", 1)[0].strip() == "train.keep_last" for o in overrides):
        return cfg
    before = trained_config(run_dir, named).train.keep_last
    if cfg.train.keep_last < before:
        raise ConfigError(
            f"--resume {run_dir}: train.keep_last would drop from {before} to {cfg.train.keep_last} (from "
            f"{', '.join(map(str, files))}), which deletes older checkpoints at the next save; "
            f"pass train.keep_last={cfg.train.keep_last} to confirm, or train.keep_last={before} to keep them"
        )
    return cfg


def trained_config(run_dir: Path, named: Path | None = None) -> Config:
    """The config the checkpoint to resume (`named`, else the newest complete one) was trained with: its own
    run_config.yaml, or the run's config.yaml for checkpoints written before they held one."""
    found = named or checkpoint.latest(run_dir / "checkpoints")
    if found is not None and (found / CHECKPOINT_RUN_CONFIG).is_file():
        try:
            return load_config(found / CHECKPOINT_RUN_CONFIG, saved=True)
        except ConfigError as err:  # a damaged copy: the run's own config.yaml is the next best record
            log.warning("ignoring %s (%s); reconciling with %s", found / CHECKPOINT_RUN_CONFIG, err, RESOLVED_CONFIG)
    return load_config(run_dir / RESOLVED_CONFIG, saved=True)


def reconcile(run_dir: Path, new: Config, named: Path | None = None) -> dict[str, tuple[Any, Any]]:
    """The applied changes of `new` against the config the checkpoint was trained with (`trained_config`); raises
    `ConfigError` listing refused ones. A config.yaml edited by hand since then is a change like an override."""
    saved = trained_config(run_dir, named)
    found = changes(saved, new)
    refused = {k: v for k, v in found.items() if classify(k) != "applied"}
    if refused:
        lines = "; ".join(f"{k}: {a!r} → {b!r}" for k, (a, b) in refused.items())
        raise ConfigError(
            f"--resume {run_dir}: these settings cannot change on resume ({lines}). Drop them to continue the run, or "
            f"start a new run from its checkpoint: model.name={run_dir}/checkpoints/step-N train.output_dir=NEW"
        )
    if saved.train.output_dir != str(run_dir):
        log.info("resuming into %s (the run was started in %s)", run_dir, saved.train.output_dir)
    for key, (a, b) in found.items():
        log.info("resume changes %s: %r → %r", key, a, b)
    return found


def pick_checkpoint(run_dir: Path, named: Path | None, expected: dict[str, Any] | None = None) -> tuple[Path, tuple]:
    """The checkpoint to resume and its loaded parts (checkpoint.load); a corrupt newest one, or one whose weights do
    not fit `expected` (the model's state dict: names and shapes), falls back to the previous complete one with a
    warning naming the bad file. A named checkpoint never falls back."""
    if named is not None:
        return named, _checked(named, checkpoint.load(_not_passed_by_a_link(run_dir, named)), expected)
    candidates = checkpoint.all_checkpoints(run_dir / "checkpoints")
    for path in reversed(candidates):
        try:
            return path, _checked(path, checkpoint.load(_not_passed_by_a_link(run_dir, path)), expected)
        except checkpoint.CorruptCheckpoint as err:
            log.warning("cannot resume from %s: %s; falling back to the previous checkpoint", path.name, err)
    found = ", ".join(p.name for p in candidates) or "none"
    raise checkpoint.CheckpointError(  # never --overwrite: it would delete what may still be recovered by hand
        f"--resume {run_dir}: no complete, readable checkpoint in {run_dir / 'checkpoints'} (found: {found}; each "
        "damaged file is named above); nothing was changed: move the damaged checkpoints out of that folder, or "
        "start a new run from a checkpoint you trust (model.name=CHECKPOINT train.output_dir=NEW)"
    )


def _not_passed_by_a_link(run_dir: Path, picked: Path) -> Path:
    """`picked`, after naming every `checkpoints/step-*` entry that is a symbolic link (never read as the run's
    checkpoint, never written through). One of a later step than `picked` is refused now: the run would train to
    that step and then refuse to write its checkpoint there (matrix 6 C5); `picked` itself a link (a named
    checkpoint) is refused as well."""
    if picked.is_symlink():  # named by the user: read through the link, its epoch's end would be written there
        raise checkpoint.CheckpointError(
            f"--resume {picked}: a symbolic link, which sharpclip neither resumes from nor writes through; put the "
            f"folder itself in {run_dir / 'checkpoints'} and resume"
        )
    links = sorted(p for p in (run_dir / "checkpoints").glob("step-*") if p.is_symlink())
    later = [p for p in links if checkpoint.step_order(p) > checkpoint.step_order(picked)]
    if later:
        raise checkpoint.CheckpointError(
            f"--resume {run_dir}: {later[0]} is a symbolic link, which sharpclip neither resumes from nor writes "
            f"through, and this run would reach its step after resuming from {picked.name}; move it out of "
            f"{run_dir / 'checkpoints'} (or put the folder itself there) and resume"
        )
    for link in links:
        log.warning("%s is a symbolic link: not read as this run's checkpoint, and left in place", link)
    return picked


def _checked(path: Path, loaded: tuple, expected: dict[str, Any] | None) -> tuple:
    """`loaded` unless its weights do not fit `expected` (then `CorruptCheckpoint` naming model.safetensors)."""
    if expected is None:
        return loaded
    weights = loaded[0]
    missing, unexpected = sorted(expected.keys() - weights.keys()), sorted(weights.keys() - expected.keys())
    shapes = [k for k in expected.keys() & weights.keys() if tuple(expected[k].shape) != tuple(weights[k].shape)]
    if missing or unexpected or shapes:
        parts = [
            f"{what} {names[:3]}{' ...' if len(names) > 3 else ''}"
            for what, names in (("missing", missing), ("unexpected", unexpected), ("other shapes for", sorted(shapes)))
            if names
        ]
        raise checkpoint.CorruptCheckpoint(path / checkpoint.WEIGHTS, f"does not fit the model ({'; '.join(parts)})")
    return loaded


# -- per-rank states (the trainer's resume) ---------------------------------------------------------------------
def rank_states(
    trainer_state: dict, training: dict, rank: int, world: int
) -> tuple[tuple[dict, dict] | None, list[dict]]:
    """(this rank's (loader state, RNG state), or None when the world size changed; every saved rank's loader
    state, in rank order), taken out of a checkpoint's `trainer_state` (and its `training` state's RNG states), for
    `rank` of `world`. A checkpoint that predates per-rank states holds rank 0's, which every rank then takes."""
    first = trainer_state.pop("loader")
    saved = int(trainer_state.pop("world_size", world))
    loaders = trainer_state.pop("loaders", None) or [first] * saved
    trainer_state.pop("rank_batch", None)
    rngs = training.get("rank_rng") or [training["rng"]] * world
    return ((loaders[rank], rngs[rank]) if saved == world else None), loaders
