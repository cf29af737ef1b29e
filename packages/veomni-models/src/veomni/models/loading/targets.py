"""What a (sharded) model holds: per state-dict key, its full checkpoint shape and this rank's region of it.

A parameter may be EP-sliced (experts ``[start, stop)`` of dim 0, recorded by `veomni.core.ep`) and then
FSDP-sharded (a DTensor over ``Shard``/``Replicate`` placements). Its region is where this rank's local
tensor sits in the full, pre-EP tensor that a checkpoint stores.
"""

from __future__ import annotations

import attrs
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from veomni.core.ep.plan import ExpertShard, expert_shards
from veomni.core.parallel_state import ParallelState
from veomni.models.loading.lazy import Region


@attrs.frozen(eq=False)
class Target:
    """One state-dict entry of the model on this rank.

    Attributes:
        key: the state-dict key (FQN).
        tensor: the parameter or buffer (a DTensor under FSDP).
        local: where this rank's values live (``tensor.to_local()`` for a DTensor).
        full_shape: the shape a full checkpoint stores (``[E, ...]`` for EP-sliced experts).
        region: this rank's block of the full tensor (``local`` has its shape).
        expert: the EP record, or None.
    """

    key: str
    tensor: torch.Tensor
    local: torch.Tensor
    full_shape: tuple[int, ...]
    region: Region
    expert: ExpertShard | None


def unwrapped_class(model: nn.Module) -> type:
    """The model's class without FSDP2's dynamic ``FSDP<Class>`` wrapper."""
    for cls in type(model).__mro__:
        if not issubclass(cls, FSDPModule):
            return cls
    raise TypeError(f"{type(model).__name__} has no non-FSDP class in its MRO")


def dtensor_region(key: str, tensor: DTensor) -> Region:
    """Where ``tensor.to_local()`` sits in the DTensor's global tensor (``key`` names it in errors)."""
    for p in tensor.placements:
        if not isinstance(p, (Shard, Replicate)):
            raise ValueError(f"{key}: placement {p} is not supported for loading (only Shard and Replicate)")
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if tuple(shape) != tuple(tensor.to_local().shape):
        raise ValueError(
            f"{key}: the local shard is shaped {list(tensor.to_local().shape)}, but its placements "
            f"{tensor.placements} imply {list(shape)}"
        )
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def model_targets(model: nn.Module) -> dict[str, Target]:
    """`Target` for every parameter and persistent buffer of ``model``, in state-dict order.

    Tied parameters appear once per key, sharing one tensor (see `tie_groups`).
    """
    shards = expert_shards(model)
    targets: dict[str, Target] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        if isinstance(tensor, DTensor):
            region = dtensor_region(key, tensor)
            local = tensor.to_local()
        else:
            region = tuple(slice(0, n) for n in tensor.shape)
            local = tensor
        full = tuple(int(n) for n in tensor.shape)
        shard = shards.get(key)
        if shard is not None:
            # The EP slice is the whole (pre-FSDP) tensor of this rank: shift dim 0 to its experts.
            d = shard.dim
            full = full[:d] + (shard.num_experts,) + full[d + 1 :]
            region = (
                region[:d]
                + (slice(region[d].start + shard.start, region[d].stop + shard.start),)
                + region[d + 1 :]
            )
        targets[key] = Target(key, tensor, local, full, region, shard)
    return targets


def tie_groups(model: nn.Module, targets: dict[str, Target]) -> list[list[str]]:
    """Keys that share one tensor, each group ordered with transformers' tie source first.

    Groups of one key are included, so every key is in exactly one group; the order follows the state dict.
    """
    by_id: dict[int, list[str]] = {}
    for key, t in targets.items():
        by_id.setdefault(id(t.tensor), []).append(key)
    mapping = {}
    getter = getattr(model, "get_expanded_tied_weights_keys", None)
    if callable(getter):
        mapping = getter(all_submodels=True)  # {target: source}
    sources = set(mapping.values())
    groups = []
    for keys in by_id.values():
        keys.sort(key=lambda k: (k not in sources, k in mapping))
        groups.append(keys)
    return groups


def gather_target(target: Target, state: ParallelState | None) -> torch.Tensor:
    """``target``'s whole, checkpoint-shaped tensor (FSDP shards and EP slices gathered; collective when sharded:
    every rank calls it and gets the tensor)."""
    t = target.tensor
    if isinstance(t, DTensor):
        mesh, local = t.device_mesh, t.to_local()
        if local.device.type != mesh.device_type:  # a CPU-offloaded shard: gather on the mesh's device
            t = DTensor.from_local(
                local.to(mesh.device_type), mesh, t.placements, shape=t.shape, stride=t.stride()
            )
        full = t.full_tensor()
    else:
        full = t.detach()
    shard = target.expert
    if shard is None or shard.ep_size == 1:
        return full
    if state is None or not state.ep_enabled or state.dims.ep != shard.ep_size:
        raise ValueError(
            f"export: {target.key} holds experts [{shard.start}, {shard.stop}) of {shard.num_experts} (ep="
            f"{shard.ep_size}); pass the parallel_state the model was sharded with"
        )
    gathered = torch.empty((shard.num_experts, *full.shape[1:]), dtype=full.dtype, device=full.device)
    dist.all_gather_into_tensor(gathered, full.contiguous(), group=state.ep_group)
    return gathered
