"""TinyTowers (float64) behind the calls the feature encoder makes of a `DualEncoder`, so that the real training
step (train.step.run_step: feature table, gather, local loss, cached gradients) runs on it, in float64 end to end.

`rank_batches` cuts one global batch of `tiny_batch` rows into per-rank `Batch`es of given sizes, each trimmed to its
own longest caption (so token lengths differ across ranks), with edit pairs (rows 2k, 2k + 1) kept on one rank.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from _support.tiny_towers import TinyTowers, make_batch
from sharpclip import collectives
from sharpclip.config import LossConfig, TermConfig
from sharpclip.data.sampling import GroupBatchSampler
from sharpclip.data.schema import Batch
from sharpclip.losses import Objective
from sharpclip.models.base import Embeddings
from sharpclip.train import distributed
from sharpclip.train.accumulate import cached_gradient_step
from sharpclip.train.diagnostics import gradient_diagnostics
from sharpclip.train.features import ROWS, FeatureEncoder, TowerPasses, build_objective
from sharpclip.train.parallel import ParallelContext
from sharpclip.train.step import StepResult, run_step, split_rows


class TinyDual(TinyTowers):
    def encode_image(self, pixel_values: Tensor, tokens: bool = False) -> Embeddings:
        embedding, patch = self._image(pixel_values)
        mask = torch.ones(patch.shape[:2], dtype=torch.bool, device=patch.device)
        return Embeddings(embedding, patch, mask) if tokens else Embeddings(embedding)

    def encode_text(self, input_ids: Tensor, attention_mask: Tensor, tokens: bool = False) -> Embeddings:
        embedding, words = self._text(input_ids, attention_mask)
        return Embeddings(embedding, words, attention_mask.bool()) if tokens else Embeddings(embedding)


class Float64Encoder(FeatureEncoder):
    """The feature encoder without its cast to float32 (the towers here compute in float64)."""

    def __call__(self, batch: Batch, names: Collection[str] | None = None) -> dict[str, Tensor]:
        passes = TowerPasses(self, self.to_device(batch))
        return {f.name: f.produce(passes) for f in self.rows if names is None or f.name in names}


def tiny_batch(rows: list[int], n: int = 32, seed: int = 1, edits: bool = True) -> Batch:
    """The `Batch` of global rows `rows` (trimmed to their longest caption); edits: pairs (2k, 2k + 1) present."""
    data = make_batch(n, seed=seed)
    ids, mask = data["ids"][rows], data["mask"][rows]
    keep = int(mask.sum(1).max())
    batch = Batch(ids=[f"row-{r}" for r in rows], pixel_values=data["pixels"][rows], input_ids=ids[:, :keep],
                  attention_mask=mask[:, :keep].long(), groups=torch.tensor(rows))  # fmt: skip
    if edits:
        pos = {r: k for k, r in enumerate(rows)}
        pairs = [(pos[r], pos[r + 1]) for r in rows if r % 2 == 0 and r + 1 in pos]
        batch.edit_source = torch.tensor([p[0] for p in pairs], dtype=torch.long)
        batch.edit_target = torch.tensor([p[1] for p in pairs], dtype=torch.long)
    return batch


def rank_rows(sizes: list[int]) -> list[list[int]]:
    """Consecutive global rows for ranks of `sizes` rows (rank order = the global batch's row order)."""
    starts = [sum(sizes[:r]) for r in range(len(sizes))]
    return [list(range(s, s + n)) for s, n in zip(starts, sizes, strict=True)]


# the objectives the multi-process tests run: every contrastive loss, and the composed recipes of both papers
TERMS: dict[str, dict[str, TermConfig]] = {
    "infonce": {"c": TermConfig("infonce")},
    "hn_clip": {"hn": TermConfig("hn_clip", params={"gamma": 0.5})},
    "filip": {"tok": TermConfig("filip", params={"chunk_size": 3})},
    "edit_negatives": {"e": TermConfig("edit_negatives")},
    "sigmoid": {"s": TermConfig("sigmoid", params={"gamma": 0.5})},
    "hnclip_eq3": {"hn": TermConfig("hn_clip"), "tok": TermConfig("filip", weight=0.5)},
    "clipin": {"c": TermConfig("infonce"), "e": TermConfig("edit_negatives", weight=0.1)},
}
MICRO = {"exact": 4, "exact_one": 16, "per_micro_batch": 4, "gathered": 4}  # rows per micro-batch, by mode
VARIANTS = (("hn_clip", "lora"), ("infonce", "frozen_image"))  # (objective, what the recipe changes: `_variant`)
# the (objective, mode) pairs; per_micro_batch cannot keep edit pairs together, so it runs without edits
CASES = (
    [(n, m) for m in ("exact", "exact_one") for n in TERMS]
    + [(n, "per_micro_batch") for n in ("infonce", "hn_clip", "filip", "sigmoid", "hnclip_eq3")]
    + [("infonce", "gathered"), ("hnclip_eq3", "gathered")]
    + [(f"{n}@{v}", m) for n, v in VARIANTS for m in ("exact", "per_micro_batch")]
)
# the cases also run under the sharded layouts (train.layout: shard, hybrid): both modes, LoRA, a frozen tower and
# SigLIP's bias (sigmoid)
LAYOUT_CASES = [("hnclip_eq3", "exact"), ("hn_clip", "per_micro_batch"), ("sigmoid", "exact"),
                ("hn_clip@lora", "exact"),
                ("infonce@frozen_image", "per_micro_batch")]  # fmt: skip
# rows per rank of one global batch of 16 under exact: uneven (edit pairs stay whole)
SIZES = {2: [10, 6], 4: [6, 4, 2, 4]}


def rows_for(mode: str, world: int) -> list[list[int]]:
    """Each rank's global rows for `mode` on `world` ranks. exact: consecutive, uneven (`SIZES`); otherwise the
    first batch that the training sampler (data.sampling, edit pairs as units, shuffled) deals to each rank,
    16 / world rows each. One process holding the ranks' rows concatenated in rank order is their reference."""
    if mode.startswith("exact"):
        return rank_rows(SIZES.get(world, [16]))
    units = [row // 2 for row in range(32)]
    return [next(iter(GroupBatchSampler(units, 16 // world, seed=3, rank=r, world_size=world))) for r in range(world)]


class SpiedObjective(Objective):
    """The objective, recording for every call its matrix's columns and its query rows (None: every row)."""

    def __init__(self, inner: Objective):
        super().__init__(inner.terms)
        self.calls: list[tuple[int, int | None]] = []

    def __call__(self, features):
        rows = features.get(ROWS)
        self.calls.append((len(features["image"]), None if rows is None else rows.stop - rows.start))
        return super().__call__(features)


def _variant(model: TinyDual, variant: str) -> TinyDual:
    """The model as a recipe changes it: LoRA on both projections (peft; everything else frozen) or a frozen image
    tower; "" leaves it whole (its `logit_bias` is then a parameter no CLIP loss reaches)."""
    if variant == "lora":
        from peft import LoraConfig, inject_adapter_in_model

        model.requires_grad_(False)
        config = LoraConfig(r=2, lora_alpha=4, target_modules=["image_proj", "text_proj"], init_lora_weights=False)
        model = inject_adapter_in_model(config, model).double()
        model.logit_scale.requires_grad_(True)
    elif variant == "frozen_image":
        for module in (model.patch, model.image_proj):
            module.requires_grad_(False)
    return model


def parallel_context(layout: str = "replicate", local_world: int | None = None) -> ParallelContext:
    """This process's context in the default process group with `layout`; `local_world`: processes per "node" (a
    hybrid mesh of world / local_world nodes on one machine)."""
    ctx = ParallelContext.from_process_group(layout)
    if local_world is not None and ctx.several:
        ctx = ParallelContext(rank=ctx.rank, world=ctx.world, local_world=local_world, layout=layout)
    return ctx


def run_case(name: str, mode: str, batch: Batch, device: str = "cpu", ctx: ParallelContext | None = None):
    """A training step of objective `name` (`terms@variant`, see `_variant`) in `mode` on this rank's `batch`,
    gradients averaged over ranks. On several ranks the model runs under the trainer's engine (train.engine, FSDP2
    with `ctx.layout`) and the step runs twice (the second reuses what the first set up): the second step's result.
    Returns (step result, {parameter: whole gradient} on the CPU, the objective's calls)."""
    ctx = ctx if ctx is not None else parallel_context()
    terms, _, variant = name.partition("@")
    model = _variant(TinyDual(dropout=0.0), variant).to(device)
    objective = SpiedObjective(build_objective(LossConfig(terms=TERMS[terms])))
    encoder = Float64Encoder(model, objective.feature_keys)
    params = [p for p in model.parameters() if p.requires_grad]
    if mode == "gathered":  # every rank the whole matrix (no local loss): the path of the gradient diagnostics
        micro = split_rows(encoder.to_device(batch), MICRO[mode])
        terms = cached_gradient_step(encoder, micro, lambda f: objective({**f, **encoder.model_inputs()}),
                                     gather=collectives.gather_features)  # fmt: skip
        result = StepResult({k: v.detach() for k, v in terms.items()}, {}, 0).read()
        distributed.average_gradients(params)
    else:
        accumulation = "per_micro_batch" if mode == "per_micro_batch" else "exact"
        ctx.shard(model, torch.device(device))
        for _ in range(2 if ctx.several else 1):
            model.zero_grad(set_to_none=True)
            objective.calls.clear()
            result = run_step(encoder, objective, batch, MICRO[mode], accumulation, ctx=ctx).read()
    # a gradient no loss reached counts as zero (the engine zero-fills the model scalars' to reduce them)
    grads = {n: _whole(p.grad if p.grad is not None else torch.zeros_like(p)).detach().cpu()
             for n, p in model.named_parameters() if p.requires_grad}  # fmt: skip
    return result, grads, objective.calls


def _whole(tensor: Tensor) -> Tensor:
    """A sharded (DTensor) tensor gathered whole (a collective: every rank calls it); a plain one as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def run_diagnostics(accumulation: str, batch: Batch, device: str = "cpu") -> dict:
    """The gradient diagnostics (HN-CLIP Fig. 4) of `batch` (this rank's rows) with micro-batches of 4."""
    model = TinyDual(dropout=0.0).to(device)
    encoder = Float64Encoder(model, ("image", "text"))
    return gradient_diagnostics(encoder, batch, MICRO["per_micro_batch"], 0.5, accumulation)
