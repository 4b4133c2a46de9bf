"""One optimisation step's forward and backward: from a `Batch` to features, to the objective, to gradients.

Features are named for the losses that read them (see losses/objective.py):

    image, image_tokens, image_token_mask          the image tower (tokens only when a term reads them)
    text, text_tokens, text_token_mask             the training caption (the long one when there are two)
    text_short                                     the short caption (CLIP-IN eq. 8's L_CL(short))
    text_frozen                                    the caption through a frozen copy of the initial text tower
                                                   (HN-CLIP Table 3c: `inputs: {reference_text: text_frozen}`)
    source_image, target_image, source_text, target_text
                                                   the rows of each edit pair in the batch (CLIP-IN eqs. 3-6)

The edit features are rows of the per-row features, selected after the micro-batches are put back together and
before the batch is gathered across ranks, so each rank's edit indices stay local.

Device placement happens here and nowhere else: `to_model_device` moves every tensor of a batch (pixels, ids, masks,
short captions, edit indices) to the device of the encoder's model, non-blocking from pinned memory; `run_step` calls
it once per step before cutting micro-batches, and the encoders call it again (a no-op for a batch already there) so
any caller may hand them a batch straight from the loader.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from sharpclip.data.schema import Batch
from sharpclip.losses import Objective
from sharpclip.losses._common import scale_from_log
from sharpclip.models.base import DualEncoder
from sharpclip.train import distributed
from sharpclip.train.accumulate import cached_gradient_step, per_micro_batch_step

EDIT_KEYS = ("source_image", "target_image", "source_text", "target_text")
SATURATED = 1e-3  # HN-CLIP §2.1: a batch (or row) whose InfoNCE loss is below this is "solved"


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's parameters (the training device: the trainer moved the model there)."""
    return next(model.parameters()).device


def to_model_device(batch: Batch, model: torch.nn.Module) -> Batch:
    """`batch` with every tensor on the model's device (the batch itself when they are there already)."""
    device = model_device(model)
    if all(v.device == device for v in vars(batch).values() if isinstance(v, Tensor)):
        return batch
    return batch.to(device)


class FeatureEncoder:
    """Encodes a (micro-)batch into the per-row features the objective reads, in float32, on the model's device."""

    def __init__(
        self,
        model: DualEncoder,
        keys: set[str],
        frozen_text: DualEncoder | None = None,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ):
        if "text_frozen" in keys and frozen_text is None:
            raise ValueError("the objective reads 'text_frozen' but no frozen text tower was given")
        self.model, self.keys, self.frozen_text, self.autocast = model, keys, frozen_text, autocast
        self.image_tokens = "image_tokens" in keys
        self.text_tokens = "text_tokens" in keys

    def __call__(self, batch: Batch) -> dict[str, Tensor]:
        m = self.model
        batch = to_model_device(batch, m)
        with self.autocast():
            feats = {
                **m.encode_image(batch.pixel_values, tokens=self.image_tokens).features("image"),
                **m.encode_text(batch.input_ids, batch.attention_mask, tokens=self.text_tokens).features("text"),
            }
            if "text_short" in self.keys:
                if batch.short_input_ids is None:
                    raise ValueError("the objective reads 'text_short' but the data has no short captions")
                feats["text_short"] = m.encode_text(batch.short_input_ids, batch.short_attention_mask).embedding
            if "text_frozen" in self.keys:
                with torch.no_grad():
                    feats["text_frozen"] = self.frozen_text.encode_text(batch.input_ids, batch.attention_mask).embedding
        return {k: v.float() if v.is_floating_point() else v for k, v in feats.items()}


class DistillEncoder:
    """Text-only features for tower distillation (CLIP-IN eq. 7): `teacher` (frozen, no graph) and `student`,
    both on the training device (the trainer places them)."""

    def __init__(self, teacher: DualEncoder, student: DualEncoder):
        self.teacher, self.model = teacher.eval().requires_grad_(False), student

    def __call__(self, batch: Batch) -> dict[str, Tensor]:
        batch = to_model_device(batch, self.model)
        with torch.no_grad():
            teacher = self.teacher.encode_text(batch.input_ids, batch.attention_mask).embedding
        student = self.model.encode_text(batch.input_ids, batch.attention_mask).embedding
        return {"teacher": teacher.float(), "student": student.float()}


def split_rows(batch: Batch, size: int) -> list[Batch]:
    """Micro-batches of `size` rows (edit indices stay with the whole batch: see `with_edits`)."""
    rows = len(batch)
    parts = []
    for start in range(0, rows, size):
        sl = slice(start, start + size)
        fields = {k: v[sl] if isinstance(v, Tensor) and v.shape[:1] == (rows,) else v for k, v in vars(batch).items()}
        fields["ids"] = batch.ids[sl]
        parts.append(replace(batch, **fields))
    return parts


def with_edits(feats: Mapping[str, Tensor], source: Tensor, target: Tensor) -> dict[str, Tensor]:
    """Add the edit-pair features: rows `source` / `target` of the image and text features. source, target: (E,)."""
    out = dict(feats)
    out.update(
        source_image=feats["image"][source],
        target_image=feats["image"][target],
        source_text=feats["text"][source],
        target_text=feats["text"][target],
    )
    return out


@dataclass
class StepResult:
    terms: dict[str, float]  # every loss term and the total, averaged as the accumulation mode defines
    monitor: dict[str, float]  # InfoNCE of the step's contrastive matrices (detached): see `combine_monitors`
    rows: int  # rows the step trained on (global), over all its contrastive matrices


def saturation_monitor(feats: Mapping[str, Tensor], logit_scale: Tensor) -> dict[str, float]:
    """InfoNCE of the global batch and the share of rows whose own loss is below 1e-3 (HN-CLIP §2.1), no grad."""
    with torch.no_grad():
        image, text = feats["image"].detach(), feats["text"].detach()
        logits = scale_from_log(logit_scale.detach()) * image @ text.t()
        labels = torch.arange(len(image), device=image.device)
        rows = torch.nn.functional.cross_entropy(logits, labels, reduction="none")  # image → text, per query
        cols = torch.nn.functional.cross_entropy(logits.t(), labels, reduction="none")  # text → image
        per_row = torch.cat([rows, cols])
        return {"infonce": float(per_row.mean()), "rows_saturated": float((per_row < SATURATED).float().mean())}


def combine_monitors(parts: list[dict[str, float]]) -> dict[str, float]:
    """One step's monitor from its contrastive matrices (one under exact accumulation, one per micro-batch under
    per_micro_batch): mean InfoNCE and saturated-row share (row-weighted), the share of matrices whose InfoNCE is
    below 1e-3 (`saturated`: HN-CLIP §2.1 counts batches of 16) and how many matrices there were."""
    measured = [m for m in parts if "infonce" in m]
    if not measured:
        return {}
    rows = sum(m["rows"] for m in measured)
    return {
        "infonce": sum(m["infonce"] * m["rows"] for m in measured) / rows,
        "rows_saturated": sum(m["rows_saturated"] * m["rows"] for m in measured) / rows,
        "saturated": sum(m["infonce"] < SATURATED for m in measured) / len(measured),
        "matrices": float(len(measured)),
    }


def run_step(
    encoder: FeatureEncoder | DistillEncoder,
    objective: Objective,
    batch: Batch,
    micro_batch_size: int,
    accumulation: str = "exact",
) -> StepResult:
    """Forward and backward over this rank's `batch` (gradients accumulate into `.grad`; no optimiser step)."""
    model = encoder.model
    batch = to_model_device(batch, model)  # once for the whole step, before the micro-batches are cut
    model_inputs = {"logit_scale": model.logit_scale, "logit_bias": model.logit_bias}
    monitors: list[dict[str, float]] = []  # one per contrastive matrix (per micro-batch under per_micro_batch)

    def prepare(feats: Mapping[str, Tensor]) -> dict[str, Tensor]:
        if "image" in feats:
            feats = with_edits(feats, batch.edit_source, batch.edit_target)
        return distributed.gather_features(feats)

    def loss_fn(feats: Mapping[str, Tensor]) -> dict[str, Tensor]:
        monitor = {"rows": float(len(next(iter(feats.values()))))}
        if "image" in feats and "text" in feats:
            monitor.update(saturation_monitor(feats, model.logit_scale))
        monitors.append(monitor)
        return objective({**feats, **model_inputs})

    micro = split_rows(batch, micro_batch_size)
    if accumulation == "exact":
        terms = cached_gradient_step(encoder, micro, loss_fn, gather=prepare, device=model_device(model))
    else:
        if len(batch.edit_source) and len(micro) > 1:
            raise ValueError("per_micro_batch accumulation cannot keep edit pairs together; use accumulation: exact")
        terms = per_micro_batch_step(encoder, micro, loss_fn, gather=prepare)
    rows = int(sum(m["rows"] for m in monitors))
    return StepResult({k: float(v) for k, v in terms.items()}, combine_monitors(monitors), rows)
