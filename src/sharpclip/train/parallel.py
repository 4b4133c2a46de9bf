"""One explicit parallel context: who this process is among how many, the device mesh and the engine, the step's
agreement, the gather and the accumulation switches. Built once (`from_process_group` after torchrun's group is
joined, `one_process` otherwise) and passed to the trainer and the step; nothing below reads the world size from
module state. One process is the same object with one rank: every collective is then skipped.

    ctx.agree(batch)        before each step, one all-reduce of a few numbers per rank and one host read: does every
                            rank hold a batch, its rows, edit pairs and caption width (`Agreement`)
    ctx.gather(features)    every rank's features with gradient (sharpclip.collectives.gather), their shapes derived
                            from the agreement: no shape exchange inside the step
    ctx.accumulating()      around every backward of a step but its last (train.engine.Engine.accumulating)
    ctx.finish_step()       after the step's last backward (the model scalars' gradients)

What is gathered (train.step): under exact accumulation every rank gathers every rank's features (with gradient)
and computes the loss rows of its own samples against all of them (local loss); under per_micro_batch nothing is
gathered. Every rank must enter every collective: when one rank holds no batch, every rank ends the epoch together.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from sharpclip import collectives
from sharpclip.train import distributed
from sharpclip.train.engine import Engine, OneProcessCasts
from sharpclip.train.features import FEATURES
from sharpclip.train.layout import Layout

T = TypeVar("T")
WIDTHS = tuple(sorted({f.width for f in FEATURES.values() if f.width}))  # batch fields whose width a feature takes


class Agreement:
    """A step's numbers from every rank, agreed in one all-reduce before the step (`agree`): whether it holds a
    batch, its rows, its edit pairs and the width (dim 1) of each batch field in WIDTHS. From them the gather knows
    every rank's shape of every feature (`shapes`), and the per-micro-batch step every rank's micro-batch count."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.batch: object | None = None  # the batch this agreement belongs to
        self.held: list[bool] = []
        self.rows: list[int] = []
        self.edits: list[int] = []
        self.widths: list[dict[str, int]] = []
        self.requests: list[float] = []  # run-control numbers summed over ranks (train.stop: a stop, the clock)

    def agree(self, batch: object | None, device: torch.device, requests: tuple[float, ...] = ()) -> list[bool]:
        """`requests`: numbers summed over ranks in the same all-reduce, left in `self.requests`."""
        w, fields = self.world, len(WIDTHS)
        value = torch.zeros((3 + fields) * w + len(requests), dtype=torch.float64, device=device)
        if batch is not None:
            edits = getattr(batch, "edit_source", None)
            mine = [1.0, len(batch), 0 if edits is None else len(edits)]  # type: ignore[arg-type]
            mine += [_width(batch, name) for name in WIDTHS]
            value[torch.arange(3 + fields) * w + self.rank] = torch.tensor(mine, dtype=torch.float64).to(device)
        if requests:
            value[(3 + fields) * w :] = torch.tensor(requests, dtype=torch.float64).to(device)
        dist.all_reduce(value)
        everything = value.tolist()  # the one host read
        numbers = [int(v) for v in everything[: (3 + fields) * w]]
        self.requests = everything[(3 + fields) * w :]
        per = [numbers[k * w : (k + 1) * w] for k in range(3 + fields)]
        self.batch = batch
        self.held, self.rows, self.edits = [v == 1 for v in per[0]], per[1], per[2]
        self.widths = [{name: per[3 + i][r] for i, name in enumerate(WIDTHS)} for r in range(w)]
        return self.held

    @property
    def equal_rows(self) -> bool:
        return len(set(self.rows)) == 1

    def shapes(self, features: Mapping[str, Tensor]) -> collectives.Shapes | None:
        """Every rank's shape of every feature, [rank][key][dim], from the agreed numbers; None when a feature is
        not in the table (its shapes are then exchanged)."""
        table = [FEATURES.get(key) for key in features]
        if any(f is None or f.kind not in ("row", "edit") for f in table):
            return None
        ndim = max(v.ndim for v in features.values())
        out = []
        for r in range(self.world):
            per_key = []
            for f, value in zip(table, features.values(), strict=True):
                dims = list(value.shape) + [0] * (ndim - value.ndim)
                dims[0] = self.rows[r] if f.kind == "row" else self.edits[r]
                if f.width:
                    dims[1] = self.widths[r][f.width]
                per_key.append(dims)
            out.append(per_key)
        for key, value, dims in zip(features, features.values(), out[self.rank], strict=True):
            if list(value.shape) != dims[: value.ndim]:
                raise ValueError(f"feature {key!r} has shape {tuple(value.shape)} on rank {self.rank}, but the "
                                 f"step's agreement implies {tuple(dims[: value.ndim])}")  # fmt: skip
        return out


def _width(batch: object, name: str) -> int:
    value = getattr(batch, name, None)
    return int(value.shape[1]) if isinstance(value, Tensor) and value.ndim > 1 else 0


@dataclass
class ParallelContext:
    """This process among the run's processes; see the module docstring."""

    rank: int = 0
    world: int = 1
    local_world: int = 1  # processes on this node (torchrun's LOCAL_WORLD_SIZE): the shard group of `hybrid`
    layout: str = "replicate"
    mesh: object | None = None  # torch.distributed.device_mesh.DeviceMesh, once `shard` has built it
    engine: Engine | None = None
    agreement: Agreement = field(init=False)

    def __post_init__(self) -> None:
        self.agreement = Agreement(self.rank, self.world)

    @classmethod
    def one_process(cls, layout: str = "replicate") -> ParallelContext:
        return cls(layout=layout)

    @classmethod
    def from_process_group(cls, layout: str = "replicate") -> ParallelContext:
        """The context of this process in the default process group (one process when there is none)."""
        if not distributed.is_distributed():
            return cls.one_process(layout)
        world = dist.get_world_size()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        return cls(rank=dist.get_rank(), world=world, local_world=local, layout=layout)

    @property
    def several(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # -- the engine --------------------------------------------------------------------------------------------
    @property
    def parallel_layout(self) -> Layout:
        """This run's layout over its ranks (train.layout): the mesh, the engine and the memory plan read it."""
        return Layout(self.layout, self.world, self.local_world)

    def mesh_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The device mesh of `layout` (train.layout.Layout.mesh_shape)."""
        return self.parallel_layout.mesh_shape()

    def shard(
        self, model: nn.Module, device: torch.device, precision: str = "fp32", keep_gathered: bool = False
    ) -> Engine | None:
        """Put `model` under the engine for this layout (None on one process, where bf16 takes the engine's casting
        rules without it: train.engine.OneProcessCasts, so a bf16 run is one model at every world size)."""
        if not self.several:
            if precision == "bf16":
                OneProcessCasts(model)
            return None
        from torch.distributed.device_mesh import init_device_mesh

        shape, names = self.mesh_shape()
        self.mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
        self.engine = Engine(model, self.mesh, precision, keep_gathered)  # type: ignore[arg-type]
        return self.engine

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Around every backward of a step but its last: no gradient reduction, parameters kept gathered."""
        with self.engine.accumulating() if self.engine is not None else contextlib.nullcontext():
            yield

    def finish_step(self) -> None:
        if self.engine is not None:
            self.engine.finish_step()

    # -- the step's agreement and gather ---------------------------------------------------------------------
    def agree(
        self, batch: object | None, device: torch.device | None = None, requests: tuple[float, ...] = ()
    ) -> list[bool]:
        """Every rank's "I hold a batch", in rank order (one all-reduce and one host read; none on one process).
        `requests`: run-control numbers (train.stop) summed over ranks in the same all-reduce, then in
        `self.requests`; on one process they are this rank's own."""
        if not self.several:
            self.agreement.requests = list(requests)
            return [batch is not None]
        return self.agreement.agree(batch, device or _flag_device(), requests)

    @property
    def requests(self) -> list[float]:
        """The run-control numbers of the last agreement, summed over ranks."""
        return self.agreement.requests

    def agreed(self, batch: object) -> Agreement:
        """The agreement of `batch`'s step (made here when the caller did not: every rank runs the step)."""
        if self.agreement.batch is not batch:
            self.agree(batch)
        return self.agreement

    def gather(self, features: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, slice]]:
        """Every rank's `features` (of the agreed batch) in rank order, differentiable, and this rank's slice of
        each; their shapes come from the step's agreement (`agreed` first)."""
        if not self.several:
            return dict(features), {}
        gathered, mine, _ = collectives.gather(features, self.agreement.shapes(features))
        return gathered, mine

    # -- small collectives (skipped on one process) ------------------------------------------------------------
    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        return distributed.all_reduce_sum(tensor) if self.several else tensor

    def all_ranks(self, value: T) -> list[T]:
        return distributed.all_ranks(value) if self.several else [value]

    def to_rank0(self, value: T) -> list[T]:
        return distributed.to_rank0(value) if self.several else [value]

    def from_rank0(self, value: T) -> T:
        return distributed.from_rank0(value) if self.several else value

    def all_ranks_lists(self, values: list) -> list:
        return distributed.all_ranks_lists(values) if self.several else values

    def all_true(self, flag: bool) -> bool:
        return distributed.all_true(flag) if self.several else flag

    def all_flags(self, flag: bool) -> list[bool]:
        return distributed.all_flags(flag) if self.several else [flag]

    def barrier(self) -> None:
        if self.several:
            distributed.barrier()


def _flag_device() -> torch.device:
    """Where a collective on a few host numbers runs: NCCL reduces only CUDA tensors."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
