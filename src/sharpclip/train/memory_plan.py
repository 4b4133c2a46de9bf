"""A memory plan before the run: what each rank holds for a model, precision, layout and world size.

Per rank, in bytes:

- **parameters**: the fp32 master weights, every tensor of the model (frozen ones too);
- **gradients**: one fp32 gradient per trainable weight;
- **optimiser**: AdamW's two fp32 moments per trainable weight, plus one fp32 step counter per trainable tensor;
- **compute copies**: under `train.precision: bf16`, the bf16 weights the matmuls read (every weight on a
  replicated rank, held for the backward); on a sharded rank what the engine holds gathered (`gathered_bytes`):
  the towers' and the root's own parameters and two of the largest transformer block at a time (the block computing
  and the next, prefetched), or with `train.keep_gathered` every parameter plus, under accumulation, an fp32
  unsharded gradient of every trainable one;
- **frozen reference tower**: HN-CLIP Table 3c's frozen copy of the initial text tower (`text_frozen`), replicated;
- **activations per row**: what one row of a forward pass saves for its backward, per tower.

`train.layout` divides the first three: `replicate` keeps all of them on every rank (DDP's semantics), `shard`
divides each tensor over all ranks along its first dimension (FSDP2's dim-0 chunks: rank 0 holds the rounded-up
share, the figure given), `hybrid` over the ranks of one node (LOCAL_WORLD_SIZE, or `--gpus-per-node`).

Activations come from one of two sources, and the plan says which:

- **estimated** from the shapes: layers × tokens × width × `ACTIVATION_BYTES[precision]` per tower (QuickGELU;
  `EXACT_GELU_BYTES` for exact GELU, whose MLP saves one tensor fewer), the bytes per
  (layer, token, channel) that a 4× MLP CLIP block saves for its backward (measured by `measure_activations` on the
  CPU, see docs/gpus.md); with `train.grad_checkpointing` each layer keeps only its fp32 input, plus one layer
  recomputed at a time;
- **measured** by `measure_activations`: a real forward and backward of 1 and 2 rows at the run's precision and full
  text context on the given device, the bytes the autograd graph saved (and on CUDA the peak allocated) counted
  for each row count, the difference being one row.

What the plan leaves out: the loss's own tensors (the B × B logits, FILIP's token similarities, gathered features),
communication buffers, and the CUDA context; the fit to a GPU subtracts `CONTEXT_BYTES` and keeps `HEADROOM` of the
memory free for them and for the allocator's fragmentation.

`plan_for(cfg, arch=...)` builds the model's structure on the meta device (no weights read) from a tiny preset, a
local folder's config, or an open_clip architecture name (`ViT-L-14`, `ViT-bigG-14`, ...), and `Plan.lines()` is
what `sharpclip config RECIPE --memory` and the start of `train.log` print.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, CLIPConfig, CLIPModel

from sharpclip import devices
from sharpclip.config import AUTO, Config, ConfigError
from sharpclip.models import factory, open_clip
from sharpclip.models.hf import wrap
from sharpclip.train.layout import Layout
from sharpclip.train.logging import log

GIB = 1 << 30
ADAMW_MOMENTS = 2  # exp_avg and exp_avg_sq, in the parameters' dtype (fp32)
STEP_BYTES = 4  # AdamW's per-tensor step counter: a float32 scalar
PREFETCHED_BLOCKS = 2  # a sharded rank holds the block computing and the next one gathered ahead
HIDDEN_BYTES = 4  # a layer's input (the fp32 residual stream), what gradient checkpointing keeps per layer
# bytes saved for the backward per (layer, token, channel) of a CLIP block (4× MLP, SDPA attention); measured on
# the CPU by measure_activations (tests/train/test_train_memory_plan.py and docs/gpus.md give the run)
ACTIVATION_BYTES = {"fp32": 84.0, "bf16": 52.0}  # QuickGELU (OpenAI's weights): its sigmoid and product are saved
EXACT_GELU_BYTES = {"fp32": 68.0, "bf16": 42.0}  # exact GELU (open_clip's ViT-L-14, ViT-bigG-14 ...): one MLP tensor
CONTEXT_BYTES = int(1.5 * GIB)  # CUDA context, NCCL and communication buffers: assumed, not measured
HEADROOM = 0.10  # share of the GPU's memory kept free for the allocator's fragmentation and the loss's tensors
SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20,
              "gib": GIB, "tib": 1 << 40}  # fmt: skip


@dataclass(frozen=True)
class Tower:
    """One transformer tower's activation shape: layers × tokens × width."""

    name: str
    layers: int
    tokens: int
    width: int
    activation: str = "quick_gelu"  # the MLP's (transformers' hidden_act): what a block saves depends on it


@dataclass(frozen=True)
class ModelShape:
    """What the plan reads off a model: every parameter's shape, element size and whether it trains; the largest
    transformer block's parameter count; the towers' shapes; the frozen reference tower's bytes (0 without one)."""

    params: tuple[tuple[tuple[int, ...], int, bool], ...]
    largest_block: int
    towers: tuple[Tower, ...]
    frozen_reference: int = 0
    block_params: int = 0  # every transformer block's parameters together (the rest: the towers' and the root's)


@dataclass(frozen=True)
class Plan:
    """Per-rank bytes for one run (see the module docstring for each item)."""

    layout: str
    world: int
    shard_ranks: int  # the ranks each tensor is divided over (1: replicated)
    precision: str
    parameters: int
    gradients: int
    optimizer: int
    compute_copies: int
    frozen_reference: int
    activations: dict[str, int]  # per row, by tower
    activation_source: str  # "estimated" or "measured on <device>"
    checkpointing: bool
    rows_per_pass: int | None  # the config's rows per forward pass on a rank (None: auto)
    total_params: int = 0
    trainable_params: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)
    diagnostics_copy: int = 0  # the gradient diagnostics' plain copy of the model on several ranks (train.diagnostics)

    @property
    def static(self) -> int:
        parts = (self.parameters, self.gradients, self.optimizer, self.compute_copies, self.frozen_reference)
        return sum(parts) + self.diagnostics_copy

    @property
    def per_row(self) -> int:
        return sum(self.activations.values())

    def total(self, rows: int) -> int:
        return self.static + rows * self.per_row

    def largest_rows(self, gpu_bytes: int) -> int:
        """Rows per forward pass that fit a GPU of `gpu_bytes` after the context and the headroom (0: none)."""
        free = usable(gpu_bytes) - self.static
        return max(0, free // self.per_row) if self.per_row else 0

    def lines(self, gpu_bytes: int | None = None) -> list[str]:
        """The plan in words, one item a line (what `--memory` prints and train.log records)."""
        share = f"divided over {self.shard_ranks} ranks" if self.shard_ranks > 1 else "whole on every rank"
        out = [
            f"memory plan per rank: layout {self.layout} ({share}), world size {self.world}, precision "
            f"{self.precision}; {self.total_params:,} parameters, {self.trainable_params:,} trainable",
            _item("parameters (fp32 master weights)", self.parameters),
            _item("gradients (fp32)", self.gradients),
            _item("optimiser (AdamW, 2 fp32 moments)", self.optimizer),
        ]
        if self.compute_copies:
            out.append(_item(f"compute copies ({self._copies()})", self.compute_copies))
        if self.frozen_reference:
            out.append(_item("frozen reference text tower", self.frozen_reference))
        if self.diagnostics_copy:
            out.append(_item("gradient diagnostics' model copy", self.diagnostics_copy))
        out.append(_item("static", self.static))
        towers = ", ".join(f"{k} {size(v)}" for k, v in self.activations.items())
        ckpt = ", gradient checkpointing" if self.checkpointing else ""
        out.append(_item(f"activations per row ({self.activation_source}{ckpt})", self.per_row) + f" ({towers})")
        if self.rows_per_pass:
            rows = self.rows_per_pass
            out.append(_item(f"total at {rows} rows a pass (the config's)", self.total(rows)))
        if gpu_bytes:
            out.append(self._fit_line(gpu_bytes))
        return out + [f"  note: {n}" for n in self.notes]

    def _copies(self) -> str:
        gathered = "gathered units" if self.shard_ranks > 1 else ""
        return ", ".join(x for x in ("bf16" if self.precision == "bf16" else "", gathered) if x) or "none"

    def _fit_line(self, gpu_bytes: int) -> str:
        rows = self.largest_rows(gpu_bytes)
        head = (f"  on a {size(gpu_bytes)} GPU ({size(usable(gpu_bytes))} usable after {size(CONTEXT_BYTES)} of "
                f"context and {HEADROOM:.0%} headroom): ")  # fmt: skip
        if rows < 1:
            return head + "the static part alone does not fit; use train.layout=shard, more ranks or an adapter"
        verdict = ""
        if self.rows_per_pass:
            verdict = "; the config's pass fits" if self.rows_per_pass <= rows else (
                "; the config's pass does NOT fit: lower train.micro_batch_size (or encode_batch_size), or turn on "
                "train.grad_checkpointing")  # fmt: skip
        return head + f"largest micro-batch about {rows} rows a pass{verdict}"


def usable(gpu_bytes: int) -> int:
    """What the plan may fill of a GPU of `gpu_bytes`."""
    return int(gpu_bytes * (1 - HEADROOM)) - CONTEXT_BYTES


def size(n: int) -> str:
    """Bytes in GiB, MiB or KiB, whichever reads best."""
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale / 10 or unit == "KiB":
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _item(label: str, n: int) -> str:
    return f"  {label:<48} {size(n):>11}"


def parse_size(text: str) -> int:
    """'80GiB', '80GB', '141 GB', '24g' → bytes (a bare number is bytes; g/m/k mean GiB/MiB/KiB)."""
    raw = str(text).strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number) :]
    unit = {"g": "gib", "m": "mib", "k": "kib", "t": "tib"}.get(unit, unit)
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in SIZE_UNITS or not value > 0:
        raise ConfigError(f"--gpu-memory {text!r}: give a size such as 80GiB, 80GB or 141GB")
    return int(value * SIZE_UNITS[unit])


# -- the arithmetic -----------------------------------------------------------------------------------------------
def shard_ranks(layout: str, world: int, local: int) -> int:
    """The ranks each tensor is divided over (train.layout.Layout, the engine's own source)."""
    return Layout(layout, world, local).shard_ranks


def sharded_bytes(shape: tuple[int, ...], element: int, ranks: int) -> int:
    """Bytes rank 0 holds of one tensor divided along dim 0 over `ranks` (FSDP2's chunks; a scalar is one row)."""
    rows, rest = (shape[0], math.prod(shape[1:])) if shape else (1, 1)
    return math.ceil(rows / ranks) * rest * element


def plan(
    shape: ModelShape,
    precision: str,
    layout: str,
    world: int = 1,
    local: int = 1,
    activations: dict[str, int] | None = None,
    source: str = "estimated",
    checkpointing: bool = False,
    rows_per_pass: int | None = None,
    keep_gathered: bool = False,
    accumulating: bool = False,
) -> Plan:
    """The per-rank plan for `shape` (pure: no tensor is allocated). `activations`: measured bytes per row by tower
    (without checkpointing); None estimates them from the shapes. `keep_gathered` (train.keep_gathered) and
    `accumulating` (several backwards a step) say what a sharded rank holds gathered (`gathered_bytes`)."""
    ranks = shard_ranks(layout, world, local)
    params = sum(sharded_bytes(s, e, ranks) for s, e, _ in shape.params)
    trained = [(s, e) for s, e, t in shape.params if t]
    grads = sum(sharded_bytes(s, e, ranks) for s, e in trained)
    optimizer = ADAMW_MOMENTS * grads + STEP_BYTES * len(trained)
    copies = gathered_bytes(shape, precision, ranks, keep_gathered, accumulating)
    full = activations or estimate_activations(shape.towers, precision)
    per_row = {t.name: checkpointed(t, full[t.name]) if checkpointing else full[t.name] for t in shape.towers}
    total = sum(math.prod(s) for s, _, _ in shape.params)
    trainable = sum(math.prod(s) for s, _, t in shape.params if t)
    return Plan(layout, world, ranks, precision, params, grads, optimizer, copies, shape.frozen_reference, per_row,
                source, checkpointing, rows_per_pass, total, trainable)  # fmt: skip


def gathered_bytes(shape: ModelShape, precision: str, ranks: int, keep_gathered: bool, accumulating: bool) -> int:
    """Bytes a rank holds gathered during a step, as the engine (train.engine) does. Replicated: the bf16 copy of
    every weight under bf16 (none at fp32). Sharded: in the compute dtype, the towers' and the root's own parameters
    (kept from their forward to their backward) and PREFETCHED_BLOCKS of the largest block; with `keep_gathered`
    every parameter instead, and while `accumulating` an unsharded fp32 gradient of every trainable parameter
    (FSDP2 upcasts a no-sync gradient to the reduction's dtype)."""
    total = sum(math.prod(s) for s, _, _ in shape.params)
    if ranks == 1:
        return total * 2 if precision == "bf16" else 0
    element = 2 if precision == "bf16" else 4
    if not keep_gathered:
        return (total - shape.block_params + PREFETCHED_BLOCKS * shape.largest_block) * element
    trainable = sum(math.prod(s) for s, _, t in shape.params if t)
    return total * element + (4 * trainable if accumulating else 0)


def estimate_activations(towers: Iterable[Tower], precision: str) -> dict[str, int]:
    """Bytes per row by tower: layers × tokens × width × the bytes a block of that tower's activation saves
    (ACTIVATION_BYTES for QuickGELU, EXACT_GELU_BYTES for exact GELU, by precision)."""
    table = {t.name: EXACT_GELU_BYTES if t.activation.startswith("gelu") else ACTIVATION_BYTES for t in towers}
    return {t.name: int(t.layers * t.tokens * t.width * table[t.name][precision]) for t in towers}


def checkpointed(tower: Tower, full: int) -> int:
    """Per row under gradient checkpointing: every layer's fp32 input, plus one layer's activations recomputed."""
    return tower.layers * tower.tokens * tower.width * HIDDEN_BYTES + full // max(1, tower.layers)


# -- reading a model -----------------------------------------------------------------------------------------------
def model_shape(model: nn.Module, frozen_reference: bool = False) -> ModelShape:
    """The `ModelShape` of a sharpclip dual encoder (real or on the meta device); `frozen_reference`: the objective
    reads `text_frozen`, so the feature encoder holds a frozen copy of the text side."""
    params = tuple((tuple(p.shape), p.element_size(), p.requires_grad) for p in model.parameters())
    blocks = [sum(p.numel() for p in b.parameters()) for b in _blocks(model)]
    towers = tuple(t for t in (_tower("vision", model.vision_model), _tower("text", model.text_model, model)) if t)
    reference = 0
    if frozen_reference:  # the text tower and its projection, as FeatureEncoder copies them
        text = [*model.text_model.parameters(), *_text_projection(model)]
        reference = sum(p.numel() * p.element_size() for p in text)
    return ModelShape(params, max(blocks, default=0), towers, reference, sum(blocks))


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: the children of every ModuleList named `layers` (HF encoders' `encoder.layers`)."""
    return [b for name, m in model.named_modules() if name.endswith("layers") and isinstance(m, nn.ModuleList)
            for b in m]  # fmt: skip


def _text_projection(model: nn.Module) -> list[nn.Parameter]:
    proj = getattr(getattr(model, "hf_model", model), "text_projection", None)
    return list(proj.parameters()) if isinstance(proj, nn.Module) else []


def _tower(name: str, tower: nn.Module | None, model: nn.Module | None = None) -> Tower | None:
    if tower is None:
        return None
    layers = [b for n, m in tower.named_modules() if n.endswith("layers") and isinstance(m, nn.ModuleList) for b in m]
    width = int(getattr(tower.config, "hidden_size", 0))
    if model is not None:  # text: the whole context, the widest batch a run can meet
        tokens = int(model.context_length)
    else:
        table = getattr(getattr(tower, "embeddings", None), "position_embedding", None)
        tokens = int(table.num_embeddings) if isinstance(table, nn.Embedding) else _patches(tower.config)
    return Tower(name, len(layers), tokens, width, str(getattr(tower.config, "hidden_act", "quick_gelu")))


def _patches(config: Any) -> int:
    side = int(config.image_size) // int(config.patch_size)
    return int(getattr(config, "num_patches", side * side))


# -- measuring activations -------------------------------------------------------------------------------------------
def saved_bytes(run: Callable[[], torch.Tensor], skip: Iterable[torch.Tensor] = ()) -> int:
    """Bytes the autograd graph of `run()` saves for its backward (each storage once; tensors sharing storage with
    `skip`, the weights, not counted); the backward then runs, so the graph is really built and freed."""
    skipped = {t.untyped_storage().data_ptr() for t in skip}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skipped and t.device.type != "meta":
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    out.float().sum().backward()
    return sum(seen.values())


def measure_activations(model: nn.Module, precision: str, device: torch.device) -> dict[str, int]:
    """Bytes per row by tower, measured: a forward and backward of 1 and 2 rows (random pixels, captions at the full
    context) at `precision`; per row = 2 rows − 1 row (the bf16 weight copies and other fixed costs cancel). Counts
    the saved tensors; on CUDA the larger of that and the peak allocated. Leaves weights, gradients and every random
    generator as they were."""
    towers = {t.name: t for t in model_shape(model).towers}
    weights = list(model.parameters())
    grads = [p.grad for p in weights]
    out: dict[str, int] = {}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for name in towers:
            one, two = (_trial(model, name, rows, precision, device, weights) for rows in (1, 2))
            out[name] = max(0, two - one)
    for p, g in zip(weights, grads, strict=True):
        p.grad = g
    return out


def _trial(model: nn.Module, tower: str, rows: int, precision: str, device: torch.device, weights: list) -> int:
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")

    def run() -> torch.Tensor:
        with autocast:
            if tower == "vision":
                size = int(model.vision_model.config.image_size)
                return model.encode_image(torch.randn(rows, 3, size, size, device=device)).embedding
            ids = torch.randint(0, 2, (rows, int(model.context_length)), device=device)
            return model.encode_text(ids, torch.ones_like(ids)).embedding

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    counted = saved_bytes(run, weights)
    for p in weights:
        p.grad = None
    if device.type == "cuda":
        return max(counted, torch.cuda.max_memory_allocated(device) - base)
    return counted


def materialise(model: nn.Module, device: torch.device) -> nn.Module:
    """A meta-device model's tensors allocated on `device`: weights small random values (activation bytes do not
    depend on them), integer buffers (position ids) counted up again. A model with real tensors is moved only."""
    if not any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        return model.to(device)
    model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
        for b in model.buffers():
            if b.is_floating_point():
                b.normal_(0.0, 0.02)
            elif b.dim():
                b.copy_(torch.arange(b.shape[-1], device=device).expand_as(b))
    return model


# -- a recipe's plan ---------------------------------------------------------------------------------------------
def plan_for(
    cfg: Config,
    arch: str = "",
    world: int = 1,
    local: int | None = None,
    activations: dict[str, int] | None = None,
    source: str = "estimated",
    model: nn.Module | None = None,
) -> Plan:
    """The plan of `cfg` (its model, precision, layout, checkpointing and rows per pass) on `world` ranks, `local`
    of them per node (default: min(world, 8), a node of 8 GPUs). `model`: the model itself (training start); else
    it is built on the meta device (`build_meta_model`)."""
    local = local or min(world, 8)
    model = model if model is not None else build_meta_model(cfg, arch)
    shape = model_shape(model, frozen_reference=uses_frozen_reference(cfg))
    t = cfg.train
    rows = rows_per_pass(cfg, world)
    accumulating = rows is None or rows < t.batch_size // max(1, world)  # several backwards a step
    result = plan(shape, t.precision, t.layout, world, local, activations, source, t.grad_checkpointing, rows,
                  t.keep_gathered, accumulating)  # fmt: skip
    notes = ("the loss's tensors (logits, FILIP's token similarities, gathered features), communication buffers and "
             "the CUDA context are not in these figures",)  # fmt: skip
    # several ranks with train.diagnostics_every: a plain fp32 copy of the model and its gradients (train.trainer)
    copy = (result.total_params + result.trainable_params) * 4 if t.diagnostics_every and world > 1 else 0
    return replace(result, notes=notes, diagnostics_copy=copy)


def rows_per_pass(cfg: Config, world: int) -> int | None:
    """Rows a rank encodes in one forward pass under `cfg` (None when `auto` decides at the first step)."""
    t = cfg.train
    share = t.batch_size // max(1, world)
    size = t.encode_batch_size or t.micro_batch_size if t.accumulation == "per_micro_batch" else t.micro_batch_size
    if size == AUTO:
        return None
    return min(int(size), share) if share else int(size)


def uses_frozen_reference(cfg: Config) -> bool:
    """Whether an objective term reads `text_frozen` (the feature encoder then holds a frozen text tower)."""
    return any("text_frozen" in term.inputs.values() for term in cfg.loss.terms.values())


def build_meta_model(cfg: Config, arch: str = "") -> nn.Module:
    """The model `cfg` describes, its structure only (stretch, RoPE, adapters, freezing), with weights on the meta
    device: a tiny preset is built for real (it is small); else the architecture comes from `arch` (an open_clip
    config name such as ViT-L-14, or a JSON path), a local folder's config.json / open_clip_config.json, or
    `model.open_clip_config`. A model that is not here to read is a ConfigError saying to pass --arch."""
    m = cfg.model
    if m.name.startswith("tiny-") and not arch:
        return factory.create_model(m)
    path = Path(m.name).expanduser()
    with torch.device("meta"):
        backbone = _meta_backbone(path, arch or m.open_clip_config)
    model = wrap(backbone)
    factory.apply_structure(model, m)
    factory.apply_training_setup(model, m, init_scale=False)
    return model


def _meta_backbone(path: Path, arch: str) -> nn.Module:
    if arch:
        return CLIPModel(clip_config(open_clip.read_config_file(open_clip.find_config(arch))[0]))
    if open_clip.is_open_clip_folder(path):
        return CLIPModel(clip_config(open_clip.read_config(path)[0]))
    if (path / "config.json").is_file():
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        backbone = factory.MODEL_CLASSES[config.model_type](config)
        factory._restore(backbone)
        return backbone
    shipped = ", ".join(open_clip.bundled_configs())
    raise ConfigError(
        f"model.name={str(path)!r}: no config here to read the architecture from (a weights file or a folder that is "
        f"not on this machine); pass --arch NAME, an open_clip architecture ({shipped}) or a model config JSON"
    )


def clip_config(model_cfg: dict[str, Any]) -> Any:
    """The transformers CLIPConfig of an open_clip model config (shapes only: what the plan needs)."""
    vision, text = model_cfg["vision_cfg"], model_cfg["text_cfg"]
    vwidth, twidth = int(vision["width"]), int(text.get("width", 512))
    act = "quick_gelu" if model_cfg.get("quick_gelu", False) else "gelu"  # as models.open_clip converts it
    return CLIPConfig(
        text_config=dict(
            vocab_size=int(text.get("vocab_size", 49408)), hidden_size=twidth,
            intermediate_size=round(twidth * float(text.get("mlp_ratio", 4.0))),
            num_hidden_layers=int(text.get("layers", 12)), num_attention_heads=int(text.get("heads", 8)),
            max_position_embeddings=int(text.get("context_length", 77)), hidden_act=act,
        ),
        vision_config=dict(
            hidden_size=vwidth, intermediate_size=round(vwidth * float(vision.get("mlp_ratio", 4.0))),
            num_hidden_layers=int(vision["layers"]), num_attention_heads=vwidth // int(vision.get("head_width", 64)),
            image_size=int(vision.get("image_size", 224)), patch_size=int(vision["patch_size"]), hidden_act=act,
        ),
        projection_dim=int(model_cfg.get("embed_dim", 512)),
    )  # fmt: skip


def print_plan(
    cfg: Config,
    arch: str = "",
    world: int = 1,
    per_node: int = 0,
    gpu_memory: str | None = None,
    measure: bool = False,
) -> Plan:
    """`sharpclip config RECIPE --memory`: the plan of `cfg` on `world` ranks printed (activations measured on
    train.device with `measure`); returns it."""
    if world < 1 or per_node < 0:
        raise ConfigError(f"--world-size {world} / --gpus-per-node {per_node}: give positive numbers of ranks")
    gpu = parse_size(gpu_memory) if gpu_memory else None
    model = build_meta_model(cfg, arch)
    activations, source = None, "estimated"
    if measure:
        device = devices.resolve_device(cfg.train.device, "train.device")
        model = materialise(model, device)
        activations, source = measure_activations(model, cfg.train.precision, device), f"measured on {device.type}"
    result = plan_for(cfg, arch, world, per_node or min(world, 8), activations, source, model)
    print("\n".join(result.lines(gpu)))
    return result


def log_plan(cfg: Config, model: nn.Module, device: torch.device, world: int, local: int | None = None) -> Plan:
    """At the start of training: the plan of the model as built (activations estimated) on `world` ranks, `local`
    per node (the run's parallel context), with the largest micro-batch for the training GPU's memory; logged to
    train.log."""
    result = plan_for(cfg, world=world, local=local, model=model)
    gpu = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    for line in result.lines(gpu):
        log.info("%s", line)
    return result
