"""One optimisation step's forward and backward, top to bottom: from a `Batch` to the features the objective reads
(train.features), to the objective, to gradients accumulated in `.grad`.

    run_step(encoder, objective, batch, micro_batch_size, accumulation)
        the batch moves to the training device and is cut into micro-batches (`split_rows`), then
        exact            one contrastive matrix over the whole batch (train.accumulate; a batch of one micro-batch
                         is encoded once, with nothing cached):
                           cache = CachedFeatures(encoder, micro)            row features, no graph, RNG recorded
                           features = objective_inputs(cache.leaves, batch)  edit rows, gathered, logit scale
                           terms = objective(features); terms["loss"].backward(); cache.backward()
        per_micro_batch  one matrix per micro-batch: the same without the cache, each loss divided by their number;
                         `encode_batch_size` rows (several micro-batches) go through the towers in one pass
                         (`micro_batch_pass`), which is faster when memory allows and gives the same gradients
    → StepResult: the loss terms, the saturation monitor (the objective's diagnostic term, losses.monitors) and
      the rows trained on. Terms and monitor stay device tensors: nothing in the step reads a value on the host (on
      a GPU that would wait for the queued kernels); the caller reads them once, after the backward, together with
      whatever else it needs (`StepResult.read`: the trainer adds the gradient norm).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from sharpclip.data.schema import Batch
from sharpclip.losses import Objective
from sharpclip.losses.monitors import (
    INFONCE_MONITOR,
    MATRICES_MONITOR,
    ROWS_SATURATED_MONITOR,
    SATURATED,
    SATURATED_MONITOR,
)
from sharpclip.train import distributed
from sharpclip.train.accumulate import CachedFeatures
from sharpclip.train.features import FeatureEncoder


def split_rows(batch: Batch, size: int) -> list[Batch]:
    """Micro-batches of `size` rows (edit indices stay with the whole batch: see `FeatureEncoder.with_edits`)."""
    rows = len(batch)
    parts = []
    for start in range(0, rows, size):
        sl = slice(start, start + size)
        fields = {k: v[sl] if isinstance(v, Tensor) and v.shape[:1] == (rows,) else v for k, v in vars(batch).items()}
        fields["ids"] = batch.ids[sl]
        parts.append(replace(batch, **fields))
    return parts


@dataclass
class Matrix:
    """One contrastive matrix of a step: its detached loss terms, its diagnostic terms and its (global) rows."""

    terms: dict[str, Tensor]
    diagnostics: dict[str, Tensor]
    rows: int


@dataclass
class StepValues:
    """A step's numbers on the host (`StepResult.read`)."""

    terms: dict[str, float]
    monitor: dict[str, float]
    rows: int
    extra: dict[str, float]


@dataclass
class StepResult:
    terms: dict[str, Tensor]  # every loss term and the total (0-dim, detached), averaged as the accumulation mode says
    monitor: dict[str, Tensor | float]  # the saturation monitor of the step's contrastive matrices: `combine_monitors`
    rows: int  # rows the step trained on (global), over all its contrastive matrices

    def read(self, **extra: Tensor) -> StepValues:
        """Terms, monitor and `extra` (0-dim tensors on the training device) as floats, in one host read."""
        named = {**{("t", k): v for k, v in self.terms.items()}, **{("m", k): v for k, v in self.monitor.items()},
                 **{("x", k): v for k, v in extra.items()}}  # fmt: skip
        tensors = {k: v for k, v in named.items() if isinstance(v, Tensor)}
        if tensors:
            device = next(iter(tensors.values())).device
            values = torch.stack([v.detach().double().to(device) for v in tensors.values()]).tolist()
            named.update(zip(tensors, values, strict=True))
        pick = {part: {k: float(v) for (p, k), v in named.items() if p == part} for part in "tmx"}
        return StepValues(pick["t"], pick["m"], self.rows, pick["x"])


def objective_inputs(encoder: FeatureEncoder, rows: Mapping[str, Tensor], batch: Batch) -> dict[str, Tensor]:
    """What the objective reads: the row features of this rank's `batch` with its edit rows picked, gathered
    across ranks, plus the model features (logit scale and bias)."""
    return {**distributed.gather_features(encoder.with_edits(rows, batch)), **encoder.model_inputs()}


def _evaluated(objective: Objective, features: Mapping[str, Tensor], terms: dict[str, Tensor]) -> Matrix:
    rows = len(next(iter(features.values())))
    return Matrix({k: v.detach() for k, v in terms.items()}, objective.diagnose(features), rows)


def exact_step(encoder: FeatureEncoder, objective: Objective, batch: Batch, micro: list[Batch]) -> Matrix:
    """The objective over the whole `batch` at the memory of one micro-batch (cached gradients, train.accumulate)."""
    cache = CachedFeatures(encoder, micro, encoder.device, constant=encoder.constant, replay=encoder)
    features = objective_inputs(encoder, cache.leaves, batch)
    terms = objective(features)
    terms["loss"].backward()
    cache.backward()
    return _evaluated(objective, features, terms)


def micro_batch_pass(
    encoder: FeatureEncoder, objective: Objective, part: Batch, micro_batch_size: int, count: int
) -> list[Matrix]:
    """The micro-batches of `part` (consecutive runs of `micro_batch_size` rows), encoded in one forward pass and
    each its own contrastive problem; the sum of their losses / `count` is backpropagated (ordinary accumulation).
    The towers treat rows independently, so this equals one pass per micro-batch up to float rounding."""
    rows = encoder(part)
    matrices, total = [], 0.0
    for micro, start in zip(split_rows(part, micro_batch_size), range(0, len(part), micro_batch_size), strict=True):
        block = {name: value[start : start + micro_batch_size] for name, value in rows.items()}
        features = objective_inputs(encoder, block, micro)
        terms = objective(features)
        total = total + terms["loss"] / count
        matrices.append(_evaluated(objective, features, terms))
    total.backward()
    return matrices


def mean_terms(matrices: list[Matrix]) -> dict[str, Tensor]:
    """Each term averaged over the step's matrices (the loss of per_micro_batch is their mean)."""
    totals: dict[str, Tensor] = {}
    for m in matrices:
        for name, value in m.terms.items():
            totals[name] = totals.get(name, 0.0) + value / len(matrices)
    return totals


def combine_monitors(matrices: list[Matrix]) -> dict[str, Tensor | float]:
    """One step's monitor from its contrastive matrices (one under exact accumulation, one per micro-batch under
    per_micro_batch): mean InfoNCE and saturated-row share (row-weighted), the share of matrices whose InfoNCE is
    below 1e-3 (HN-CLIP §2.1 counts batches of 16) and how many matrices there were."""
    measured = [m for m in matrices if "infonce" in m.diagnostics]
    if not measured:
        return {}
    rows = sum(m.rows for m in measured)
    return {
        INFONCE_MONITOR: sum(m.diagnostics["infonce"] * m.rows for m in measured) / rows,
        ROWS_SATURATED_MONITOR: sum(m.diagnostics["rows_saturated"] * m.rows for m in measured) / rows,
        SATURATED_MONITOR: sum((m.diagnostics["infonce"] < SATURATED).float() for m in measured) / len(measured),
        MATRICES_MONITOR: float(len(measured)),
    }


def run_step(
    encoder: FeatureEncoder,
    objective: Objective,
    batch: Batch,
    micro_batch_size: int,
    accumulation: str = "exact",
    encode_batch_size: int = 0,
) -> StepResult:
    """Forward and backward over this rank's `batch` (gradients accumulate into `.grad`; no optimiser step).
    encode_batch_size: under per_micro_batch, rows per forward pass (a multiple of `micro_batch_size`; 0: one
    micro-batch a pass)."""
    batch = encoder.to_device(batch)  # once for the whole step, before the micro-batches are cut
    micro = split_rows(batch, micro_batch_size)
    if accumulation == "exact":
        if len(micro) == 1:  # nothing to cache: one forward and one backward
            matrices = micro_batch_pass(encoder, objective, batch, len(batch), 1)
        else:
            matrices = [exact_step(encoder, objective, batch, micro)]
        terms = dict(matrices[0].terms)
    else:
        if len(batch.edit_source) and len(micro) > 1:
            raise ValueError("per_micro_batch accumulation cannot keep edit pairs together; use accumulation: exact")
        matrices = []
        for part in split_rows(batch, max(encode_batch_size, micro_batch_size)):
            matrices += micro_batch_pass(encoder, objective, part, micro_batch_size, len(micro))
        terms = mean_terms(matrices)
    return StepResult(terms, combine_monitors(matrices), sum(m.rows for m in matrices))
