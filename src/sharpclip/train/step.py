"""One optimisation step's forward and backward, top to bottom: from a `Batch` to the features the objective reads
(train.features), to the objective, to gradients accumulated in `.grad`.

    run_step(encoder, objective, batch, micro_batch_size, accumulation)
        the batch moves to the training device and is cut into micro-batches (`split_rows`), then
        exact            one contrastive matrix over the global batch (train.accumulate; a batch of one micro-batch
                         is encoded once, with nothing cached):
                           cache = CachedFeatures(encoder, micro)            row features, no graph, RNG recorded
                           features = objective_inputs(cache.leaves, batch)  edit rows, gathered, logit scale
                           terms = objective(features); (W·terms["loss"]).backward(); cache.backward()
        per_micro_batch  one matrix per micro-batch of `micro_batch_size` rows, built from this rank's rows alone
                         (never gathered), each loss divided by the number of matrices over all ranks;
                         `encode_batch_size` rows (several micro-batches) go through the towers in one pass
                         (`micro_batch_pass`), which is faster when memory allows and gives the same gradients
    → StepResult: the loss terms, the saturation monitor (the objective's diagnostic term, losses.monitors) and
      the rows trained on, all over every rank's rows. Terms and monitor stay device tensors: nothing in the step
      reads a value on the host (on a GPU that would wait for the queued kernels); the caller reads them once,
      after the backward, together with whatever else it needs (`StepResult.read`: the trainer adds the gradient
      norm).

What W processes compute, with global batch B = W·b:

- exact: every rank gathers every rank's features (sharpclip.collectives.gather) and computes the loss rows of its
  own b samples against all B columns (local loss: the losses' `rows` input, train.features). Its term values
  are its additive share of the global loss, so their sum over ranks is the loss of the B × B matrix. The
  gather's backward sums over ranks what every share sent to a rank's features, and the engine's gradient
  reduction (train.engine) averages over W ranks, so each rank backpropagates W times its share: the parameters then
  receive exactly ∂L/∂θ of the global matrix, as on one process. Each rank's matrix is b × B instead of B × B.
  On one process nothing is gathered and the losses compute the whole matrix.
- per_micro_batch: rank r's micro-batches are its own; with the W·k micro-batches of a step split over the
  ranks, each matrix is `micro_batch_size` rows at every world size and the step's gradient is their mean, the
  gradient one process computes over the same micro-batches (`check_batch_split` refuses a global batch that does
  not split into W·k of them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from sharpclip.config import ConfigError
from sharpclip.data.schema import Batch
from sharpclip.losses import Objective
from sharpclip.losses.monitors import (
    INFONCE_MONITOR,
    MATRICES_MONITOR,
    ROWS_SATURATED_MONITOR,
    SATURATED,
    SATURATED_MONITOR,
)
from sharpclip.train.accumulate import CachedFeatures
from sharpclip.train.features import EDIT_ROWS, ROWS, FeatureEncoder
from sharpclip.train.parallel import ParallelContext

ONE = ParallelContext.one_process()  # the context of a step that sees no other process


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


def check_batch_split(
    batch_size: int, micro_batch_size: int, accumulation: str, world: int, per_sample: bool = False
) -> None:
    """Refuse, under per_micro_batch, a global batch that does not split into W·k micro-batches (W ranks, k on each):
    every matrix must be `micro_batch_size` rows at every world size. A per-sample objective (`Objective.per_sample`,
    a distillation) has no matrix: a micro-batch may then span ranks in equal shares (a rank's share of the batch
    divides the micro-batch), and the mean of the shares' losses is the micro-batch's loss."""
    if accumulation != "per_micro_batch" or not batch_size % (world * micro_batch_size):
        return
    share = batch_size // world if not batch_size % world else 0
    if per_sample and share and not micro_batch_size % share:
        return
    raise ConfigError(
        f"train.batch_size ({batch_size}) must be a multiple of train.micro_batch_size ({micro_batch_size}) times the "
        f"{world} processes under train.accumulation: per_micro_batch, so that every process holds whole "
        f"micro-batches (each its own contrastive matrix); {_nearest_split(batch_size, micro_batch_size, world)}"
    )


def _nearest_split(batch_size: int, micro_batch_size: int, world: int) -> str:
    """The settings nearest to a refused split that run: fewer processes, a larger batch, or exact accumulation."""
    fits = [w for w in range(world - 1, 0, -1) if not batch_size % (w * micro_batch_size)]
    step = world * micro_batch_size
    larger = -(-batch_size // step) * step
    options = [f"{fits[0]} processes" if fits else "", f"train.batch_size={larger}",
               "train.accumulation=exact (the whole batch's matrix, any micro-batch per process)"]  # fmt: skip
    return "nearest that run: " + ", or ".join(o for o in options if o)


@dataclass
class Matrix:
    """One contrastive matrix of a step: its detached loss terms (under exact on several ranks, this rank's share),
    its diagnostic terms and its rows (all ranks' under exact)."""

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
    rows: Tensor | int  # rows the step trained on (global), over all its contrastive matrices

    def read(self, **extra: Tensor) -> StepValues:
        """Terms, monitor, rows and `extra` (0-dim tensors on the training device) as floats, in one host read."""
        named = {**{("t", k): v for k, v in self.terms.items()}, **{("m", k): v for k, v in self.monitor.items()},
                 **{("x", k): v for k, v in extra.items()}, ("r", "rows"): self.rows}  # fmt: skip
        tensors = {k: v for k, v in named.items() if isinstance(v, Tensor)}
        if tensors:
            device = next(iter(tensors.values())).device
            values = torch.stack([v.detach().double().to(device) for v in tensors.values()]).tolist()
            named.update(zip(tensors, values, strict=True))
        pick = {part: {k: float(v) for (p, k), v in named.items() if p == part} for part in "tmxr"}
        return StepValues(pick["t"], pick["m"], int(pick["r"]["rows"]), pick["x"])


def objective_inputs(
    encoder: FeatureEncoder,
    rows: Mapping[str, Tensor],
    batch: Batch,
    ctx: ParallelContext = ONE,
) -> dict[str, Tensor]:
    """What the objective reads: the row features of this rank's `batch` with its edit rows picked, plus the model
    features (logit scale and bias). ctx on several processes: every rank's features, in rank order (shapes from
    the step's agreement), and the slices of this rank's own rows and edit rows in them (`rows`, `edit_rows`: the
    losses compute those rows only); on one process the features are this rank's and no slice is added."""
    features = encoder.with_edits(rows, batch)
    if ctx.several:
        features, mine = ctx.gather(features)
        for name, kind in ((ROWS, encoder.rows), (EDIT_ROWS, encoder.edits)):
            if kind:
                features[name] = mine[kind[0].name]  # type: ignore[assignment]
    return {**features, **encoder.model_inputs()}


def _evaluated(objective: Objective, features: Mapping[str, Tensor], terms: dict[str, Tensor]) -> Matrix:
    rows = len(next(iter(features.values())))
    return Matrix({k: v.detach() for k, v in terms.items()}, objective.diagnose(features), rows)


def _like_leaves(rows: dict[str, Tensor], constant: frozenset[str]) -> dict[str, Tensor]:
    """`rows` with every floating feature requiring grad that a cache's leaves would (train.accumulate): a frozen
    tower's features then take part in the gather's backward on every rank, whether it cached or not (ranks with
    different row counts may differ in that; their collectives must not)."""
    for key, value in rows.items():
        if value.is_floating_point() and not value.requires_grad and key not in constant:
            value.requires_grad_()
    return rows


def exact_step(
    encoder: FeatureEncoder,
    objective: Objective,
    batch: Batch,
    micro: list[Batch],
    ctx: ParallelContext = ONE,
) -> Matrix:
    """The objective over the global batch at the memory of one micro-batch (cached gradients, train.accumulate);
    on several ranks, this rank's loss rows against every rank's columns (see the module docstring). A batch of one
    micro-batch has nothing to cache: one forward and one backward. Every replay but the last runs under
    `ctx.accumulating()`; the loss backward of a cached step reaches only the cached features and the model scalars
    (logit scale and bias, reduced by hand: train.engine), so it needs no switch, and without a cache it is the
    step's last backward."""
    cache = (
        CachedFeatures(encoder, micro, encoder.device, constant=encoder.constant, replay=encoder)
        if len(micro) > 1
        else None
    )
    rows = cache.leaves if cache is not None else _like_leaves(encoder(batch), encoder.constant)
    features = objective_inputs(encoder, rows, batch, ctx)
    terms = objective(features)
    (terms["loss"] * ctx.world).backward()
    if cache is not None:
        cache.backward(ctx.accumulating)
    return _evaluated(objective, features, terms)


def micro_batch_pass(
    encoder: FeatureEncoder, objective: Objective, part: Batch, micro_batch_size: int, scale: float
) -> list[Matrix]:
    """The micro-batches of `part` (consecutive runs of `micro_batch_size` rows), encoded in one forward pass and
    each its own contrastive problem; the sum of their losses times `scale` is backpropagated (ordinary
    accumulation). The towers treat rows independently, so this equals one pass per micro-batch up to float
    rounding."""
    rows = encoder(part)
    matrices, total = [], 0.0
    for micro, start in zip(split_rows(part, micro_batch_size), range(0, len(part), micro_batch_size), strict=True):
        block = {name: value[start : start + micro_batch_size] for name, value in rows.items()}
        features = objective_inputs(encoder, block, micro)
        terms = objective(features)
        total = total + terms["loss"] * scale
        matrices.append(_evaluated(objective, features, terms))
    total.backward()
    return matrices


def per_micro_batch_step(
    encoder: FeatureEncoder,
    objective: Objective,
    batch: Batch,
    micro_batch_size: int,
    encode_batch_size: int = 0,
    ctx: ParallelContext = ONE,
) -> list[Matrix]:
    """This rank's micro-batches, each its own matrix; the gradient is the mean over every rank's matrices once
    the engine has averaged over W ranks (each rank scales its losses by W / matrices over all ranks, counted from
    the step's agreed rows). Every pass but the last runs under `ctx.accumulating()`."""
    count = len(split_rows(batch, micro_batch_size))
    rows = ctx.agreement.rows if ctx.several else [len(batch)]
    matrices_everywhere = sum(-(-n // micro_batch_size) for n in rows)  # ranks may hold a short batch
    # the global batch's micro-batches, as one process sees them: the ranks' shares are dealt row by row
    # (data.sampling), so on several ranks an edit pair can straddle two of them as it would two micro-batches
    if len(batch.edit_source) and matrices_everywhere > 1:
        raise ValueError("per_micro_batch accumulation cannot keep edit pairs together; use accumulation: exact")
    scale = 1.0 / count if not ctx.several else ctx.world / matrices_everywhere
    parts = split_rows(batch, max(encode_batch_size, micro_batch_size))
    matrices = []
    for j, part in enumerate(parts):
        with ctx.accumulating() if j < len(parts) - 1 else contextlib.nullcontext():
            matrices += micro_batch_pass(encoder, objective, part, micro_batch_size, scale)
    return matrices


def term_names(objective: Objective) -> list[str]:
    """The loss terms a step returns, in order, and the total."""
    return [t.name for t in objective.terms if t.weight != 0] + ["loss"]


def _monitor_sums(matrices: list[Matrix], device: torch.device) -> Tensor:
    """Row-weighted InfoNCE and saturated-row share, measured rows, saturated matrices, measured matrices: (5,)
    float64 on the device (zeros without a monitor, so every rank takes part in the same reduction)."""
    zero = torch.zeros((), dtype=torch.float64, device=device)
    measured = [m for m in matrices if "infonce" in m.diagnostics]
    infonce = [m.diagnostics["infonce"].double() for m in measured]
    return torch.stack([
        sum((x * m.rows for x, m in zip(infonce, measured, strict=True)), zero),
        sum((m.diagnostics["rows_saturated"].double() * m.rows for m in measured), zero),
        zero + sum(m.rows for m in measured),
        sum(((x < SATURATED).double() for x in infonce), zero),
        zero + len(measured),
    ])  # fmt: skip


def combine_monitors(sums: Tensor, measured: bool) -> dict[str, Tensor]:
    """One step's monitor from the `_monitor_sums` of its contrastive matrices over all ranks (one under exact
    accumulation, one per micro-batch under per_micro_batch): mean InfoNCE and saturated-row share
    (row-weighted), the share of matrices whose InfoNCE is below 1e-3 (HN-CLIP §2.1 counts batches of 16) and how
    many matrices there were; `measured`: whether the objective has the monitor at all (else {})."""
    weighted, saturated_rows, rows, saturated, matrices = sums.unbind()
    if not measured:
        return {}
    return {
        INFONCE_MONITOR: weighted / rows,
        ROWS_SATURATED_MONITOR: saturated_rows / rows,
        SATURATED_MONITOR: saturated / matrices,
        MATRICES_MONITOR: matrices,
    }


def _summed_terms(objective: Objective, matrices: list[Matrix], device: torch.device) -> tuple[list[str], Tensor]:
    """The step's term names and, for each, its sum over `matrices` (float64, on the device)."""
    names = term_names(objective)
    zero = torch.zeros((), dtype=torch.float64, device=device)  # a rank may hold no matrix
    return names, torch.stack([sum((m.terms[n].double() for m in matrices), zero) for n in names])


def _exact_summary(objective: Objective, matrix: Matrix, device: torch.device, ctx: ParallelContext) -> StepResult:
    """The terms of the global matrix: its shares summed over ranks (one all-reduce, one read back); its monitor
    and rows are the global matrix's already."""
    names, shares = _summed_terms(objective, [matrix], device)
    terms = dict(zip(names, ctx.all_reduce_sum(shares).unbind(), strict=True))
    measured = "infonce" in matrix.diagnostics
    return StepResult(terms, combine_monitors(_monitor_sums([matrix], device), measured), matrix.rows)


def _per_micro_summary(
    objective: Objective, matrices: list[Matrix], device: torch.device, ctx: ParallelContext
) -> StepResult:
    """Every rank's matrices: terms averaged over all of them, monitor and rows summed (one all-reduce, one read)."""
    names, sums = _summed_terms(objective, matrices, device)
    counts = torch.stack([torch.full((), float(n), dtype=sums.dtype, device=device)
                          for n in (len(matrices), sum(m.rows for m in matrices))])  # fmt: skip
    values = ctx.all_reduce_sum(torch.cat([sums, counts, _monitor_sums(matrices, device)]))
    count, rows = values[len(names)], values[len(names) + 1]
    terms = {n: v / count for n, v in zip(names, values[: len(names)].unbind(), strict=True)}
    measured = any("infonce" in m.diagnostics for m in matrices)
    return StepResult(terms, combine_monitors(values[len(names) + 2 :], measured), rows)


def run_step(
    encoder: FeatureEncoder,
    objective: Objective,
    batch: Batch,
    micro_batch_size: int,
    accumulation: str = "exact",
    encode_batch_size: int = 0,
    *,
    ctx: ParallelContext = ONE,
) -> StepResult:
    """Forward and backward over this rank's `batch` (gradients accumulate into `.grad`; no optimiser step); every
    rank calls it once per step. encode_batch_size: under per_micro_batch, rows per forward pass (a multiple of
    `micro_batch_size`; 0: one micro-batch a pass). ctx: the run's parallel context: on several processes the
    step's agreement (made here unless the trainer made it for this batch), the gather, the accumulation switches
    and the engine's reduction, finished before the step's summary (every rank issues the same collectives in the
    same order)."""
    if ctx.several:
        ctx.agreed(batch)
    batch = encoder.to_device(batch)  # once for the whole step, before the micro-batches are cut
    rows_a_pass = micro_batch_size if accumulation == "exact" else max(encode_batch_size, micro_batch_size)
    passes = {-(-n // rows_a_pass) for n in (ctx.agreement.rows if ctx.several else [len(batch)])}
    with ctx.engine.step(len(passes) == 1) if ctx.engine is not None else contextlib.nullcontext():
        if accumulation == "exact":
            matrix = exact_step(encoder, objective, batch, split_rows(batch, micro_batch_size), ctx)
        else:
            matrices = per_micro_batch_step(encoder, objective, batch, micro_batch_size, encode_batch_size, ctx)
    ctx.finish_step()
    if accumulation == "exact":
        return _exact_summary(objective, matrix, encoder.device, ctx)
    return _per_micro_summary(objective, matrices, encoder.device, ctx)
