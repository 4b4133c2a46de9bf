"""Stage 1 of CLIP-IN (§3.3, eq. 7) / TULIP: distil the original text tower into a RoPE text tower.

    L_distill = 1 − mean_b cos(g_T(y_b), g_S(y_b))          (losses.distill_cosine)

Teacher g_T: the original text tower with absolute positions, frozen, in eval mode. Student g_S: a copy of the same
dual encoder whose text tower is turned into a RoPE tower (models.rope), initialised from the teacher's weights; its
token embedding stays frozen (TULIP), the vision tower is not used and stays as it was. Both see the same captions,
tokenised and truncated to the teacher's context c_T. The result is a full dual encoder (teacher's vision tower +
distilled RoPE text tower) whose usable context is set to `context_length` (> c_T); saved as a sharpclip checkpoint,
it replaces the original model for fine-tuning (`model.name=<that folder>`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

from sharpclip.config import AdapterConfig, ModelConfig
from sharpclip.losses import distill_cosine
from sharpclip.models import rope
from sharpclip.models.factory import create_model, save_checkpoint, sync_text_config
from sharpclip.models.hf import HFDualEncoder
from sharpclip.models.long_context import stretched_length


@dataclass
class DistillSettings:
    """Optimisation of the distillation (TULIP: AdamW lr 5e-4, wd 0.1, cosine schedule)."""

    steps: int = 1000
    batch_size: int = 32
    lr: float = 5e-4
    weight_decay: float = 0.1
    warmup_steps: int = 0
    seed: int = 0
    context_length: int = 248  # usable context of the student afterwards
    rope_theta: float = 10000.0
    rope_ntk_factor: float = 0.0


def make_student(teacher: HFDualEncoder, settings: DistillSettings) -> HFDualEncoder:
    """A copy of `teacher` with a RoPE text tower trained at the teacher's context; only its text tower trains."""
    student = copy.deepcopy(teacher)
    rope.to_rope(student.text_model, settings.rope_theta, settings.rope_ntk_factor, teacher.context_length)
    student.requires_grad_(False)
    student.text_model.requires_grad_(True)
    student.text_model.embeddings.token_embedding.requires_grad_(False)
    projection = getattr(student.hf_model, "text_projection", None)  # SigLIP projects inside the text tower
    if projection is not None:
        projection.requires_grad_(True)
    return student


def tokenize(model: HFDualEncoder, captions: Sequence[str], length: int) -> tuple[Tensor, Tensor]:
    """input_ids, attention_mask (B, length): truncated to `length` with eos kept last, padded to `length`."""
    enc = model.tokenizer(list(captions), padding="max_length", truncation=True, max_length=length, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def _schedule(settings: DistillSettings) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < settings.warmup_steps:
            return (step + 1) / settings.warmup_steps
        progress = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _optimizer(student: HFDualEncoder, settings: DistillSettings) -> torch.optim.Optimizer:
    params = [p for p in student.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    rest = [p for p in params if p.ndim < 2]  # gains and biases: no weight decay
    groups = [{"params": decay, "weight_decay": settings.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=settings.lr)


def distill(
    teacher: HFDualEncoder,
    captions: Sequence[str],
    settings: DistillSettings,
    log: Callable[[int, float], None] | None = None,
) -> HFDualEncoder:
    """Train and return the RoPE student (see the module docstring). `log(step, loss)` is called every step."""
    torch.manual_seed(settings.seed)
    teacher = teacher.eval().requires_grad_(False)
    student = make_student(teacher, settings).train()
    ids, mask = tokenize(teacher, captions, teacher.context_length)
    with torch.no_grad():
        targets = torch.cat([teacher.encode_text(i, m).embedding for i, m in _batches(ids, mask, 256)])
    opt = _optimizer(student, settings)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(settings))
    gen = torch.Generator().manual_seed(settings.seed)
    for step in range(settings.steps):
        pick = torch.randint(0, len(ids), (settings.batch_size,), generator=gen)
        loss = distill_cosine(targets[pick], student.encode_text(ids[pick], mask[pick]).embedding)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if log is not None:
            log(step, loss.item())
    return finish(student, settings)


def finish(student: HFDualEncoder, settings: DistillSettings) -> HFDualEncoder:
    """Open the student's context to `settings.context_length` (NTK-scaled when enabled) and freeze it for use."""
    rope.set_rope_context(student.text_model, settings.context_length)
    sync_text_config(student)
    if student.tokenizer is not None:
        student.tokenizer.model_max_length = settings.context_length
    return student.eval()


def _batches(ids: Tensor, mask: Tensor, size: int):
    for start in range(0, len(ids), size):
        yield ids[start : start + size], mask[start : start + size]


@torch.no_grad()
def agreement(teacher: HFDualEncoder, student: HFDualEncoder, captions: Sequence[str]) -> float:
    """Mean cosine between teacher and student embeddings on `captions` truncated to the teacher's context."""
    ids, mask = tokenize(teacher, captions, teacher.context_length)
    t = teacher.eval().encode_text(ids, mask).embedding
    s = student.eval().encode_text(ids, mask).embedding
    return 1.0 - distill_cosine(t, s).item()


def read_captions(path: str | Path) -> list[str]:
    """Non-empty lines of a UTF-8 text file, one caption per line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: captions file not found (expected one caption per line)")
    captions = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if len(captions) < 2:
        raise ValueError(f"{path}: needs at least 2 captions, found {len(captions)}")
    return captions


def run_distill(
    cfg: ModelConfig,
    captions_file: str | Path,
    out_dir: str | Path,
    settings: DistillSettings,
    log: Callable[[str], None] = print,
) -> str:
    """`sharpclip distill`: teacher from `cfg` (absolute positions, no adapters), student saved to `out_dir`.

    The student's context is `cfg.context_length`, or the Long-CLIP length of the teacher (77 → 248) when unset;
    RoPE θ and the NTK factor come from `cfg`. 5% of the captions (at least one) are held out for the report.
    """
    teacher_cfg = replace(cfg, text_encoder="absolute", context_length=None, adapter=AdapterConfig())
    teacher = create_model(teacher_cfg)
    length = cfg.context_length or stretched_length(teacher.context_length, cfg.keep_positions, 4)
    settings = replace(settings, context_length=length, rope_theta=cfg.rope_theta, rope_ntk_factor=cfg.rope_ntk_factor)
    captions = read_captions(captions_file)
    held = max(1, len(captions) // 20)
    every = max(1, settings.steps // 20)
    student = distill(
        teacher, captions[:-held], settings, log=lambda i, v: log(f"step {i} loss {v:.4f}") if i % every == 0 else None
    )
    student_cfg = replace(teacher_cfg, text_encoder="rope", context_length=length)
    save_checkpoint(student, out_dir, student_cfg)
    cos = agreement(teacher, student, captions[-held:])
    return f"student saved to {out_dir}; held-out cosine to the teacher {cos:.4f} ({held} captions); context {length}"
