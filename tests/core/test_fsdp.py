"""apply_fsdp2 (dense, HSDP, EP), meta-device materialisation and full-state-dict loading vs one process.

Every distributed step is compared with a single-process oracle that each rank computes itself on the whole
global batch (loss = mean over all tokens). Rank r reads the rows of its data-parallel index; its loss is its
local token sum * world / global tokens, because FSDP averages gradients over the world.
"""

from __future__ import annotations

import copy

import attrs
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import toy_models as toy
from dist_harness import backend_params
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from veomni.core.checkpointing import apply_activation_checkpointing
from veomni.core.ep import expert_shard_of
from veomni.core.fsdp import (
    FSDPPolicy,
    StateDictMismatchError,
    apply_fsdp2,
    forward_through,
    load_full_state_dict,
    materialize_sharded,
    set_grad_sync,
)
from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import build_parallel_state

FP32 = FSDPPolicy(block_patterns=("layers.*",), param_dtype=None, reduce_dtype=torch.float32)
ROWS_PER_RANK, SEQ, LR = 2, 5, 0.5


def _state(ctx, dp_replicate: int = 1, ep: int = 1, sp: int = 1):
    return build_parallel_state(
        ParallelDims.for_world(ctx.world_size, dp_replicate=dp_replicate, ep=ep, sp=sp), ctx.device_type
    )


def _oracle(model, ids, labels):
    """Single-process step: loss, grads and SGD-updated params on the whole batch."""
    loss = F.cross_entropy(model(ids).flatten(0, 1), labels.flatten())
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return loss.detach(), grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _local_loss(model, ids, labels, world: int, n_global: int):
    return F.cross_entropy(model(ids).flatten(0, 1), labels.flatten(), reduction="sum") * world / n_global


def _full(t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, DTensor):
        return t
    mesh, local = t.device_mesh, t.to_local()
    if local.device.type != mesh.device_type:  # a CPU-offloaded shard: gather it on the mesh's device
        t = DTensor.from_local(
            local.to(mesh.device_type), mesh, t.placements, shape=t.shape, stride=t.stride()
        )
    return t.full_tensor()


def _expected(oracle_value: torch.Tensor, param) -> torch.Tensor:
    shard = expert_shard_of(param)
    return oracle_value if shard is None else oracle_value[shard.start : shard.stop]


def _check_step(ctx, state, model, ref, ids, labels, microsteps: int = 1, defer_rs: bool = False):
    """One distributed step of ``model`` (sharded copy of ``ref``) compared with the oracle on ``ref``."""
    dp, dp_rank, world = state.dims.dp, state.dp_rank, ctx.world_size
    ref_loss, ref_grads, ref_params = _oracle(ref, ids, labels)
    # SP peers read the same rows and split the sequence (the toy blocks mix no tokens, so no SP collective).
    sp, sp_rank = state.dims.sp, state.sp_rank
    my_ids = ids.chunk(dp)[dp_rank].chunk(sp, dim=1)[sp_rank]
    my_labels = labels.chunk(dp)[dp_rank].chunk(sp, dim=1)[sp_rank]
    total = torch.zeros((), device=ctx.device)
    for i, (mi, ml) in enumerate(zip(my_ids.chunk(microsteps), my_labels.chunk(microsteps), strict=True)):
        set_grad_sync(model, i == microsteps - 1, defer_reduce_scatter=defer_rs)
        loss = _local_loss(model, mi, ml, world, labels.numel())
        loss.backward()
        total += loss.detach()
    dist.all_reduce(total)
    torch.testing.assert_close(total / world, ref_loss, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        torch.testing.assert_close(
            _full(p.grad),
            _expected(ref_grads[name], p),
            rtol=1e-5,
            atol=1e-6,
            msg=lambda m, name=name: f"{name}: {m}",
        )
    torch.optim.SGD(model.parameters(), lr=LR).step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(
            _full(p),
            _expected(ref_params[name], p),
            rtol=1e-5,
            atol=1e-6,
            msg=lambda m, name=name: f"{name}: {m}",
        )


def _dense_parity(ctx, dp_replicate: int, ac: bool, microsteps: int, defer_rs: bool, offload: bool, sp: int):
    state = _state(ctx, dp_replicate, sp=sp)
    ref = toy.build(0, ctx.device)
    policy = attrs.evolve(FP32, activation_checkpointing=ac, cpu_offload=offload, pin_memory=False)
    model = apply_fsdp2(copy.deepcopy(ref), state, policy)
    assert isinstance(model, FSDPModule) and isinstance(model.layers[0], FSDPModule)
    if offload:
        assert model.layers[0].fc1.weight.to_local().device.type == "cpu"
    ids, labels = toy.token_batch(1, ROWS_PER_RANK * state.dims.dp, SEQ)
    _check_step(ctx, state, model, ref, ids.to(ctx.device), labels.to(ctx.device), microsteps, defer_rs)


# (dp_replicate, activation checkpointing, micro-steps, defer reduce-scatter, CPU offload, sp)
DENSE_CASES = {
    1: [(1, False, 1, False, False, 1)],
    2: [(1, False, 1, False, False, 1), (2, True, 2, False, False, 1), (1, False, 1, False, True, 1)],
    4: [(1, False, 1, False, False, 1), (2, False, 2, False, False, 1), (2, True, 2, True, False, 1)]
    + [(1, False, 2, False, False, 2)],
}


@pytest.mark.parametrize("world_size, backend", backend_params(1, 2, 4))
def test_dense_step_matches_single_process(dist_pools, world_size, backend):
    pool = dist_pools.get(world_size, backend)
    for case in DENSE_CASES[world_size]:
        pool.run(_dense_parity, *case)


def _head_unit_parity(ctx, moe: bool, read_head_weight: bool, reshard: bool):
    state = _state(ctx, ep=2 if moe else 1)
    ref = toy.build(0, ctx.device, moe=moe, read_head_weight=read_head_weight)
    policy = attrs.evolve(FP32, head="head", reshard_after_forward=reshard)
    model = apply_fsdp2(copy.deepcopy(ref), state, policy, toy.MOE_PLAN if moe else None)
    if moe:
        model.set_ep_group(state.ep_group)
    # A unit of its own (not gathered with the root), the other root parameters untouched.
    assert isinstance(model.head, FSDPModule) and not isinstance(model.embed, FSDPModule)
    assert list(model.state_dict()) == list(ref.state_dict())
    ids, labels = toy.token_batch(5, ROWS_PER_RANK * state.dims.dp, SEQ)
    _check_step(ctx, state, model, ref, ids.to(ctx.device), labels.to(ctx.device), microsteps=2)


def _head_read_without_forward_through(ctx):
    # Outside its forward a head unit's weight is this rank's shard: the reason for forward_through.
    model = apply_fsdp2(toy.build(0, ctx.device), _state(ctx), attrs.evolve(FP32, head="head"))
    assert isinstance(model.head.weight, DTensor)
    kind, shape = forward_through(model.head, lambda head: (type(head.weight), tuple(head.weight.shape)))
    assert not issubclass(kind, DTensor) and shape == (11, 8)
    model.head.reshard()
    assert isinstance(model.head.weight, DTensor)


@pytest.mark.parametrize("world_size, backend", backend_params(2))
def test_head_unit_matches_single_process(dist_pools, world_size, backend):
    """The head as its own FSDP unit, called or read through `forward_through` (as a fused loss reads it), with
    and without resharding the blocks, dense and EP: same loss, gradients and updated parameters as one
    process over two micro-steps."""
    pool = dist_pools.get(world_size, backend)
    for moe, read, reshard in [(False, True, True), (False, False, False), (True, True, True)]:
        pool.run(_head_unit_parity, moe, read, reshard)
    pool.run(_head_read_without_forward_through)


def _moe_parity(ctx, dp_replicate: int, ep: int, num_experts: int, ac: bool, sp: int = 1):
    state = _state(ctx, dp_replicate, ep, sp)
    ref = toy.build(0, ctx.device, moe=True, num_experts=num_experts)
    model = copy.deepcopy(ref)
    policy = attrs.evolve(FP32, activation_checkpointing=ac)
    apply_fsdp2(model, state, policy, toy.MOE_PLAN)
    model.set_ep_group(state.ep_group)
    w1 = model.layers[0].experts.w1
    shard = expert_shard_of(w1)
    assert shard is not None and (shard.ep_size, shard.ep_rank) == (ep, state.ep_rank)
    # Compare ranks, not group objects: DTensor may hand back an equal mesh of another state of the same layout.
    fsdp_ranks = dist.get_process_group_ranks(w1.device_mesh.get_group(w1.device_mesh.ndim - 1))
    assert fsdp_ranks == dist.get_process_group_ranks(state.ep_fsdp_group)
    local_experts = num_experts // ep
    want_dim = 0 if local_experts % state.dims.ep_fsdp == 0 else 1
    assert w1.placements[-1] == Shard(want_dim), (w1.placements, local_experts, state.dims.ep_fsdp)
    ids, labels = toy.token_batch(2, ROWS_PER_RANK * state.dims.dp, SEQ)
    _check_step(ctx, state, model, ref, ids.to(ctx.device), labels.to(ctx.device))


# (dp_replicate, ep, experts, activation checkpointing[, sp])
MOE_CASES = {
    2: [(1, 2, 4, False)],
    4: [(1, 2, 2, True), (1, 4, 4, False), (2, 2, 4, False), (1, 2, 4, False, 2)],
}


@pytest.mark.parametrize("world_size, backend", backend_params(2, 4))
def test_moe_ep_step_matches_single_process(dist_pools, world_size, backend):
    pool = dist_pools.get(world_size, backend)
    for case in MOE_CASES[world_size]:
        pool.run(_moe_parity, *case)


def _meta_build_and_load(ctx, ep: int, offload: bool = False):
    state = _state(ctx, 1, ep)
    moe = ep > 1
    eager = toy.build(3, ctx.device, moe=moe)
    full_sd = {k: v.detach().clone() for k, v in eager.state_dict().items()}
    with torch.device("meta"):
        model = toy.ToyModel(moe=moe)
    policy = attrs.evolve(FP32, cpu_offload=offload, pin_memory=False)
    apply_fsdp2(model, state, policy, toy.MOE_PLAN if moe else None)
    materialize_sharded(model, ctx.device, toy.init_fn, cpu_offload=offload)
    if offload:  # shards on the CPU, buffers on the compute device
        assert model.head.weight.to_local().device.type == "cpu" and model.logit_scale.device == ctx.device
    assert all(not _full(p).is_meta and bool((_full(p) == 0).all()) for p in model.parameters())
    if moe:
        assert expert_shard_of(model.layers[1].experts.w2) is not None  # the record survives to_empty
        model.set_ep_group(state.ep_group)
    else:
        torch.testing.assert_close(model.layers[0].gate, eager.layers[0].gate)  # non-persistent, from init_fn
    load_full_state_dict(model, full_sd)
    for name, p in model.named_parameters():
        torch.testing.assert_close(
            _full(p),
            _expected(dict(eager.named_parameters())[name], p),
            msg=lambda m, name=name: f"{name}: {m}",
        )
    ids, _ = toy.token_batch(4, 2, SEQ)
    ids = ids.to(ctx.device)
    torch.testing.assert_close(model(ids), eager(ids), rtol=1e-5, atol=1e-6)

    bad = dict(full_sd)
    del bad["head.weight"]
    bad["extra.weight"] = torch.zeros(1)
    key = "layers.0.experts.w1" if moe else "layers.0.fc1.weight"
    bad[key] = torch.zeros(3, *bad[key].shape[1:])
    with pytest.raises(StateDictMismatchError) as info:
        load_full_state_dict(model, bad)
    err = info.value
    assert err.missing == ["head.weight"] and err.unexpected == ["extra.weight"]
    assert [m[0] for m in err.mismatched] == [key]
    assert "missing keys (1): ['head.weight']" in str(err) and key in str(err)


@pytest.mark.parametrize("world_size, backend", backend_params(1, 2, 4))
def test_meta_materialize_and_full_load_match_eager(dist_pools, world_size, backend):
    pool = dist_pools.get(world_size, backend)
    pool.run(_meta_build_and_load, 1)
    if world_size > 1:
        pool.run(_meta_build_and_load, 2)
    if world_size == 2:
        pool.run(_meta_build_and_load, 1, True)


def _bf16_step(ctx):
    state = _state(ctx)
    ref = toy.build(0, ctx.device)
    model = apply_fsdp2(copy.deepcopy(ref), state, FSDPPolicy(block_patterns=("layers.*",)))
    ids, labels = toy.token_batch(1, ROWS_PER_RANK * state.dims.dp, SEQ)
    ids, labels = ids.to(ctx.device), labels.to(ctx.device)
    # The reduction's oracle: every dp rank's bf16 gradients (a plain bf16 copy computes the same bf16 ops as the
    # unsharded FSDP unit), widened to fp32 and averaged there, as reduce_dtype=fp32 promises. The comparison with
    # the fp32 model below is loose (bf16 compute); a reduction in bf16 would round the average to 8 bits and
    # still pass it, but not this one.
    low = toy.build(0, ctx.device).bfloat16()
    dp = state.dims.dp
    reduced = {n: torch.zeros(p.shape, device=ctx.device) for n, p in low.named_parameters()}
    for r in range(dp):
        low.zero_grad(set_to_none=True)
        _local_loss(low, ids.chunk(dp)[r], labels.chunk(dp)[r], ctx.world_size, labels.numel()).backward()
        for n, p in low.named_parameters():
            reduced[n] += p.grad.float() / ctx.world_size
    ref_loss = F.cross_entropy(ref(ids).flatten(0, 1), labels.flatten())
    ref_loss.backward()
    loss = _local_loss(
        model,
        ids.chunk(state.dims.dp)[state.dp_rank],
        labels.chunk(state.dims.dp)[state.dp_rank],
        ctx.world_size,
        labels.numel(),
    )
    loss.backward()
    total = loss.detach().float()
    dist.all_reduce(total)
    torch.testing.assert_close(total / ctx.world_size, ref_loss.detach(), rtol=3e-2, atol=3e-2)
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, name  # fp32 master and grads
        torch.testing.assert_close(
            _full(p.grad), ref_grads[name].grad, rtol=5e-2, atol=2e-2, msg=lambda m, name=name: f"{name}: {m}"
        )
        torch.testing.assert_close(
            _full(p.grad), reduced[name], rtol=1e-6, atol=1e-9, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.parametrize("world_size, backend", backend_params(2))
def test_bf16_mixed_precision_step(dist_pools, world_size, backend):
    # gloo handles the bf16 all-gather (and the fp32 reduce-scatter) on CPU, so this also runs without a GPU.
    dist_pools.get(world_size, backend).run(_bf16_step)


def _errors_world1(ctx):
    state = _state(ctx)
    cases = [
        (
            dict(block_patterns=("blocks.*",)),
            None,
            ValueError,
            r"block pattern\(s\) \['blocks.\*'\] matched no",
        ),
        (dict(block_patterns=("layers.*", "layers.*.fc1")), None, ValueError, "is nested in block"),
        (dict(block_patterns=("layers.*",)), toy.MOE_PLAN, ValueError, "expert parallelism is off"),
    ]
    for kwargs, plan, exc, match in cases:
        with pytest.raises(exc, match=match):
            apply_fsdp2(toy.build(0, ctx.device, moe=plan is not None), state, FSDPPolicy(**kwargs), plan)
    with pytest.raises(ValueError, match="parameter\\(s\\) are not fp32: embed.weight"):
        apply_fsdp2(toy.build(0, ctx.device).bfloat16(), state, FSDPPolicy(block_patterns=("layers.*",)))
    tied = toy.build(0, ctx.device)
    tied.head.weight = tied.embed.weight
    head_cases = [
        (tied, "head", r"shares parameters with \['embed.weight'\] \(tied embeddings\?\)"),
        (toy.build(0, ctx.device), "layers.1.fc2", "overlaps the block/expert units \\['layers.1'\\]"),
        (toy.build(0, ctx.device), "lm_head", "names no submodule of ToyModel"),
        (toy.build(0, ctx.device), "norm.missing", "names no submodule"),
    ]
    for model, head, match in head_cases:
        with pytest.raises(ValueError, match=match):
            apply_fsdp2(model, state, attrs.evolve(FP32, head=head))
    model = apply_fsdp2(toy.build(0, ctx.device), state, FP32)
    with pytest.raises(ValueError, match="already has FSDP applied"):
        apply_fsdp2(model, state, FP32)
    with pytest.raises(TypeError, match="expects the FSDP root"):
        set_grad_sync(toy.build(0), True)
    with pytest.raises(TypeError, match="init_fn must be a callable"):
        materialize_sharded(model, ctx.device, None)  # type: ignore[arg-type]


def _errors_ep(ctx):
    state = _state(ctx, 1, 2)
    with pytest.raises(ValueError, match="no expert_plan was given"):
        apply_fsdp2(toy.build(0, ctx.device, moe=True), state, FP32)
    with pytest.raises(ValueError, match="'layers.1.experts' is not inside any block"):
        apply_fsdp2(
            toy.build(0, ctx.device, moe=True), state, FSDPPolicy(block_patterns=("layers.0",)), toy.MOE_PLAN
        )
    model = toy.build(0, ctx.device, moe=True)
    model.layers[0].experts.bias = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"also owns non-expert parameters \['bias'\]"):
        apply_fsdp2(model, state, FP32, toy.MOE_PLAN)
    with pytest.raises(ValueError, match="blocks must contain expert modules"):
        apply_fsdp2(
            toy.build(0, ctx.device, moe=True),
            state,
            FSDPPolicy(block_patterns=("layers.*.experts",)),
            toy.MOE_PLAN,
        )
    # ep = world: one-rank ep_fsdp groups, where FSDP2 would divide fp16-reduced expert gradients twice.
    fp16 = FSDPPolicy(block_patterns=("layers.*",), param_dtype=None, reduce_dtype=torch.float16)
    with pytest.raises(
        ValueError, match="expert module layers.0.experts is reduced in torch.float16 over a one-rank ep_fsdp"
    ):
        apply_fsdp2(toy.build(0, ctx.device, moe=True), state, fp16, toy.MOE_PLAN)


def test_documented_errors(dist_pools):
    dist_pools.get(1).run(_errors_world1)
    dist_pools.get(2).run(_errors_ep)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"block_patterns": "layers.*"}, TypeError, "the string 'layers.\\*'"),
        ({"block_patterns": ()}, ValueError, "at least one block"),
        ({"block_patterns": ("layers..x",)}, ValueError, "empty FQN component"),
        ({"block_patterns": ("layers.*",), "param_dtype": torch.int32}, ValueError, "floating torch.dtype"),
        ({"block_patterns": ("layers.*",), "cpu_offload": "yes"}, TypeError, "cpu_offload"),
        ({"block_patterns": ("layers.*",), "head": ""}, ValueError, "module FQN such as 'lm_head'"),
        ({"block_patterns": ("layers.*",), "head": "lm..head"}, ValueError, "module FQN such as 'lm_head'"),
        ({"block_patterns": ("layers.*",), "head": 3}, TypeError, "head"),
    ],
)
def test_policy_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        FSDPPolicy(**kwargs)


def test_activation_checkpointing_of_a_plain_model():
    """Same loss and gradients with the blocks recomputed; the checkpoint keys stay; bad patterns and a second
    application are refused."""
    ids, labels = toy.token_batch(3, batch=2, seq=7)
    ref = toy.build(seed=4)
    model = copy.deepcopy(ref)
    assert apply_activation_checkpointing(model, ("layers.*",)) == ["layers.0", "layers.1"]
    assert list(model.state_dict()) == list(ref.state_dict())
    losses = []
    for m in (ref, model):
        loss = F.cross_entropy(m(ids).flatten(0, 1), labels.flatten())
        loss.backward()
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1])
    for (name, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)
    with pytest.raises(ValueError, match="apply_activation_checkpointing: block pattern"):
        apply_activation_checkpointing(copy.deepcopy(ref), ("blocks.*",))
    with pytest.raises(ValueError, match="already has a checkpointed forward"):
        apply_activation_checkpointing(model, ("layers.*",))
