"""`sharpclip distill`: CLIP-IN stage 1 (§3.3, eq. 7) / TULIP's relative-position distillation, run by the Trainer.

The teacher is the model the config names (absolute positions, no adapters); the student is its copy with a RoPE text
tower (models.distill.make_student). Both read the same long captions truncated to the teacher's context; the
objective is the registered `distill_cosine` term; optimiser, schedule, logging and checkpoints are the Trainer's,
set from `cfg.train` (configs/clipin_distill.yaml has TULIP's values). Afterwards the student's context is opened
(Long-CLIP length of the teacher unless `model.context_length` says otherwise) and saved as a sharpclip checkpoint
that replaces the original model for fine-tuning.
"""

from __future__ import annotations

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
from sharpclip.train import distributed
from sharpclip.train.features import FeatureEncoder, build_objective
from sharpclip.train.trainer import Trainer

DISTILL_TERMS = {"distill": TermConfig("distill_cosine")}


def distill(
    teacher: HFDualEncoder,
    captions: Sequence[str],
    train: TrainConfig,
    settings: DistillSettings | None = None,
    student_cfg: ModelConfig | None = None,
) -> HFDualEncoder:
    """Train the RoPE student on `captions` with the Trainer in `train.output_dir`; returns it, context opened.

    student_cfg: when given, the run's checkpoints hold the student (as `save_checkpoint` writes it).
    """
    settings = settings or DistillSettings()
    student = make_student(teacher, settings)
    # the teacher's context: y_trunc of eq. 7
    tokenize = TextTokenizer(teacher.tokenizer, teacher.context_length, teacher.pads_to_context)
    world = distributed.world_size()
    loader = CaptionLoader(
        captions, tokenize, train.batch_size // world, seed=train.seed, rank=distributed.rank(), world_size=world
    )
    objective = build_objective(LossConfig(terms=DISTILL_TERMS), monitor=False)  # text only: no image to monitor
    encoder = FeatureEncoder(student, objective.feature_keys, teacher=teacher, precision=train.precision)

    def write_model(directory: Path, state: dict | None = None) -> None:
        if student_cfg is not None:
            save_checkpoint(student, directory, student_cfg, state)
        else:  # the weights alone, which is what a resume reads back
            save_weights(student, directory, state)

    trainer = Trainer(student, objective, loader, train, Path(train.output_dir), write_model, encoder=encoder)
    trainer.fit()
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


def run_distill(cfg: Config, captions_file: str | Path, out_dir: str | Path) -> str:
    """The `sharpclip distill` command: 5% of the captions (at least one) are held out for the closing report."""
    device = devices.resolve_device(cfg.train.device, "train.device")
    devices.configure_tf32(device, cfg.train.tf32)  # before any model runs
    distributed.init_from_env(device, cfg.train.dist_timeout_min)
    teacher_cfg = replace(cfg.model, text_encoder="absolute", context_length=None, adapter=AdapterConfig())
    teacher = create_model(teacher_cfg)
    length = cfg.model.context_length or stretched_length(teacher.context_length, cfg.model.keep_positions, 4)
    settings = DistillSettings(length, cfg.model.rope_theta, cfg.model.rope_ntk_factor)
    student_cfg = replace(teacher_cfg, text_encoder="rope", context_length=length)
    captions = read_captions(captions_file)
    held = max(1, len(captions) // 20)
    run_dir = Path(cfg.train.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    student = distill(teacher, captions[:-held], cfg.train, settings, student_cfg)
    if distributed.rank() == 0:
        save_checkpoint(student, out_dir, student_cfg)
    cos = agreement(teacher, student, captions[-held:])
    distributed.shutdown()
    return f"student saved to {out_dir}; held-out cosine to the teacher {cos:.4f} ({held} captions); context {length}"
