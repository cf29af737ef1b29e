"""The DCP payload of a training checkpoint: model and optimizer state dicts as `CheckpointManager` saves and
loads them (`veomni.train.checkpoint`).

Expert parallelism: after `apply_expert_plan` and FSDP2, an expert tensor is a DTensor of *local* experts, the
same FQN and global shape on every EP rank, which DCP would take for replicas and save once. Before saving and
loading, such tensors are re-wrapped (no copy) as DTensors of the full ``[E, ...]`` tensor over the EP and
EP-FSDP mesh dims, so DCP sees which experts each rank holds and can reshard them to another EP size
(`checkpoint_view`).

Optimizer state: AdamW holds none for a parameter no gradient has reached yet. `state_dicts` saves an optimizer
as it is (torch would invent zero-gradient state for every parameter of one that never stepped) and
`load_optimizer` leaves parameters without saved state without state.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from veomni.core.ep import expert_shards
from veomni.core.parallel_state import ParallelState


def _expert_mesh(state: ParallelState) -> DeviceMesh:
    # The EP mesh is [ep_replicate, ep_fsdp, ep]; the global expert order is ep-major (apply_expert_plan slices
    # by EP rank first, FSDP then shards each slice), so the view mesh orders the dims [ep_replicate, ep, ep_fsdp].
    # No process groups: DCP only needs the coordinates to compute each rank's chunk offsets.
    ep_mesh = state.ep_mesh
    ranks = ep_mesh.mesh.permute(0, 2, 1).contiguous()
    return DeviceMesh(
        ep_mesh.device_type, ranks, mesh_dim_names=("ep_replicate", "ep", "ep_fsdp"), _init_backend=False
    )


def _global_expert_view(tensor: torch.Tensor, mesh: DeviceMesh, num_experts: int) -> DTensor:
    if isinstance(tensor, DTensor):
        (placement,) = tensor.placements[-1:]  # the ep_fsdp placement (HSDP adds Replicate before it)
        local = tensor.to_local()
        local_shape = tensor.shape
    else:
        placement, local, local_shape = Replicate(), tensor, tensor.shape
    global_shape = (num_experts, *local_shape[1:])
    placements = (Replicate(), Shard(0), placement)
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=global_shape, stride=_contiguous_stride(global_shape)
    )


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


def checkpoint_view(
    model: nn.Module, state: ParallelState | None, model_sd: dict, optim_sd: dict
) -> dict[str, Any]:
    """The DCP payload: ``model_sd``/``optim_sd`` with expert tensors replaced by their global views.

    Only new containers are modified (the optimizer's own state dicts are left alone); every tensor, view or
    not, shares storage with the live one, so DCP loads in place.
    """
    shards = {fqn: s for fqn, s in expert_shards(model).items() if s.ep_size > 1}
    if not shards:
        return {"model": model_sd, "optim": optim_sd}
    if state is None or state.ep_mesh is None:
        raise ValueError("the model has expert-parallel shards: pass the ParallelState used to build it")
    mesh = _expert_mesh(state)
    model_view = dict(model_sd)
    optim_state = dict(optim_sd.get("state", {}))
    for fqn, shard in shards.items():
        if fqn in model_view:
            model_view[fqn] = _global_expert_view(model_view[fqn], mesh, shard.num_experts)
        if fqn in optim_state:
            optim_state[fqn] = {
                key: _global_expert_view(v, mesh, shard.num_experts)
                if isinstance(v, torch.Tensor) and v.dim() > 0
                else v
                for key, v in optim_state[fqn].items()
            }
    return {"model": model_view, "optim": {**optim_sd, "state": optim_state}}


def state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """``get_state_dict`` without the state torch invents: for an optimizer that has stepped no parameter yet it
    runs a zero-gradient step (AdamW state, ``step`` 1, for every parameter); that would change the live run and be
    saved as if every parameter had been trained once. Such an optimizer is saved with no state, as it has."""
    fresh = not optimizer.state
    model_sd, optim_sd = get_state_dict(model, optimizer)
    if fresh:
        optimizer.state.clear()
        optim_sd = {**optim_sd, "state": {}}
    return model_sd, optim_sd


def load_optimizer(
    model: nn.Module, optimizer: torch.optim.Optimizer, optim_sd: dict[str, Any], names: list[list[str]]
) -> None:
    """Put the loaded ``optim_sd`` (its param groups as saved) into ``optimizer``, whose groups hold the parameters
    ``names``; a parameter without state in ``optim_sd`` ends without state (not strict: the match was checked)."""
    if optim_sd["state"]:
        set_optimizer_state_dict(model, optimizer, optim_sd, options=StateDictOptions(strict=False))
        return
    # torch reads an empty state as one keyed by parameter ids and would take the saved groups by position; match
    # them by parameter name as it does otherwise: each group takes the settings of the saved group of its first
    # parameter.
    optimizer.state.clear()
    for group, group_names in zip(optimizer.param_groups, names, strict=True):
        saved = next(
            (g for g in optim_sd["param_groups"] if group_names and group_names[0] in g["params"]), None
        )
        if saved is None:
            raise ValueError(
                f"no saved optimizer param group holds {group_names[:1]} (checked before loading)"
            )
        group.update({key: value for key, value in saved.items() if key != "params"})
