"""`sharpclip distill`: CLIP-IN stage 1 (§3.3, eq. 7) / TULIP's relative-position distillation, run by the Trainer.

The teacher is the model the config names (absolute positions, no adapters); the student is its copy with a RoPE text
tower (models.distill.make_student). Both read the same long captions truncated to the teacher's context; the
objective is the registered `distill_cosine` term; optimiser, schedule, logging and checkpoints are the Trainer's,
set from `cfg.train` (configs/clipin_distill.yaml has TULIP's values). Afterwards the student's context is opened
(Long-CLIP length of the teacher unless `model.context_length` says otherwise) and saved as a sharpclip checkpoint
that replaces the original model for fine-tuning.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from sharpclip import devices
from sharpclip.config import AdapterConfig, Config, LossConfig, ModelConfig, TermConfig, TrainConfig, to_yaml
from sharpclip.data.captions import CaptionLoader
from sharpclip.data.transforms import TextTokenizer
from sharpclip.losses import distill_cosine
from sharpclip.models.distill import DistillSettings, finish, make_student, read_captions, tokenize
from sharpclip.models.factory import create_model, save_checkpoint, save_weights
from sharpclip.models.hf import HFDualEncoder
from sharpclip.models.long_context import stretched_length
from sharpclip.train import distributed, rank_agreement
from sharpclip.train.features import FeatureEncoder, build_objective
from sharpclip.train.parallel import ParallelContext
from sharpclip.train.run import open_run
from sharpclip.train.trainer import Trainer

DISTILL_TERMS = {"distill": TermConfig("distill_cosine")}


def distill(
    teacher: HFDualEncoder,
    captions: Sequence[str],
    train: TrainConfig,
    settings: DistillSettings | None = None,
    student_cfg: ModelConfig | None = None,
    ctx: ParallelContext | None = None,
) -> HFDualEncoder:
    """Train the RoPE student on `captions` with the Trainer in `train.output_dir`; returns it (a plain module on
    every rank), context opened.

    student_cfg: when given, the run's checkpoints hold the student (as `save_checkpoint` writes it). ctx: the run's
    parallel context (default: this process in the default process group, with `train.layout`).
    """
    ctx = ctx if ctx is not None else ParallelContext.from_process_group(train.layout)
    settings = settings or DistillSettings()
    student = make_student(teacher, settings)
    # the teacher's context: y_trunc of eq. 7
    tokenize = TextTokenizer(teacher.tokenizer, teacher.context_length, teacher.pads_to_context)
    loader = CaptionLoader(
        captions, tokenize, train.batch_size // ctx.world, seed=train.seed, rank=ctx.rank, world_size=ctx.world
    )
    objective = build_objective(LossConfig(terms=DISTILL_TERMS), monitor=False)  # text only: no image to monitor
    encoder = FeatureEncoder(student, objective.feature_keys, teacher=teacher, precision=train.precision)

    def write_model(directory: Path, state: dict | None = None) -> None:  # state: the engine's gathered weights
        if student_cfg is not None:
            save_checkpoint(student, directory, student_cfg, state=state)
        else:  # the weights alone, which is what a resume reads back
            save_weights(student, directory, state)

    trainer = Trainer(student, objective, loader, train, Path(train.output_dir), write_model, encoder=encoder, ctx=ctx)
    trainer.fit()
    if trainer.engine is not None:  # sharded over the ranks: a plain student with the trained weights on each
        weights = trainer.engine.full_model_state(everywhere=True)
        student = make_student(teacher, settings).to(trainer.device)
        student.load_state_dict(weights)
    return finish(student, settings)


@torch.no_grad()
def agreement(teacher: HFDualEncoder, student: HFDualEncoder, captions: Sequence[str]) -> float:
    """Mean cosine between teacher and student embeddings on `captions` truncated to the teacher's context."""
    ids, mask = tokenize(teacher, captions, teacher.context_length)
    device = next(student.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    t = teacher.to(device).eval().encode_text(ids, mask).embedding
    s = student.eval().encode_text(ids, mask).embedding
    return 1.0 - distill_cosine(t, s).item()


def check_target(directory: Path) -> None:
    """Refuse (ValueError, one line) a `--to` that is a link, a file or a non-empty folder: the student's checkpoint
    (config.json, model.safetensors, ...) is never written over or beside files sharpclip did not write there."""
    if directory.is_symlink() or (directory.exists() and not directory.is_dir()):
        raise ValueError(f"--to {directory}: a symbolic link or a file; give a new or empty folder for the student")
    found = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    if found:
        shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
        raise ValueError(f"--to {directory}: not empty ({shown}); give a new or empty folder for the student")


def run_distill(cfg: Config, captions_file: str | Path, out_dir: str | Path, overwrite: bool = False) -> str:
    """The `sharpclip distill` command: 5% of the captions (at least one) are held out for the closing report.

    `train.output_dir` is a run directory as `sharpclip train` keeps one (train.run_dir): new or empty, or with
    `overwrite` an earlier run's (emptied of what a run writes, nothing else), locked while the run writes."""
    check_target(Path(out_dir))  # before anything is loaded or trained
    device = devices.resolve_device(cfg.train.device, "train.device")
    devices.configure_tf32(device, cfg.train.tf32)  # before any model runs
    distributed.init_from_env(device, cfg.train.dist_timeout_min)
    ctx = ParallelContext.from_process_group(cfg.train.layout)
    try:
        rank_agreement.check_same_config(cfg, ctx.all_ranks)  # as train: ranks started with other settings
        captions = read_captions(captions_file)
        if len(set(ctx.all_ranks(hashlib.sha256("\n".join(captions).encode()).hexdigest()))) > 1:
            raise rank_agreement.RankConfigMismatch(
                f"the ranks were given different --captions ({captions_file} on this rank): give every rank one file"
            )
        mode = "overwrite" if overwrite else "fresh"
        _, lock = open_run(cfg, Path(cfg.train.output_dir), mode, None, ctx, resumable=False)
        try:
            return _distill_run(cfg, captions, out_dir, ctx)
        finally:
            if lock is not None:
                lock.release()
    finally:
        distributed.shutdown()


def _distill_run(cfg: Config, captions: list[str], out_dir: str | Path, ctx: ParallelContext) -> str:
    teacher_cfg = replace(cfg.model, text_encoder="absolute", context_length=None, adapter=AdapterConfig())
    teacher = create_model(teacher_cfg)
    length = cfg.model.context_length or stretched_length(teacher.context_length, cfg.model.keep_positions, 4)
    settings = DistillSettings(length, cfg.model.rope_theta, cfg.model.rope_ntk_factor)
    student_cfg = replace(teacher_cfg, text_encoder="rope", context_length=length)
    held = max(1, len(captions) // 20)
    if ctx.is_main:  # in the run directory open_run has taken
        (Path(cfg.train.output_dir) / "config.yaml").write_text(to_yaml(cfg))
    student = distill(teacher, captions[:-held], cfg.train, settings, student_cfg, ctx)
    if ctx.is_main:
        save_checkpoint(student, out_dir, student_cfg)
    cos = agreement(teacher, student, captions[-held:])
    return f"student saved to {out_dir}; held-out cosine to the teacher {cos:.4f} ({held} captions); context {length}"
