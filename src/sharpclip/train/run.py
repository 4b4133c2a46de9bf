"""`sharpclip train`: the one place that sees the whole config and wires model, data, objective and trainer.

    run_train(load_config("configs/hnclip_docci.yaml", overrides))
    torchrun --nproc_per_node 2 -m sharpclip train configs/hnclip_docci.yaml   (each rank: batch_size / world)

`train.device` (auto: cuda:<LOCAL_RANK> with CUDA, else cpu) is resolved first: it picks the process group's
backend, the model is moved there before rank 0's weights are broadcast, and the loader pins its batches when it is
a GPU. The resolved devices are logged and recorded at the top of config.yaml.

The model decides the preprocessing: images at its own size and mean/std, captions at its own context length
(models.preprocessing), so a Long-CLIP-stretched tower reads 248 tokens without a second setting to keep in step.
The run directory receives the resolved config (config.yaml), the logs, checkpoints and evaluation results. It is
opened by train.run_dir's policy (a fresh run refuses a non-empty directory; `resume` and `overwrite` say otherwise;
a lock keeps a second run out), and a resume is reconciled with the saved config by train.resume.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import os
import secrets
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import torch

from sharpclip import devices
from sharpclip.config import Config, ConfigError, DataConfig, to_yaml
from sharpclip.data import build_loader, data_root, read_samples
from sharpclip.data.formats import FORMATS
from sharpclip.data.overlap import check_overlap, sample_images
from sharpclip.data.subset import read_subset_record
from sharpclip.eval.evaluator import Evaluate, retrieval_validator
from sharpclip.eval.guards import evaluate_guards, guard_metrics
from sharpclip.losses import Objective
from sharpclip.models.base import DualEncoder
from sharpclip.models.factory import create_model, save_checkpoint
from sharpclip.models.preprocessing import model_transforms
from sharpclip.progress import TerminalOnly
from sharpclip.train import checkpoint, distributed, memory_plan, rank_agreement, run_dir, slurm, validation
from sharpclip.train import resume as resume_policy
from sharpclip.train.features import build_objective, check_provided
from sharpclip.train.logging import log
from sharpclip.train.parallel import ParallelContext
from sharpclip.train.step import check_batch_split
from sharpclip.train.trainer import Trainer, TrainerState

RESOLVED_CONFIG = resume_policy.RESOLVED_CONFIG
RESUMES = "resumes.jsonl"  # one line per resume: the step, the checkpoint and the settings it changed
GUARDS_INITIAL = "guards_initial.json"  # the guards' evaluation report of the initial model (train.guards)
SUBSET_RECORD = "train_subset.json"  # the training subset's sizes, seed and ids sha256 (data.subset)
T = TypeVar("T")  # what a step run on every rank returns (_rank0_first)


class AlreadyFinished(Exception):
    """`--resume` of a run whose budget (train.epochs, train.max_steps) is already spent: nothing was trained and
    nothing written (config.yaml and resumes.jsonl unchanged); the message names the step and what to raise."""


@contextlib.contextmanager
def _run_logging(directory: Path, ctx: ParallelContext) -> Iterator[None]:
    """Every sharpclip logger's messages (training, data, models) into `directory`/train.log for this run (rank 0),
    and to stderr unless the command line already prints them there; removed afterwards."""
    root = logging.getLogger("sharpclip")
    if not ctx.is_main or any(getattr(h, "sharpclip", False) for h in root.handlers):
        yield
        return
    directory.mkdir(parents=True, exist_ok=True)
    on_stderr = any(isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
                    for h in root.handlers)  # fmt: skip
    handlers = [logging.FileHandler(directory / "train.log")] + ([] if on_stderr else [logging.StreamHandler()])
    for handler in handlers:
        if not isinstance(handler, logging.FileHandler):  # no progress line beside a bar on a terminal
            handler.addFilter(TerminalOnly())
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        handler.sharpclip = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    level = root.level
    root.setLevel(logging.INFO)  # setLevel, not `.level =`: it clears the loggers' cached isEnabledFor answers
    log_file = directory / "train.log"
    before = log_file.stat().st_size  # the FileHandler has created it
    finished = False
    try:
        yield
    except AlreadyFinished:
        finished = True
        raise
    finally:
        for handler in handlers:
            root.removeHandler(handler)
            handler.close()
        root.setLevel(level)
        if finished:  # a requeued job of a finished run writes nothing: its start-up lines went to stderr only
            os.truncate(log_file, before)


# the tracking extras: the module train.logging imports, and the package that provides it (checked at config load)
TRACKERS = {"train.tensorboard": ("torch.utils.tensorboard", "tensorboard"), "train.wandb": ("wandb", "wandb")}


def _importable(imported: str, package: str) -> bool:
    """Whether `imported` is loaded already or `package` is installed (found without importing it)."""
    if imported in sys.modules:
        return True
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def check_config(cfg: Config) -> Objective:
    """What training refuses before it builds anything, for `sharpclip config` to refuse as well: the objective
    (every term's loss, parameters and inputs typed and checked against the feature table; returned) and the data
    formats."""
    objective = build_objective(cfg.loss)
    for key, (imported, package) in TRACKERS.items():
        if getattr(cfg.train, key.split(".")[1]) and not _importable(imported, package):
            raise ConfigError(f"{key}: needs the {package} extra: pip install 'sharpclip[{package}]' (or {key}=false)")
    for fmt, key in ((cfg.data.format, "data.format"), (cfg.data.edits_format, "data.edits_format")):
        if fmt and fmt not in FORMATS:
            raise ConfigError(f"{key}: unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    return objective


def check_world(cfg: Config, objective: Objective, world: int, local: int) -> None:
    """What training refuses about running on `world` ranks, `local` a node, before it builds anything, for
    `sharpclip config --memory` to refuse as well: a batch that does not split over them, and a `train.layout`
    their mesh cannot take (hybrid over ranks that are not whole nodes)."""
    if cfg.train.batch_size % world:
        raise ConfigError(f"train.batch_size ({cfg.train.batch_size}) must be divisible by the {world} processes")
    check_batch_split(cfg.train.batch_size, cfg.train.micro_batch_size, cfg.train.accumulation, world,
                      objective.per_sample)  # fmt: skip
    if world > 1:
        ParallelContext(world=world, local_world=local, layout=cfg.train.layout).mesh_shape()


def checked_validation_samples(data: DataConfig, train_samples: list | None) -> list:
    """The samples of `data.eval_split`, after refusing (or, under `data.overlap: warn`, reporting) any image they
    share with the training samples (None: a streamed training set, which cannot be checked without reading it)."""
    held_out = _validation_samples(data, data.eval_split)
    if train_samples is None:
        log.info("data: the training set is streamed; its overlap with the validation split is not checked")
        return held_out
    what = f"validation split {data.eval_split!r} of {data.format} at {data.root or 'the cache'}"
    check_overlap(sample_images(train_samples), sample_images(held_out), what, data.overlap)
    return held_out


def guarded_validator(
    evaluate: Callable, model: DualEncoder, cfg: Config, data: DataConfig, run_dir: Path, ctx: ParallelContext
) -> Callable:
    """`evaluate` plus the forgetting guards (train.guards), each recorded as its change from the initial model.

    `model` is the initial model (built, not yet trained or resumed): it is evaluated once and its report kept in
    RUN/guards_initial.json, which a resume reads back instead of evaluating the trained weights as "initial".
    """
    guards, path = cfg.train.guards, run_dir / GUARDS_INITIAL
    eval_cfg = replace(cfg.eval, precision=cfg.train.precision, num_workers=cfg.data.num_workers)  # training's

    def report(model: DualEncoder) -> dict:  # every rank embeds its share, rank 0 scores: its report on every rank
        score, wrap = validation.scores_here(ctx), functools.partial(validation.shard, ctx=ctx)
        return validation.from_rank0(lambda: evaluate_guards(model, guards, eval_cfg, data, wrap, score), ctx)

    if path.is_file():
        initial = json.loads(path.read_text())
    else:
        initial = report(model)
        if ctx.is_main:  # atomically: another rank may be reading it (all ranks hold the same)
            path.with_suffix(".tmp").write_text(json.dumps(initial, indent=2, default=float) + "\n")
            path.with_suffix(".tmp").replace(path)
    log.info("guards: %s, measured against the initial model (%s)", ", ".join(g.metric for g in guards), path.name)

    def validate(model: DualEncoder) -> dict[str, float]:
        metrics, crossed = guard_metrics(report(model), initial, guards)
        if crossed:
            log.warning("guards: floor crossed by %s; this evaluation cannot make its checkpoint the best",
                        "; ".join(crossed))  # fmt: skip
        return {**evaluate(model), **metrics}

    return validate


def log_model(model: DualEncoder, name: str) -> tuple[int, int]:
    """Log the model's name, class and parameter counts (total, trainable); returns the two counts."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    kind = type(getattr(model, "hf_model", model)).__name__
    log.info("model %s (%s): %s parameters, %s trainable (%.1f%%)", name, kind, f"{total:,}", f"{trainable:,}",
             100 * trainable / max(total, 1))  # fmt: skip
    return total, trainable


def warn_tiny(name: str) -> None:
    """A tiny preset has random weights: fine to try a pipeline, useless as a result. Say so in the log."""
    if name.startswith("tiny-"):
        log.warning(
            "model.name=%s is a tiny preset with random weights, for trying the pipeline and for tests; its scores "
            "mean nothing. Set model.name to a real checkpoint (an HF, open_clip or sharpclip folder) for a real run",
            name,
        )


def _validation_samples(data: DataConfig, split: str) -> list:
    hint = "set data.eval_split to a split that exists, or train.eval_every=0 to train without validation"
    try:
        samples = read_samples(data, split)
    except FileNotFoundError as err:  # the split's annotation file or folder: the message names the path
        raise ConfigError(f"validation split data.eval_split={split!r}: {err}; {hint}") from None
    except ValueError as err:
        if "unknown split" not in str(err):
            raise
        raise ConfigError(f"validation split data.eval_split={split!r}: {err}; {hint}") from None
    if not samples:
        raise ConfigError(
            f"validation split data.eval_split={split!r}: no {data.format} samples found for it under "
            f"{data_root(data)}; {hint}"
        )
    return samples


def build_trainer(cfg: Config, evaluate: Evaluate | None = None, ctx: ParallelContext | None = None) -> Trainer:
    """Model, loader, objective, validation and trainer as `cfg` describes (no training yet).

    evaluate: the validation run every `train.eval_every` epochs (eval.evaluator.retrieval_validator over other
    data, as the demo's); default: retrieval on `data.eval_split`, checked for overlap with the training images.
    The forgetting guards (`train.guards`) are added to either. ctx: the run's parallel context (default: this
    process in the default process group, with `train.layout`).
    """
    ctx = ctx if ctx is not None else ParallelContext.from_process_group(cfg.train.layout)
    world, rank = ctx.world, ctx.rank
    objective = check_config(cfg)  # every input against the feature table, every parameter typed, formats known
    check_world(cfg, objective, world, ctx.local_world)
    device = devices.resolve_device(cfg.train.device, "train.device")
    devices.check_precision(cfg.train.precision, device, "train.precision")  # before the model is built
    checkpoint.seed_rngs(cfg.train.seed)  # the same weights on every rank (then broadcast from rank 0 anyway)
    model = create_model(cfg.model).to(device)
    log_model(model, cfg.model.name)
    memory_plan.log_plan(cfg, model, device, world, ctx.local_world)
    if ctx.several:  # the engine shards what each rank holds: rank 0's weights everywhere first
        distributed.broadcast_parameters(model)
    preprocessing, data = model_transforms(model, alpha=cfg.data.image_alpha), cfg.data
    loader = _rank0_first(lambda: build_loader(
        data, data.train_split, preprocessing, batch_size=cfg.train.batch_size // world, rank=rank,
        world_size=world, seed=cfg.train.seed, pin_memory=device.type == "cuda",
        whole_units=cfg.train.accumulation == "exact",  # per_micro_batch: each rank its share of micro-batches
    ), ctx, "could not read the training data")  # fmt: skip
    draft = getattr(preprocessing.image, "size", None) if data.jpeg_draft else None  # every format decodes alike
    decoding = f"to sides >= {draft} px" if draft else "off"
    log.info("data: %s, %d loader workers, JPEG draft decoding %s, images over %s pixels refused", data.format,
             loader.num_workers, decoding, f"{data.max_image_pixels:,}")  # fmt: skip
    # every rank read the same data: the same decision on every rank
    check_provided(objective, loader.provides, f"data.format={data.format} (split {data.train_split!r})")
    if cfg.train.eval_every:
        if evaluate is None:
            held_out = checked_validation_samples(data, getattr(getattr(loader, "dataset", None), "samples", None))
            evaluate = validation.shared(retrieval_validator(
                held_out, data.eval_split, data.image_alpha, num_workers=loader.num_workers,
                precision=cfg.train.precision, wrap=functools.partial(validation.shard, ctx=ctx),
                score=validation.scores_here(ctx),
            ), ctx)  # fmt: skip
        if cfg.train.guards:
            evaluate = guarded_validator(evaluate, model, cfg, data, Path(cfg.train.output_dir), ctx)

    def write_model(directory: Path, state: dict | None = None) -> None:  # state: the engine's gathered weights
        save_checkpoint(model, directory, cfg.model, state=state)
        # what these weights were trained with: a resume is reconciled against it (train.resume)
        (directory / resume_policy.CHECKPOINT_RUN_CONFIG).write_text(to_yaml(cfg))

    return Trainer(model, objective, loader, cfg.train, Path(cfg.train.output_dir), write_model, evaluate, ctx=ctx)


def run_train(cfg: Config, resume: str | Path | None = None, overwrite: bool = False) -> TrainerState:
    """Train as `cfg` says, in `cfg.train.output_dir`, which must be empty unless `overwrite` (empty it first).

    `resume` (a run directory, or RUN/checkpoints/step-N) continues that run exactly, writing into that run
    directory; `cfg` may change only what train.resume applies (the rest is an error listing saved → new). A finished
    run continues when `cfg` raises train.epochs or train.max_steps (the learning-rate schedule is rebuilt for the
    new total); with nothing left to do it raises `AlreadyFinished` and writes nothing.
    """
    slurm.adopt()  # srun without torchrun: LOCAL_RANK (the device) and the rank from SLURM_* (train.slurm)
    device = devices.resolve_device(cfg.train.device, "train.device")
    devices.configure_tf32(device, cfg.train.tf32)  # before any model runs (the guards' initial evaluation too)
    distributed.init_from_env(device, cfg.train.dist_timeout_min)
    ctx = ParallelContext.from_process_group(cfg.train.layout)  # the one parallel context of this run
    directory, named = resume_policy.locate(resume) if resume is not None else (Path(cfg.train.output_dir), None)
    mode = "resume" if resume is not None else "overwrite" if overwrite else "fresh"
    created = mode == "fresh" and not directory.exists()  # a failed start removes a folder it made, once empty
    try:
        rank_agreement.check_same_config(cfg, ctx.all_ranks)  # before anything is opened or trained
        changed, lock = open_run(cfg, directory, mode, named, ctx)
        try:
            with _run_logging(directory, ctx):
                placement = describe_placement(device, ctx)
                if ctx.is_main:
                    log.info("%s", placement)
                    warn_tiny(cfg.model.name)
                trainer = _start(cfg, directory, named, changed, mode == "resume", placement, ctx)
                return trainer.fit()
        finally:
            if lock is not None:
                lock.release()
    except BaseException:
        if created and ctx.is_main:
            run_dir.remove_if_empty(directory)
        raise
    finally:
        distributed.shutdown()


def describe_placement(device: torch.device, ctx: ParallelContext | None = None) -> str:
    """'world size 2, backend nccl, devices: rank 0 cuda:0 (...), rank 1 cuda:1 (...), torch 2.x' (every rank must
    call it)."""
    ctx = ctx if ctx is not None else ParallelContext.from_process_group()
    ranks = ctx.all_ranks(devices.describe(device))
    listed = ", ".join(f"rank {r} {d}" for r, d in enumerate(ranks))
    layout = f", layout {ctx.layout}" if ctx.several else ""
    backend = distributed.backend() if ctx.several else "none"
    return f"world size {ctx.world}, backend {backend}{layout}, devices: {listed}, torch {torch.__version__}"


def open_run(
    cfg: Config, directory: Path, mode: str, named: Path | None, ctx: ParallelContext, resumable: bool = True
) -> tuple[dict, run_dir.RunLock | None]:
    """Check the directory for `mode` and reconcile a resume's config (every rank), then take the lock and empty
    the directory under overwrite (rank 0); when any rank cannot, every rank stops rather than wait at a barrier.
    Returns (the config changes a resume applies, rank 0's held lock). `resumable`: as run_dir.check_run_dir."""

    def check() -> dict:
        run_dir.check_run_dir(directory, mode, resumable)
        if mode != "resume":
            return {}
        cfg.train.output_dir = str(directory)
        return resume_policy.reconcile(directory, cfg, named)

    changed = _together(check, ctx)
    lock = _together(lambda: run_dir.open_run_dir(directory, mode, resumable) if ctx.is_main else None, ctx)
    try:
        check_shared_dir(directory, ctx)
    except run_dir.RunDirError:
        if lock is not None:
            lock.release()
        raise
    return changed, lock


SHARED_CHECK = ".shared-dir-check"  # rank 0's token, read back by every rank, then removed


def check_shared_dir(directory: Path, ctx: ParallelContext | None = None) -> None:
    """Refuse a run whose ranks do not all see `directory` as rank 0 writes it (every rank must call it).

    Rank 0 writes the checkpoints and logs, and every rank reads them back on resume, so the ranks of several nodes
    need one shared file system path as `train.output_dir`. Rank 0 writes a random token there; every rank reads it
    back; a rank that finds another or none raises `RunDirError` on every rank. Nothing to check on one process."""
    ctx = ctx if ctx is not None else ParallelContext.from_process_group()
    if not ctx.several:
        return
    token = ctx.all_ranks(secrets.token_hex(8))[0]
    path, wrote = directory / SHARED_CHECK, True
    if ctx.is_main:
        try:
            path.write_text(token)
        except OSError:
            wrote = False
    if not ctx.all_true(wrote):  # also the barrier: no rank reads before rank 0 has written
        raise run_dir.RunDirError(f"{directory}: rank 0 cannot write the run directory; check its permissions")
    try:
        seen = path.read_text()
    except OSError:
        seen = None
    same = ctx.all_flags(seen == token)
    if ctx.is_main:
        path.unlink(missing_ok=True)
    if not all(same):
        others = ", ".join(str(r) for r, ok in enumerate(same) if not ok)
        raise run_dir.RunDirError(
            f"{directory}: rank {others} does not see the run directory rank 0 writes; the ranks of several nodes "
            "need one shared file system path as train.output_dir (and for --resume)"
        )


def _rank0_first(step: Callable[[], T], ctx: ParallelContext, failure: str) -> T:
    """`step()` on rank 0, then on the other ranks (a generated corpus, SynthDense, is written once, not by every
    rank at once). An error on any rank ends every rank: the others raise a ConfigError saying which rank `failure`
    (the CLI prints only the failing rank's own line), instead of one rank waiting at a barrier for a rank that has
    gone and dying in the collective."""
    if ctx.rank != 0 and not ctx.all_true(True):  # rank 0's outcome
        raise ConfigError(f"rank 0 {failure}; its error says why")
    try:
        result, error = step(), None
    except Exception as err:
        result, error = None, err
    if ctx.rank == 0 and not ctx.all_true(error is None):  # tells the others
        raise error
    if not ctx.all_true(error is None):
        raise error or ConfigError(f"another rank {failure}; its error says why")
    return result


def _together(step, ctx: ParallelContext):
    """`step()` on every rank; if it raised on any rank, it raises on all (the others with a pointer to that one)."""
    try:
        result, error = step(), None
    except (ConfigError, run_dir.RunDirError, OSError) as err:
        result, error = None, err
    if not ctx.all_true(error is None):
        raise error or run_dir.RunDirError("another process could not open the run directory; see its error")
    return result


def _start(
    cfg: Config, directory: Path, named: Path | None, changed: dict, resuming: bool, placement: str,
    ctx: ParallelContext,
) -> Trainer:  # fmt: skip
    """Build the trainer (and resume it); a fresh run that fails to start leaves its directory empty again."""
    try:
        trainer = build_trainer(cfg, ctx=ctx)
        record_subset(directory, trainer.loader, resuming, ctx.is_main)
        if resuming:
            path, loaded = resume_policy.pick_checkpoint(directory, named, trainer.model.state_dict())
            trainer.resume(path, loaded)
            if trainer.finished():
                trainer.logger.close()
                raise AlreadyFinished(_finished_message(directory, trainer.state.step, cfg))
            if ctx.is_main:
                _record_resume(directory, trainer.state.step, path, changed, ctx.world)
    except BaseException:
        if not resuming and ctx.is_main:
            run_dir.empty_dir(directory)
        raise
    if ctx.is_main:
        # only now: the values this run really uses; the resolved devices head it as a comment
        (directory / RESOLVED_CONFIG).write_text(f"# {placement}\n{to_yaml(cfg)}" if placement else to_yaml(cfg))
    return trainer


def _finished_message(directory: Path, step: int, cfg: Config) -> str:
    budget = f"train.max_steps={cfg.train.max_steps}" if cfg.train.max_steps else f"train.epochs={cfg.train.epochs}"
    return (f"{directory} already finished at step {step} ({budget}); raise train.epochs or train.max_steps to "
            "train more")  # fmt: skip


def record_subset(directory: Path, loader: object, resuming: bool, is_main: bool = True) -> None:
    """Write `directory`/train_subset.json when the loader reads a training subset (data.subset; rank 0). A resume
    whose subset is not the one recorded is refused on every rank: the split changed on disk since the run began."""
    subset = getattr(getattr(loader, "dataset", None), "subset", None)
    if subset is None:
        return
    path, record = directory / SUBSET_RECORD, subset.to_json()
    if resuming and path.exists():
        saved = read_subset_record(path)
        if saved.ids_sha256 != record["ids_sha256"]:
            raise ConfigError(
                f"{path}: the run trained on {saved.selected} samples with ids sha256 "
                f"{saved.ids_sha256[:12]}, but the train split now gives {record['selected']} of "
                f"{record['total']} with {record['ids_sha256'][:12]}: the files under data.root changed; resume on "
                "the data the run began with"
            )
    if is_main:
        path.write_text(json.dumps(record, indent=2) + "\n")


def _record_resume(directory: Path, step: int, path: Path, changed: dict, world: int) -> None:
    record = {"step": step, "checkpoint": path.name, "changed": {k: list(v) for k, v in changed.items()},
              "world_size": world}  # fmt: skip
    with open(directory / RESUMES, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, default=str) + "\n")


def load_run_config(target: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The config `sharpclip train --resume target` continues with: the run's config.yaml plus `overrides`."""
    return resume_policy.load_resume_config(target, [], list(overrides))
