"""The feature table: every tensor a loss term may read, its shape, how it is computed from the model and the batch,
and what the run must provide for it. The objective is built against this table (an input naming anything else is
a config error) and `FeatureEncoder` computes exactly the features the objective reads, by looping over it.

    name              shape        computed from                                           needs
    image             (B, D)       the image tower's pooled embedding
    image_tokens      (B, P, D)    the image tower's patch tokens (FILIP; HN-CLIP §2.3)
    image_token_mask  (B, P) bool  True for a real patch
    text              (B, D)       the training caption (the long one when there are two)
    text_tokens       (B, L, D)    the training caption's tokens
    text_token_mask   (B, L) bool  True for a real token
    text_short        (B, D)       the short caption (CLIP-IN eq. 8's L_CL(short))            short captions
    text_frozen       (B, D)       the caption through a frozen copy of the initial tower      (built here)
                                   (HN-CLIP Table 3c: `inputs: {reference_text: text_frozen}`)
    teacher           (B, D)       the caption through the distillation teacher (CLIP-IN eq. 7) a teacher
    student           (B, D)       the trained model's caption embedding (`text`), for eq. 7
    source_image, target_image, source_text, target_text
                      (E, D)       rows of image / text picked by the batch's edit index        edit pairs
                                   (CLIP-IN eqs. 3-6)
    logit_scale       ()           the model's log-space scale
    logit_bias        ()           the model's sigmoid bias (None for softmax-trained models)
    rows, edit_rows   slice of B/E the rows of the gathered batch that are this rank's own   several ranks
                                   (local loss; train.step)

Three kinds of feature, computed at three moments of a step:

- `row` features are encoded per micro-batch, under the towers' autocast, and returned in float32 (masks stay
  bool); they are what exact accumulation caches and replays (train.accumulate);
- `edit` features are rows of a row feature, picked after the micro-batches are put back together and before the
  batch is gathered across ranks, so each rank's edit indices stay local;
- `model` features are the model's own parameters, added after gathering;
- `rows` features say which rows of the gathered batch this rank holds (on several ranks under exact
  accumulation): a loss computes the loss rows of those samples against every rank's columns and returns its
  share of the global loss (local loss). `build_objective` binds each term's `rows` argument to `rows` or
  `edit_rows`, after the first dim of the term's inputs; on one process neither is given and a loss computes
  every row.

Device placement happens here and nowhere else: `to_model_device` moves every tensor of a batch (pixels, ids, masks,
short captions, edit indices) to the device of the encoder's model, non-blocking from pinned memory; train.step
calls it once per step before cutting micro-batches, and the encoder calls it again (a no-op for a batch already
there) so any caller may hand it a batch straight from the loader.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from sharpclip.config import ConfigError, LossConfig, TermConfig
from sharpclip.data.schema import EDIT_PAIRS, SHORT_CAPTIONS, Batch
from sharpclip.losses import Objective, registry
from sharpclip.losses import build_objective as build_terms
from sharpclip.models.base import DualEncoder, Embeddings

FROZEN_TEXT = "frozen_text_tower"  # a frozen copy of the initial model, built by the encoder
TEACHER = "teacher"  # a teacher text tower: only `sharpclip distill` provides one
ROWS, EDIT_ROWS = registry.ROWS, "edit_rows"  # this rank's slice of the gathered batch rows / edit rows (local loss)


@dataclass(frozen=True)
class Need:
    """Something beyond the model and the batch's images and captions that a feature needs."""

    what: str
    fix: str


NEEDS = {
    SHORT_CAPTIONS: Need(
        "short captions in the data",
        "train on data whose samples carry a short caption (generic formats: data.short_caption_field), or drop "
        "the term",
    ),
    EDIT_PAIRS: Need(
        "instruction-edit pairs in the data",
        "add edit pairs (data.edits_format and data.edits_root, or a split with edits such as SynthDense's "
        "train+edits), or drop the term",
    ),
    FROZEN_TEXT: Need("a frozen copy of the initial text tower", "nothing: the feature encoder builds it"),
    TEACHER: Need("a teacher text tower", "only `sharpclip distill` provides one"),
}
DATA_NEEDS = (SHORT_CAPTIONS, EDIT_PAIRS)  # what the data must carry; `data` loaders list them in `provides`


@dataclass(frozen=True)
class Feature:
    """One named tensor a loss may read. `dims` name its axes (B rows, E edit pairs, D width, P patches, L tokens);
    `produce` computes it: row features from a micro-batch's `TowerPasses`, edit features from the row features and
    the batch, model features from the model."""

    name: str
    dims: tuple[str, ...]
    doc: str
    kind: str  # row | edit | model | rows
    produce: Callable[..., Tensor | None]
    needs: str | None = None  # a key of NEEDS
    reads: str = ""  # an edit feature: the row feature it picks rows of
    mask: bool = False  # a bool mask, not an embedding
    width: str = ""  # the batch field whose dim 1 is this feature's dim 1 (caption tokens: input_ids)

    @property
    def shape(self) -> str:
        """'(B, D)', '(B, P) bool', '()'."""
        return f"({', '.join(self.dims)})" + (" bool" if self.mask else "")


class TowerPasses:
    """The tower passes of one micro-batch, each run at most once, in the order the table asks for them."""

    def __init__(self, encoder: FeatureEncoder, batch: Batch):
        self.encoder, self.batch = encoder, batch
        self._done: dict[str, Embeddings] = {}

    def _once(self, key: str, run: Callable[[], Embeddings]) -> Embeddings:
        if key not in self._done:
            self._done[key] = run()
        return self._done[key]

    def image(self) -> Embeddings:
        """The trained model's image tower (with tokens when the objective reads them)."""
        e, b = self.encoder, self.batch
        return self._once("image", lambda: e.model.encode_image(b.pixel_values, tokens=e.image_tokens))

    def text(self) -> Embeddings:
        """The trained model's text tower on the training caption."""
        e, b = self.encoder, self.batch
        return self._once("text", lambda: e.model.encode_text(b.input_ids, b.attention_mask, tokens=e.text_tokens))

    def short_text(self) -> Embeddings:
        """The trained model's text tower on the short caption."""
        b = self.batch
        if b.short_input_ids is None:
            raise ValueError("the objective reads 'text_short' but the data has no short captions")
        return self._once("short", lambda: self.encoder.model.encode_text(b.short_input_ids, b.short_attention_mask))

    def frozen_text(self) -> Embeddings:
        """The frozen initial text tower on the training caption (no graph)."""
        return self._once("frozen", lambda: self._frozen(self.encoder.towers[FROZEN_TEXT]))

    def teacher_text(self) -> Embeddings:
        """The distillation teacher on the training caption (no graph)."""
        return self._once("teacher", lambda: self._frozen(self.encoder.towers[TEACHER]))

    def _frozen(self, tower: DualEncoder) -> Embeddings:
        with torch.no_grad():
            return tower.encode_text(self.batch.input_ids, self.batch.attention_mask)


def _edit_rows(reads: str, index: str) -> Callable[[Mapping[str, Tensor], Batch], Tensor]:
    return lambda rows, batch: rows[reads][getattr(batch, index)]


def _row(name, dims, doc, produce, needs=None, mask=False) -> Feature:
    width = "input_ids" if name.startswith("text_token") else ""  # a caption's tokens: as wide as its batch
    return Feature(name, dims, doc, "row", produce, needs, mask=mask, width=width)


def _edit(name: str, reads: str, index: str, doc: str) -> Feature:
    return Feature(name, ("E", "D"), doc, "edit", _edit_rows(reads, index), EDIT_PAIRS, reads)


TABLE: tuple[Feature, ...] = (
    _row("image", ("B", "D"), "L2-normalised image embedding", lambda p: p.image().embedding),
    _row("image_tokens", ("B", "P", "D"), "L2-normalised patch tokens (FILIP)", lambda p: p.image().tokens),
    _row("image_token_mask", ("B", "P"), "True for a real patch", lambda p: p.image().token_mask, mask=True),
    _row("text", ("B", "D"), "L2-normalised embedding of the training caption", lambda p: p.text().embedding),
    _row("text_tokens", ("B", "L", "D"), "L2-normalised caption tokens (FILIP)", lambda p: p.text().tokens),
    _row("text_token_mask", ("B", "L"), "True for a real token", lambda p: p.text().token_mask, mask=True),
    _row("text_short", ("B", "D"), "the short caption's embedding (CLIP-IN eq. 8)",
         lambda p: p.short_text().embedding, SHORT_CAPTIONS),
    _row("text_frozen", ("B", "D"), "the caption through the frozen initial tower (HN-CLIP Table 3c)",
         lambda p: p.frozen_text().embedding, FROZEN_TEXT),
    _row("teacher", ("B", "D"), "the caption through the distillation teacher (CLIP-IN eq. 7)",
         lambda p: p.teacher_text().embedding, TEACHER),
    _row("student", ("B", "D"), "the trained model's caption embedding, as `text` (CLIP-IN eq. 7)",
         lambda p: p.text().embedding),
    _edit("source_image", "image", "edit_source", "the source image of each edit pair (CLIP-IN eqs. 3-6)"),
    _edit("target_image", "image", "edit_target", "the edited image of each edit pair"),
    _edit("source_text", "text", "edit_source", "the source caption of each edit pair"),
    _edit("target_text", "text", "edit_target", "the target caption of each edit pair"),
    Feature("logit_scale", (), "the model's log-space logit scale", "model", lambda m: m.logit_scale),
    Feature("logit_bias", (), "the model's sigmoid bias (None for softmax models)", "model", lambda m: m.logit_bias),
    Feature(ROWS, ("B",), "this rank's rows of the gathered batch, a slice (local loss)", "rows", lambda: None),
    Feature(EDIT_ROWS, ("E",), "this rank's rows of the gathered edit pairs, a slice", "rows", lambda: None),
)  # fmt: skip
FEATURES: dict[str, Feature] = {f.name: f for f in TABLE}


def build_objective(cfg: LossConfig, monitor: bool = True) -> Objective:
    """The objective of `cfg.terms`, every input checked against the feature table (losses.build_objective);
    `monitor`: with the InfoNCE saturation diagnostic (image-caption objectives). A term's local-loss `rows`
    argument reads `edit_rows` when its inputs are edit features (E rows), else `rows`."""
    terms = {name: _with_rows(name, term) for name, term in cfg.terms.items()}
    return build_terms(replace(cfg, terms=terms), FEATURES, monitor=monitor)


def _with_rows(name: str, term: TermConfig) -> TermConfig:
    """`term` with its `rows` input bound to the slice of the row dim its tensor inputs share."""
    try:
        spec = registry.get(term.loss)
    except KeyError:
        return term  # losses.build_objective names the unknown loss
    if ROWS not in spec.optional_inputs or ROWS in term.inputs:
        return term
    keys = [term.inputs.get(arg, arg) for arg in spec.inputs + spec.optional_inputs if arg != ROWS]
    dims = {FEATURES[k].dims[0] for k in keys if k in FEATURES and FEATURES[k].kind in ("row", "edit")}
    if len(dims) > 1:
        raise ConfigError(
            f"loss.terms.{name}.inputs: '{term.loss}' pairs batch rows with edit rows "
            f"({', '.join(k for k in keys if k in FEATURES)}); map all its inputs to batch features or all to "
            "edit features"
        )
    return replace(term, inputs={**term.inputs, ROWS: EDIT_ROWS}) if dims == {"E"} else term


def check_provided(objective: Objective, provided: Collection[str], source: str) -> None:
    """Refuse, before training, an objective reading a feature whose data `source` does not provide (`provided`:
    the loader's `provides`), naming the term's input and what to do."""
    for term, arg, key in objective.bindings():
        need = FEATURES[key].needs if key in FEATURES else None
        if need in DATA_NEEDS and need not in provided:
            raise ConfigError(
                f"loss.terms.{term}.inputs.{arg}: feature '{key}' needs {NEEDS[need].what}, but {source} has none; "
                f"{NEEDS[need].fix}"
            )


def frozen_text_copy(model: DualEncoder) -> DualEncoder:
    """A frozen copy of `model` for `encode_text` only: the vision tower is not copied (None in the copy), which
    spares a ViT-L its ~1.2 GB of fp32 weights."""
    vision = getattr(model, "vision_model", None)
    skip = {id(vision): None} if vision is not None else {}  # deepcopy's memo: "already copied", as None
    return copy.deepcopy(model, memo=skip).eval().requires_grad_(False)


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
    """Computes the features named in `names` (the objective's `feature_keys`) for a batch, on the model's device.

    teacher: the tower behind `teacher` (distillation). A frozen copy of `model` is made here when `text_frozen`
    is read. precision: bf16 runs the towers under autocast (features are returned in float32).
    """

    def __init__(
        self, model: DualEncoder, names: Collection[str], *, teacher: DualEncoder | None = None, precision: str = "fp32"
    ):
        unknown = sorted(set(names) - FEATURES.keys())
        if unknown:
            raise ValueError(f"no feature named {', '.join(unknown)}; the feature table has: {', '.join(FEATURES)}")
        self.model, self.names, self.precision = model, frozenset(names), precision
        self.edits = [f for f in TABLE if f.kind == "edit" and f.name in self.names]
        wanted = self.names | {f.reads for f in self.edits}
        self.rows = [f for f in TABLE if f.kind == "row" and f.name in wanted]
        self.image_tokens = bool(wanted & {"image_tokens", "image_token_mask"})
        self.text_tokens = bool(wanted & {"text_tokens", "text_token_mask"})
        self.towers: dict[str, DualEncoder] = {}
        if teacher is not None:
            self.towers[TEACHER] = teacher.eval().requires_grad_(False)
        needs = {f.needs for f in self.rows}
        if TEACHER in needs and TEACHER not in self.towers:
            raise ValueError("the objective reads 'teacher' but no teacher tower was given")
        if FROZEN_TEXT in needs:  # HN-CLIP Table 3c: Ḡ from the initial text tower, frozen
            self.towers[FROZEN_TEXT] = frozen_text_copy(model)

    def to(self, device: torch.device) -> FeatureEncoder:
        """Move the model and every frozen tower to `device`."""
        for module in (self.model, *self.towers.values()):
            module.to(device)
        return self

    @property
    def device(self) -> torch.device:
        """The training device (the model's)."""
        return model_device(self.model)

    def to_device(self, batch: Batch) -> Batch:
        """`batch` on the training device (see `to_model_device`)."""
        return to_model_device(batch, self.model)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.precision != "bf16":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def __call__(self, batch: Batch, names: Collection[str] | None = None) -> dict[str, Tensor]:
        """The row features of a (micro-)batch, float32 (masks bool), in table order; `names`: only those (the
        exact replay asks for the features that received a gradient, so frozen towers do not run again)."""
        batch = self.to_device(batch)
        passes = TowerPasses(self, batch)
        rows = self.rows if names is None else [f for f in self.rows if f.name in names]
        with self._autocast():
            feats = {f.name: f.produce(passes) for f in rows}
        return {k: v.float() if v.is_floating_point() else v for k, v in feats.items()}

    @property
    def constant(self) -> frozenset[str]:
        """Row features that never carry a gradient: those of the frozen towers (Ḡ's text tower, the teacher)."""
        return frozenset(f.name for f in self.rows if f.needs in (FROZEN_TEXT, TEACHER))

    def with_edits(self, rows: Mapping[str, Tensor], batch: Batch) -> dict[str, Tensor]:
        """`rows` (the row features of all of `batch`) plus the edit features picked by its edit index."""
        return {**rows, **{f.name: f.produce(rows, batch) for f in self.edits}}

    def model_inputs(self) -> dict[str, Any]:
        """The model features (logit scale and bias), read after the batch is gathered."""
        return {f.name: f.produce(self.model) for f in TABLE if f.kind == "model"}

    def restricted(self, names: Collection[str]) -> FeatureEncoder:
        """An encoder over the same model and towers computing only `names` (the gradient diagnostics)."""
        other = FeatureEncoder(self.model, names, precision=self.precision)
        other.towers = self.towers
        return other
