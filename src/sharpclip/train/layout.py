"""How a run lays its parameters over ranks: the one description the device mesh, the engine and the memory plan
read (torchtitan's `ParallelDims` is the same idea).

    Layout("hybrid", world=16, local=8).shard_ranks   8: the ranks one tensor is split over
    Layout("hybrid", world=16, local=8).mesh_shape()  ((2, 8), ("replicate", "shard")): the engine's device mesh

`replicate` splits nothing (a (W, 1) mesh: every rank holds every parameter, DDP's semantics); `hybrid` splits over
the `local` ranks of a node and replicates across nodes (HSDP); `shard` splits over all W ranks (a 1-D mesh).
"""

from __future__ import annotations

from dataclasses import dataclass

from sharpclip.config import ConfigError

LAYOUTS = ("replicate", "hybrid", "shard")


@dataclass(frozen=True)
class Layout:
    name: str = "replicate"
    world: int = 1
    local: int = 1  # ranks on a node (torchrun's LOCAL_WORLD_SIZE): hybrid's shard group

    def __post_init__(self) -> None:
        if self.name not in LAYOUTS:
            raise ConfigError(f"train.layout: {self.name!r} is not one of {', '.join(LAYOUTS)}")

    @property
    def shard_ranks(self) -> int:
        """The ranks each tensor is divided over: 1 (replicate), a node's ranks (hybrid), every rank (shard)."""
        return {"replicate": 1, "hybrid": max(1, min(self.local, self.world)), "shard": max(1, self.world)}[self.name]

    def mesh_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The device mesh: replicate (W, 1), hybrid (W / local, local), shard (W,)."""
        if self.name == "shard":
            return (self.world,), ("shard",)
        if self.name == "hybrid":
            if self.world % self.local:
                raise ConfigError(f"train.layout: hybrid shards within a node, but the {self.world} processes are not "
                                  f"a whole number of nodes of {self.local}; use train.layout=shard or "
                                  "replicate")  # fmt: skip
            return (self.world // self.local, self.local), ("replicate", "shard")
        return (self.world, 1), ("replicate", "shard")
