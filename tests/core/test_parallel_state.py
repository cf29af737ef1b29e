"""ParallelDims validation and the meshes build_parallel_state creates, on real gloo groups."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_harness import backend_params

from veomni.core.host_sync import HostSyncCounter
from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import (
    build_parallel_state,
    current_parallel_state,
    use_parallel_state,
)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sp": 0}, "sp must be a positive int"),
        ({"dp_shard": -2}, "dp_shard must be a positive int"),
        ({"ep": True}, "ep must be a positive int"),
        ({"dp_shard": 3, "sp": 1, "ep": 2}, "ep=2 must divide dp_shard\\*sp=3\\*1=3"),
        ({"dp_shard": 1, "sp": 2, "ep": 4}, "ep=4 must divide"),
    ],
)
def test_invalid_dims_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs)


def test_derived_sizes():
    dims = ParallelDims(dp_replicate=2, dp_shard=2, sp=2, ep=4)
    assert (dims.world_size, dims.dp, dims.fsdp_shard, dims.loss_reduce, dims.ep_fsdp) == (8, 4, 4, 8, 1)
    with pytest.raises(ValueError, match="= 8, but the world size is 4"):
        dims.check_world_size(4)
    assert ParallelDims.for_world(8, sp=2) == ParallelDims(dp_shard=4, sp=2)
    with pytest.raises(ValueError, match="must divide the world size 6"):
        ParallelDims.for_world(6, sp=4)


def test_current_state_is_never_defaulted():
    with pytest.raises(RuntimeError, match="no current ParallelState"):
        current_parallel_state()
    with pytest.raises(TypeError, match="expects a ParallelState"), use_parallel_state("base"):  # type: ignore[arg-type]
        pass


def test_build_without_process_group_raises():
    if dist.is_initialized():
        pytest.skip("a default group exists in this process")
    with pytest.raises(RuntimeError, match="needs an initialised default process group"):
        build_parallel_state(ParallelDims(), "cpu")


def _mesh_layout(ctx, dims_kwargs):
    dims = ParallelDims(**dims_kwargs)
    state = build_parallel_state(dims, ctx.device_type)
    again = build_parallel_state(ParallelDims(**dims_kwargs), ctx.device_type)
    ranks = lambda group: sorted(dist.get_process_group_ranks(group))  # noqa: E731
    out = {
        "cached": again is state,
        "sp": ranks(state.sp_group),
        "dp": ranks(state.dp_group),
        "fsdp_shard": ranks(state.fsdp_shard_group),
        "loss": ranks(state.loss_group),
        "fsdp_mesh_shape": tuple(state.fsdp_mesh.shape),
        "sp_rank": state.sp_rank,
        "dp_rank": state.dp_rank,
    }
    if dims.ep > 1:
        out["ep"] = ranks(state.ep_group)
        out["ep_fsdp"] = ranks(state.ep_fsdp_group)
        out["ep_fsdp_mesh_shape"] = tuple(state.ep_fsdp_mesh.shape)
        out["ep_rank"] = state.ep_rank
    with use_parallel_state(state):
        out["current_is_state"] = current_parallel_state() is state
    # Hot paths ask for their group on every call (each MoE dispatch, each Ulysses attention): the sub-meshes are
    # sliced once, so asking again builds no new DeviceMesh (a slice runs a nonzero over the mesh tensor).
    with HostSyncCounter() as slicing:
        meshes = [state.sp_mesh] + ([state.ep_fsdp_mesh] if dims.ep > 1 else [])
        groups = [state.sp_group, state.sp_rank] + ([state.ep_group, state.ep_rank] if dims.ep > 1 else [])
    again_meshes = [state.sp_mesh] + ([state.ep_fsdp_mesh] if dims.ep > 1 else [])
    out["submeshes_cached"] = all(a is b for a, b in zip(meshes, again_meshes, strict=True)) and groups == [
        state.sp_group,
        state.sp_rank,
        *([state.ep_group, state.ep_rank] if dims.ep > 1 else []),
    ]
    out["slicing_after_first_use"] = dict(slicing.counts)
    # The all-reduce over each group proves the groups are real and agree across ranks.
    t = torch.ones(1, device=ctx.device)
    dist.all_reduce(t, group=state.loss_group)
    out["loss_group_sum"] = int(t.item())
    return out


@pytest.mark.parametrize("world_size, backend", backend_params(4))
def test_mesh_layout_4_ranks(dist_pools, world_size, backend):
    pool = dist_pools.get(world_size, backend)
    res = pool.run(_mesh_layout, {"dp_replicate": 1, "dp_shard": 2, "sp": 2, "ep": 2})
    for rank, r in enumerate(res):
        assert r["cached"] and r["current_is_state"]
        assert r["submeshes_cached"] and not r["slicing_after_first_use"], r["slicing_after_first_use"]
        assert r["sp"] == [rank - rank % 2, rank - rank % 2 + 1]  # SP innermost: consecutive ranks
        assert r["dp"] == [rank % 2, rank % 2 + 2]
        assert r["fsdp_shard"] == [0, 1, 2, 3]
        assert r["loss"] == [0, 1, 2, 3] and r["loss_group_sum"] == 4
        assert r["fsdp_mesh_shape"] == (4,)
        assert r["ep"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert r["ep_fsdp"] == [rank % 2, rank % 2 + 2]
        assert r["ep_rank"] == rank % 2 and r["sp_rank"] == rank % 2 and r["dp_rank"] == rank // 2
    res = pool.run(_mesh_layout, {"dp_replicate": 2, "dp_shard": 2, "sp": 1, "ep": 2})
    for rank, r in enumerate(res):
        assert r["sp"] == [rank]
        assert r["fsdp_shard"] == [rank - rank % 2, rank - rank % 2 + 1]  # never across replicas
        assert r["fsdp_mesh_shape"] == (2, 2)
        assert r["ep_fsdp_mesh_shape"] == (2, 1)
        assert r["ep"] == [rank - rank % 2, rank - rank % 2 + 1]


def _wrong_world(ctx):
    build_parallel_state(ParallelDims(dp_shard=ctx.world_size + 1), ctx.device_type)


def test_world_size_mismatch_raises(dist_pools):
    with pytest.raises(AssertionError, match="but the world size is 2"):
        dist_pools.get(2).run(_wrong_world)
