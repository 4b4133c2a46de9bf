"""The multi-process engine: PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`) keeps parameters and gradients
in step over ranks; nothing of sharpclip's own reduces a gradient.

    engine = Engine(model, mesh, precision)     fully_shard on every transformer block, each tower, then the root
    with engine.accumulating(): backward()      every backward of a step but its last: under replicate (or
                                                keep_gathered) no reduction, parameters kept gathered
                                                (set_requires_gradient_sync / set_reshard_after_backward); sharded
                                                layouts reduce every backward (below)
    backward()                                  the last: each block's reduce-scatter starts as soon as its gradients
                                                are in, while the backward still runs through earlier blocks
    engine.finish_step()                        the model-level scalars' gradients (below) averaged by hand

Layouts (`train.layout`, the mesh built in train.parallel): `replicate` is a 2-D mesh (W, 1), every rank holding
every parameter and averaging gradients with an all-reduce (DDP's semantics); `hybrid` is HSDP, (nodes, GPUs per
node): parameters, gradients and optimiser state sharded within a node, replicated across nodes; `shard` is a 1-D
mesh over all W ranks. The reduction averages over every rank in each layout, so each rank backpropagates W times its
share of an exact step's loss (train.step) and the parameters end with ∂L/∂θ of the global batch.

Under `hybrid` and `shard` each transformer block is gathered for each pass and freed after it
(`reshard_after_forward=True`), and every backward reduce-scatters its gradients into the sharded fp32 gradient
(FSDP2's and torchtitan's defaults): a rank holds its shards, the gathered towers' own parameters (embeddings, final
norms, which the model also calls after a tower's forward) and the blocks in flight. `train.keep_gathered` keeps
every block gathered for the whole step instead (each all-gathered once per step, not once per pass or replay) and
reduces only after the step's last backward; the price is the whole model gathered during a step plus, under
accumulation, an unsharded fp32 gradient of every block (FSDP2 upcasts a no-sync gradient to `reduce_dtype`).
`replicate` splits nothing: its parameters stay whole and a step's backwards but the last skip the all-reduce.

The logit scale and SigLIP's bias are 0-dim parameters, which `fully_shard` refuses ("Change scale to a 1D tensor").
They are `ignored_params`: plain tensors on every rank, updated alike, their gradients all-reduced by hand in one
flat all-reduce at the end of the step. The exact step's loss backward, which reaches only them and the cached
features, then needs no engine at all; turning them into 1-element parameters instead would change their shape in
every checkpoint and export.

The towers are called by method (`encode_image`, `encode_text`), not through `forward`: both are registered with
`register_fsdp_forward_method`, so each call runs the root's hooks as a forward would. Frozen copies (HN-CLIP's
reference text tower, a distillation teacher) are not wrapped: they hold no gradient and every rank keeps them whole.

`train.precision=bf16` is FSDP's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): the sharded fp32
parameters stay the master weights the optimiser updates (its state fp32 too), blocks compute on bf16 copies
gathered as bf16, gradients are reduced in fp32. One process takes the same casting rules without FSDP2
(`OneProcessCasts`), so bf16 is one model at every world size. fp32 is exact (the CPU tests compare with one process).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

FORWARD_METHODS = ("encode_image", "encode_text")  # what the feature encoder and the validation call on the model
MODEL_SCALARS = ("logit_scale", "logit_bias")  # 0-dim parameters that fully_shard refuses: reduced by hand
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered, on rank 0's CPU (the others: empty)


def transformer_blocks(tower: nn.Module) -> list[nn.Module]:
    """A transformers tower's layers (`tower.encoder.layers`), the unit of sharding and of compilation."""
    layers = getattr(getattr(tower, "encoder", None), "layers", None)
    return list(layers) if isinstance(layers, nn.ModuleList) else []


def towers(model: nn.Module) -> list[nn.Module]:
    """The model's vision and text towers (those it has)."""
    found = []
    for name in ("vision_model", "text_model"):
        try:
            tower = getattr(model, name, None)
        except (AttributeError, NotImplementedError):
            tower = None
        if isinstance(tower, nn.Module):
            found.append(tower)
    return found


def model_scalars(model: nn.Module) -> list[nn.Parameter]:
    """The model's logit scale and bias, when they are parameters."""
    found = [getattr(model, name, None) for name in MODEL_SCALARS]
    return [p for p in found if isinstance(p, nn.Parameter)]


def local(tensor: Tensor) -> Tensor:
    """This rank's part of a sharded (DTensor) parameter or gradient; a plain tensor itself. Read directly, not
    through `to_local()` (an autograd function a tensor, the largest per-tensor host cost of clipping and max |w|
    over ~400 tensors a step): callers use it outside autograd, on the optimiser's tensors."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def max_abs(params: list[torch.Tensor], fused: bool | None = None, device: torch.device | None = None) -> torch.Tensor:
    """max |w| over `params` as a 0-dim tensor (inf or nan when any weight is), without a host read.

    On a GPU one fused multi-tensor inf-norm (`torch._foreach_norm`: a handful of kernel launches, however many
    parameter tensors; per-tensor reductions would launch ~2 per tensor, ~1,200 for ViT-L/14); on the CPU, where
    nothing is launched, aminmax per tensor, the fastest exact reduction measured there (benchmarks/finite_check.py).
    fused: force either form (None: by device).
    """
    params = [p.detach() for p in params if p.numel()]
    if not params:
        return torch.zeros((), device=device)  # on the device the shard group reduces on
    if not (params[0].device.type != "cpu" if fused is None else fused):
        return torch.stack([torch.stack(torch.aminmax(p)) for p in params]).abs().max()
    return torch.stack(torch._foreach_norm(params, float("inf"))).max()


def units(model: nn.Module) -> list[nn.Module]:
    """The engine's units, innermost first: every transformer block of each tower, then the tower, then the root."""
    found: list[nn.Module] = []
    for tower in towers(model):
        found += [*transformer_blocks(tower), tower]
    return [*found, model]


def _cast(value: object, dtype: torch.dtype) -> object:
    if isinstance(value, Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    return value


class OneProcessCasts:
    """FSDP2's `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` on one process, without FSDP2: the same
    units as the engine (`units`), each casting its floating inputs to bf16 and computing on bf16 copies of the
    parameters it owns (those of no inner unit; the model scalars excepted, as `ignored_params` are), the fp32
    parameters staying the registered ones the optimiser updates; the copies' gradients reach them in fp32 through
    the cast. So a bf16 run computes the same model on one process as on W ranks (the engine's numerics, not
    autocast over fp32 weights alone); one process pays no FSDP2 hook or DTensor cost for it."""

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.bfloat16):
        self.dtype = dtype
        claimed = {id(p) for p in model_scalars(model)}
        self.owned: dict[int, list[tuple[nn.Module, str, nn.Parameter]]] = {}
        for unit in units(model):
            mine = []
            for module in unit.modules():
                for name, p in module._parameters.items():
                    if p is not None and id(p) not in claimed:
                        claimed.add(id(p))
                        mine.append((module, name, p))
            self.owned[id(unit)] = mine
            if unit is model:
                for method in FORWARD_METHODS:
                    if callable(getattr(model, method, None)):
                        setattr(model, method, self._wrapped(model, getattr(model, method)))
            unit.register_forward_pre_hook(self._pre, with_kwargs=True)
            unit.register_forward_hook(self._post)

    def _wrapped(self, model: nn.Module, method):
        def run(*args, **kwargs):
            args, kwargs = self._pre(model, args, kwargs)
            try:
                return method(*args, **kwargs)
            finally:
                self._post(model, (), None)

        return run

    def _pre(self, unit: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._install(unit)
        return _cast(args, self.dtype), _cast(kwargs, self.dtype)  # type: ignore[return-value]

    def _post(self, unit: nn.Module, args: tuple, output: object) -> None:
        """Drop the copies (the graph keeps what the backward needs); a unit whose backward recomputes its forward
        (activation checkpointing) gets them again when its backward starts, until the backward ends, as FSDP2
        gathers a resharded unit again before its backward."""
        self._drop(unit)
        needs = [t for t in tree_leaves(output) if isinstance(t, Tensor) and t.requires_grad]
        if needs and torch.is_grad_enabled():
            register_multi_grad_hook(needs, functools.partial(self._before_backward, unit), mode="any")

    def _before_backward(self, unit: nn.Module, grad: Tensor) -> None:
        with torch.enable_grad():  # as in the forward: a recomputation saves what the forward saved
            self._install(unit)
        Variable._execution_engine.queue_callback(functools.partial(self._drop, unit))  # at the backward's end

    def _install(self, unit: nn.Module) -> None:
        for module, name, p in self.owned[id(unit)]:
            module.__dict__[name] = p.to(self.dtype)  # found before the registered parameter by attribute lookup

    def _drop(self, unit: nn.Module) -> None:
        for module, name, _ in self.owned[id(unit)]:
            module.__dict__.pop(name, None)


class Engine:
    """FSDP2 over `model` on `mesh` (see the module docstring); `shard_group`: the ranks one parameter is split over
    (None when it is not split: replicate), across which norms and maxima of local shards are summed or maxed."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, precision: str = "fp32", keep_gathered: bool = False):
        self.model, self.mesh = model, mesh
        shards = mesh.size(mesh.mesh_dim_names.index("shard")) if "shard" in (mesh.mesh_dim_names or ()) else 1
        self.shard_group = mesh.get_group("shard") if shards > 1 else None
        # a split parameter is gathered for each pass and freed after it, its gradient reduced after every backward
        # (FSDP2's and torchtitan's default); kept whole for the step on request, or when nothing is split
        self.keep_gathered = keep_gathered or shards == 1
        self._gathered_step = False  # this step keeps its blocks gathered (`step`)
        bf16 = precision == "bf16"
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        options = {"mesh": mesh, **({"mp_policy": policy} if policy else {})}
        self.modules = units(model)
        self.blocks = [b for tower in towers(model) for b in transformer_blocks(tower)]
        scalars = model_scalars(model)
        for unit in self.modules:
            # towers and the root stay gathered from their forward to their backward: the model calls a tower's
            # final norm or head after the tower's forward (train.engine module docstring)
            resharded = not self.keep_gathered and any(unit is b for b in self.blocks)
            fully_shard(unit, reshard_after_forward=resharded, **options,
                        **({"ignored_params": set(scalars)} if unit is model else {}))  # fmt: skip
        for name in FORWARD_METHODS:
            if callable(getattr(model, name, None)):
                register_fsdp_forward_method(model, name)
        self.scalars = [p for p in scalars if p.requires_grad]
        self.world = mesh.size()  # every rank of the mesh: the ranks a gradient is averaged over
        cuda = mesh.device_type == "cuda"  # the current device, as the mesh's process groups use it
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device(mesh.device_type)

    @property
    def root(self) -> FSDPModule:
        return self.model  # type: ignore[return-value]

    @contextlib.contextmanager
    def step(self, equal_passes: bool) -> Iterator[None]:
        """One step. A block resharded after each pass is gathered again by the next, a collective every rank must
        join: when the ranks make different numbers of passes (a rank holding a short batch), the blocks stay
        gathered for this step and only its last backward reduces (as under `keep_gathered`), so every rank issues
        the same collectives whatever its passes."""
        if self.keep_gathered or equal_passes:
            yield
            return
        self._gathered_step = True
        for block in self.blocks:
            block.set_reshard_after_forward(False, recurse=False)  # type: ignore[operator]
        try:
            yield
        finally:
            self._gathered_step = False
            for block in self.blocks:
                block.set_reshard_after_forward(True, recurse=False)  # type: ignore[operator]

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally and keep the parameters gathered, when the engine
        keeps them gathered for the step (`keep_gathered`, or a step of unequal passes); otherwise every backward
        reduces its gradients."""
        if not (self.keep_gathered or self._gathered_step):
            yield
            return
        self.root.set_requires_gradient_sync(False)
        self.root.set_reshard_after_backward(False)
        try:
            yield
        finally:
            self.root.set_requires_gradient_sync(True)
            self.root.set_reshard_after_backward(True)

    def finish_step(self) -> None:
        """Average the model scalars' gradients over every rank (one flat all-reduce; a gradient no loss reached
        counts as zero, so every rank takes part)."""
        if not self.scalars:
            return
        for p in self.scalars:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.stack([p.grad.reshape(()) for p in self.scalars])
        dist.all_reduce(flat)
        flat /= self.world
        for p, value in zip(self.scalars, flat.unbind(), strict=True):
            p.grad.copy_(value)

    def discard_unsynced(self) -> None:
        """Drop every gradient accumulated under `accumulating` without a last backward (a trial step) and reshard,
        leaving nothing for the next step's reduction: the registered `.grad`s and the gradient FSDP2 parks in
        `FSDPParam.unsharded_accumulated_grad` when `reduce_dtype` differs from the compute dtype (bf16), which its
        next reducing backward would otherwise add to that step's gradient."""
        self.model.zero_grad(set_to_none=True)  # the gathered parameters are the registered ones until resharded
        for module in self.modules:
            module.reshard()  # type: ignore[attr-defined]
            for group in module._get_fsdp_state()._fsdp_param_groups:  # type: ignore[attr-defined]
                for param in group.fsdp_params:
                    param.unsharded_accumulated_grad = None
        self.model.zero_grad(set_to_none=True)

    def grad_norm(self, params: list[Tensor]) -> Tensor:
        """The global L2 norm of the gradients of `params` (sharded or not): squares of local shards summed in one
        all-reduce over the shard group (none under replicate), plus the replicated scalars' once."""
        sharded = [local(p.grad) for p in params if p.grad is not None and isinstance(p.grad, DTensor)]
        plain = [p.grad for p in params if p.grad is not None and not isinstance(p.grad, DTensor)]
        squares = _sum_of_squares(sharded, self.device)
        if self.shard_group is not None:
            dist.all_reduce(squares, group=self.shard_group)
        return (squares + _sum_of_squares(plain, self.device).to(squares)).sqrt()

    def clip_grad_norm(self, params: list[Tensor], max_norm: float) -> Tensor:
        """`torch.nn.utils.clip_grad_norm_` over sharded gradients: the global norm, every local gradient scaled by
        min(1, max_norm / (norm + 1e-6)); returns the norm (a device tensor, not read)."""
        norm = self.grad_norm(params)
        grads = [local(p.grad) for p in params if p.grad is not None]
        if grads and max_norm != float("inf"):
            torch._foreach_mul_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0))
        return norm

    def weights_max_abs(self, params: list[Tensor]) -> Tensor:
        """max |w| over `params` on every rank's shards (a device tensor, not read)."""
        return self.max_over_shards(max_abs([local(p) for p in params], device=self.device))

    def max_over_shards(self, values: Tensor) -> Tensor:
        """The maximum over the shard group of this rank's max |w| (`values`, 0-dim); NaN travels as NaN."""
        if self.shard_group is None:
            return values
        out = values.detach().clone().reshape(1)
        nan = torch.isnan(out).to(out.dtype)  # MAX may drop a NaN on some backends: carry it separately
        both = torch.cat([out.nan_to_num(nan=0.0, posinf=float("inf")), nan])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.shard_group)
        return torch.where(both[1] > 0, torch.full_like(both[0], float("nan")), both[0])

    # -- whole state for the one-file checkpoint -------------------------------------------------------------
    def full_model_state(self, everywhere: bool = False) -> dict[str, Tensor]:
        """Every parameter and buffer gathered, on rank 0's CPU ({} on the others; `everywhere`: on every rank, on
        the device); every rank must call it."""
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True) if everywhere else FULL)

    def load_full_model_state(self, state: dict[str, Tensor]) -> None:
        """Load a whole state dict (every rank holds it) into the sharded model."""
        set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True))

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        return get_optimizer_state_dict(self.model, optimizer, options=FULL)

    def load_full_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        set_optimizer_state_dict(self.model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def _sum_of_squares(grads: list[Tensor], device: torch.device) -> Tensor:
    """Σ‖g‖² over `grads`; with none, a zero on `device` (the mesh's: NCCL reduces only CUDA tensors)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack([n.float() for n in torch._foreach_norm(grads)]).square().sum()


def optimizer_state_fqn(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimiser's state keyed by parameter name, on the CPU (the form a checkpoint keeps, whatever the layout or
    world size that resumes it); one process."""
    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_named_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a state keyed by parameter name (`by_name`) into `optimizer` over `model`; one process."""
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def by_name(state: dict) -> dict:
    """An optimiser state dict keyed by parameter name: an older checkpoint's (keyed by index, each group listing
    its parameters' `names`) converted; a named one as it is. Group options of the device that saved it (foreach,
    fused) are dropped, so the resuming device's choice stands."""
    groups = state["param_groups"]
    if groups and groups[0]["params"] and isinstance(groups[0]["params"][0], int):
        names = {i: n for g in groups for i, n in zip(g["params"], g["names"], strict=True)}
        state = {"state": {names[i]: v for i, v in state["state"].items()},
                 "param_groups": [{**g, "params": list(g["names"])} for g in groups]}  # fmt: skip
    drop = ("foreach", "fused")
    return {**state, "param_groups": [{k: v for k, v in g.items() if k not in drop} for g in state["param_groups"]]}
