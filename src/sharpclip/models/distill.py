"""Stage 1 of CLIP-IN (§3.3, eq. 7) / TULIP: distil the original text tower into a RoPE text tower.

    L_distill = 1 − mean_b cos(g_T(y_b), g_S(y_b))          (losses.distill_cosine)

This module is the model surgery; the optimisation (and the closing agreement report) runs through the one Trainer
(train/distill.py, `sharpclip distill`). Teacher g_T: the original text tower with absolute positions, frozen, in
eval mode. Student g_S: a copy of the same dual encoder whose text tower is turned into a RoPE tower (models.rope),
initialised from the teacher's weights; its token embedding stays frozen (TULIP), the vision tower is not used and
stays as it was. Both see the same captions, tokenised and truncated to the teacher's context c_T. The result is a
full dual encoder (teacher's vision tower + distilled RoPE text tower) whose usable context is set to
`context_length` (> c_T); saved as a sharpclip checkpoint, it replaces the original model for fine-tuning
(`model.name=<that folder>`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from sharpclip.models import rope
from sharpclip.models.factory import sync_text_config
from sharpclip.models.hf import HFDualEncoder


@dataclass
class DistillSettings:
    """The student's shape: RoPE θ and NTK factor, and the context it is opened to after distillation."""

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


def finish(student: HFDualEncoder, settings: DistillSettings) -> HFDualEncoder:
    """Open the student's context to `settings.context_length` (NTK-scaled when enabled) and freeze it for use."""
    rope.set_rope_context(student.text_model, settings.context_length)
    sync_text_config(student)
    if student.tokenizer is not None:
        student.tokenizer.model_max_length = settings.context_length
    return student.eval()


def read_captions(path: str | Path) -> list[str]:
    """Non-empty lines of a UTF-8 text file, one caption per line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: captions file not found (expected one caption per line)")
    captions = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if len(captions) < 2:
        raise ValueError(f"{path}: needs at least 2 captions, found {len(captions)}")
    return captions
