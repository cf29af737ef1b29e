"""clip_grad_norm across the dense (HSDP) and expert meshes equals torch's clip on the unsharded model."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
import toy_models as toy
from dist_harness import backend_params
from torch.distributed.tensor import DTensor

from veomni.core.clip import clip_grad_norm
from veomni.core.ep import expert_shard_of
from veomni.core.fsdp import FSDPPolicy, apply_fsdp2
from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import build_parallel_state

FP32 = FSDPPolicy(block_patterns=("layers.*",), param_dtype=None, reduce_dtype=torch.float32)
MAX_NORM = 0.05  # small enough that both norms clip


def _backward(model, ids, labels, scale: float) -> None:
    loss = F.cross_entropy(model(ids).flatten(0, 1), labels.flatten(), reduction="sum") * scale
    loss.backward()


def _clip_parity(ctx, dp_replicate: int, ep: int):
    state = build_parallel_state(
        ParallelDims.for_world(ctx.world_size, dp_replicate=dp_replicate, ep=ep), ctx.device_type
    )
    moe = ep > 1
    ref = toy.build(5, ctx.device, moe=moe)
    model = copy.deepcopy(ref)
    apply_fsdp2(model, state, FP32, toy.MOE_PLAN if moe else None)
    if moe:
        model.set_ep_group(state.ep_group)
    dp, world = state.dims.dp, ctx.world_size
    ids, labels = (t.to(ctx.device) for t in toy.token_batch(6, 2 * dp, 5))
    _backward(ref, ids, labels, 1.0 / labels.numel())
    _backward(model, ids.chunk(dp)[state.dp_rank], labels.chunk(dp)[state.dp_rank], world / labels.numel())

    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    saved = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
    for norm_type in (2.0, math.inf):
        for n, p in ref.named_parameters():
            p.grad.copy_(ref_grads[n])
        for n, p in model.named_parameters():
            p.grad.to_local().copy_(saved[n])
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM, norm_type=norm_type)
        got = clip_grad_norm(model, MAX_NORM, state, norm_type=norm_type)
        assert got.dtype == torch.float32 and got.dim() == 0 and got.device == state.device
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        assert float(want) > MAX_NORM
        ref_params = dict(ref.named_parameters())
        for n, p in model.named_parameters():
            shard = expert_shard_of(p)
            expected = ref_params[n].grad if shard is None else ref_params[n].grad[shard.start : shard.stop]
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")


CASES = {
    1: [(1, 1)],
    2: [(2, 1), (1, 2)],  # HSDP (2 replicas of 1 shard); EP=2
    4: [(2, 1), (1, 2), (1, 4), (2, 2)],  # HSDP 2x2; EP=2 with ep_fsdp=2; EP=4; HSDP with EP
}


@pytest.mark.parametrize("world_size, backend", backend_params(1, 2, 4))
def test_clip_matches_torch_on_unsharded_model(dist_pools, world_size, backend):
    pool = dist_pools.get(world_size, backend)
    for dp_replicate, ep in CASES[world_size]:
        pool.run(_clip_parity, dp_replicate, ep)


def _plain_and_nonfinite(ctx):
    state = build_parallel_state(ParallelDims.for_world(ctx.world_size), ctx.device_type)
    # Plain tensors (no FSDP) are replicated: counted locally, no reduction. Mixed dtypes accumulate in fp32.
    grads = [torch.randn(4, 3, device=ctx.device), torch.randn(5, device=ctx.device).bfloat16()]
    params = [torch.zeros_like(g, requires_grad=True) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    want = torch.linalg.vector_norm(torch.cat([g.float().flatten() for g in grads]))  # fp32, unlike torch's
    got = clip_grad_norm(params, 0.5, state)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(params[0].grad, grads[0] * (0.5 / (want + 1e-6)))
    # Large max_norm: the coefficient is exactly 1 and gradients are unchanged.
    before = params[0].grad.clone()
    clip_grad_norm(params, 1e6, state)
    assert torch.equal(params[0].grad, before)

    # A nan on one rank only: every rank reports nan (it is never skipped silently).
    model = apply_fsdp2(toy.build(0, ctx.device), state, FP32)
    ids, labels = (t.to(ctx.device) for t in toy.token_batch(1, 2, 5))
    _backward(model, ids, labels, 1.0)
    if ctx.rank == ctx.world_size - 1:
        local = model.head.weight.grad.to_local()
        local.view(-1)[0] = float("nan") if local.numel() else local.view(-1)[0]
    norm = clip_grad_norm(model, 1.0, state)
    assert torch.isnan(norm)
    # The inf-norm too, whichever rank holds the NaN: a backend's MAX keeps one operand (gloo's std::max drops a
    # NaN met in one order), so the NaN must travel apart.
    for bad in range(ctx.world_size):
        model.zero_grad()
        _backward(model, ids, labels, 1.0)
        local = model.layers[0].fc1.weight.grad.to_local()
        if ctx.rank == bad and local.numel():
            local.view(-1)[0] = float("nan")
        assert torch.isnan(clip_grad_norm(model, 1.0, state, norm_type=math.inf, scale_gradients=False)), bad
    local = model.head.weight.grad.to_local()
    if ctx.rank == ctx.world_size - 1 and local.numel():
        local.view(-1)[0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm(model, 1.0, state, error_if_nonfinite=True)
    with pytest.raises(ValueError, match="norm_type must be > 0"):
        clip_grad_norm(params, 1.0, state, norm_type=0)
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        clip_grad_norm(params, -1.0, state)
    return float(norm)


def test_plain_tensors_and_nonfinite(dist_pools):
    for world_size in (1, 2):
        dist_pools.get(world_size).run(_plain_and_nonfinite)


def _wrong_mesh(ctx):
    # Clipping with a ParallelState other than the one the model was sharded with is caught, not miscounted.
    hsdp = build_parallel_state(ParallelDims.for_world(ctx.world_size, dp_replicate=2), ctx.device_type)
    fsdp = build_parallel_state(ParallelDims.for_world(ctx.world_size), ctx.device_type)
    model = apply_fsdp2(toy.build(0, ctx.device), fsdp, FP32)
    ids, labels = (t.to(ctx.device) for t in toy.token_batch(1, 2, 5))
    _backward(model, ids, labels, 1.0)
    with pytest.raises(
        ValueError, match="embed.weight is a dense parameter but its gradient is sharded over ranks"
    ):
        clip_grad_norm(model, 1.0, hsdp)


def test_gradient_on_unexpected_mesh_raises(dist_pools):
    dist_pools.get(2).run(_wrong_mesh)
