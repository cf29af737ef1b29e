"""Validated parallel degrees: how the world is split between replication, sharding, Ulysses SP and EP.

`ParallelDims` is pure arithmetic and validation; it touches no process group. `build_parallel_state`
(in `parallel_state.py`) turns it into device meshes.

Layout (row-major, last dim innermost, so each SP group and each EP group is a run of consecutive ranks):

    main mesh  [dp_replicate, dp_shard, sp]
    EP mesh    [ep_replicate, ep_fsdp, ep]     ep_replicate = dp_replicate, ep_fsdp * ep = dp_shard * sp
"""

from __future__ import annotations

from typing import Any

import attrs


def _positive_int(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ParallelDims.{attribute.name} must be a positive int, got {value!r}")


@attrs.frozen(kw_only=True)
class ParallelDims:
    """Degrees of each kind of parallelism.

    Attributes:
        dp_replicate: replicas of the sharded model (HSDP's replicate dimension); gradients are all-reduced
            across it.
        dp_shard: data-parallel ranks that shard parameters (FSDP).
        sp: Ulysses sequence-parallel degree. SP ranks read the same samples and split the sequence; they also
            take part in parameter sharding, so FSDP shards over ``dp_shard * sp``.
        ep: expert-parallel degree. Experts are split ``ep`` ways inside the ``dp_shard * sp`` ranks of one
            replica, so ``ep`` must divide ``dp_shard * sp``.
    """

    dp_replicate: int = attrs.field(default=1, validator=_positive_int)
    dp_shard: int = attrs.field(default=1, validator=_positive_int)
    sp: int = attrs.field(default=1, validator=_positive_int)
    ep: int = attrs.field(default=1, validator=_positive_int)

    def __attrs_post_init__(self) -> None:
        if self.fsdp_shard % self.ep != 0:
            raise ValueError(
                f"ParallelDims: ep={self.ep} must divide dp_shard*sp={self.dp_shard}*{self.sp}={self.fsdp_shard} "
                "(experts are split inside the sharding ranks of one replica)"
            )

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.sp

    @property
    def dp(self) -> int:
        """Ranks that read different data: ``dp_replicate * dp_shard`` (SP peers read the same samples)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_shard(self) -> int:
        """Ranks a parameter is sharded over: ``dp_shard * sp``."""
        return self.dp_shard * self.sp

    @property
    def loss_reduce(self) -> int:
        """Ranks whose gradients are averaged: ``dp_replicate * dp_shard * sp``, the whole world."""
        return self.dp * self.sp

    @property
    def ep_fsdp(self) -> int:
        """Ranks an expert shard is further FSDP-sharded over: ``dp_shard * sp / ep``."""
        return self.fsdp_shard // self.ep

    @property
    def ep_replicate(self) -> int:
        return self.dp_replicate

    def check_world_size(self, world_size: int) -> None:
        """Raise ``ValueError`` unless ``dp_replicate * dp_shard * sp == world_size``."""
        if self.world_size != world_size:
            raise ValueError(
                f"ParallelDims: dp_replicate*dp_shard*sp = {self.dp_replicate}*{self.dp_shard}*{self.sp} = "
                f"{self.world_size}, but the world size is {world_size}"
            )

    @classmethod
    def for_world(cls, world_size: int, *, dp_replicate: int = 1, sp: int = 1, ep: int = 1) -> ParallelDims:
        """Fill ``dp_shard`` with whatever the other degrees leave of ``world_size``."""
        denom = dp_replicate * sp
        if denom < 1 or world_size % denom != 0:
            raise ValueError(
                f"ParallelDims.for_world: dp_replicate*sp = {dp_replicate}*{sp} must divide the world size "
                f"{world_size}"
            )
        return cls(dp_replicate=dp_replicate, dp_shard=world_size // denom, sp=sp, ep=ep)
