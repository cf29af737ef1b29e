"""ExpertPlan glob matching, apply_expert_plan slicing (real EP groups, meta device) and its errors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from dist_harness import backend_params
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from veomni.core.ep import (
    ExpertPlan,
    ExpertShard,
    apply_expert_plan,
    expert_module_fqns,
    expert_shard_of,
    expert_shards,
)
from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import build_parallel_state

PLAN = ExpertPlan(patterns=("layers.*.moe.experts.gate_up_proj", "layers.*.moe.experts.down_proj"))


class _Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.randn(num_experts, hidden, inter))


class _Moe(nn.Module):
    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = _Experts(num_experts, hidden, inter)


class _Layer(nn.Module):
    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.attn = nn.Linear(hidden, hidden)
        self.moe = _Moe(num_experts, hidden, inter)


class _Model(nn.Module):
    def __init__(self, num_layers: int = 2, num_experts: int = 4, hidden: int = 3, inter: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, hidden)
        self.layers = nn.ModuleList(_Layer(num_experts, hidden, inter) for _ in range(num_layers))


def _expert_fqns(num_layers: int) -> list[str]:
    return [f"layers.{i}.moe.experts.{n}" for i in range(num_layers) for n in ("gate_up_proj", "down_proj")]


# Patterns ---------------------------------------------------------------------------------------------------
def test_star_matches_exactly_one_component():
    plan = ExpertPlan(patterns=("layers.1.moe.experts.*",))
    assert plan.matches("layers.1.moe.experts.down_proj")
    assert not plan.matches("layers.10.moe.experts.down_proj")
    assert not plan.matches("layers.1.moe.experts.down_proj.extra")
    star = ExpertPlan(patterns=("layers.*.w",))
    assert star.matches("layers.10.w") and star.matches("layers.1.w")
    assert not star.matches("layers.1.0.w") and not star.matches("layers.w")
    assert ExpertPlan(patterns=("a.exp*s.w",)).matches("a.experts.w")
    assert not ExpertPlan(patterns=("a.exp*s.w",)).matches("a.exp.s.w")
    # Regex metacharacters are literal.
    assert not ExpertPlan(patterns=("a+b.w",)).matches("aab.w")


def test_plan_on_layer_1_does_not_touch_layer_10():
    torch.manual_seed(0)
    model = _Model(num_layers=12)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    shards = apply_expert_plan(model, ExpertPlan(patterns=("layers.1.moe.experts.*",)), ep_size=2, ep_rank=1)
    assert sorted(shards) == ["layers.1.moe.experts.down_proj", "layers.1.moe.experts.gate_up_proj"]
    for name, param in model.named_parameters():
        if name in shards:
            assert torch.equal(param, before[name][2:4])
        else:
            assert torch.equal(param, before[name]) and expert_shard_of(param) is None
    fqns = expert_module_fqns(model, ExpertPlan(patterns=("layers.1*.moe.experts.down_proj",)))
    assert fqns == ["layers.1.moe.experts", "layers.10.moe.experts", "layers.11.moe.experts"]


@pytest.mark.parametrize(
    "patterns, error, message",
    [
        ((), ValueError, "at least one"),
        (("",), ValueError, "non-empty strings"),
        ((3,), ValueError, "non-empty strings"),
        (("layers..w",), ValueError, "empty FQN component"),
        ((".w",), ValueError, "empty FQN component"),
        (("layers.**.w",), ValueError, "exactly one FQN component"),
        (("layers.* .w",), ValueError, "whitespace"),
        ("layers.*.w", TypeError, "sequence of strings, got the string"),
    ],
)
def test_invalid_patterns(patterns, error, message):
    with pytest.raises(error, match=message):
        ExpertPlan(patterns=patterns)


def test_patterns_are_a_tuple_and_plan_is_frozen():
    plan = ExpertPlan(patterns=["a.w", "b.*"])
    assert plan.patterns == ("a.w", "b.*")
    with pytest.raises(AttributeError):
        plan.patterns = ("c",)  # type: ignore[misc]


# Slicing ----------------------------------------------------------------------------------------------------
@settings(max_examples=40)
@given(
    ep_size=st.sampled_from([1, 2, 3, 4]),
    local=st.integers(1, 3),
    hidden=st.integers(1, 4),
    inter=st.integers(1, 3),
    num_layers=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_slices_concatenate_to_the_original(ep_size, local, hidden, inter, num_layers, seed):
    torch.manual_seed(seed)
    full = _Model(num_layers=num_layers, num_experts=ep_size * local, hidden=hidden, inter=inter)
    full.layers[0].moe.experts.down_proj.requires_grad_(False)
    per_rank = []
    for rank in range(ep_size):
        model = copy.deepcopy(full)
        shards = apply_expert_plan(model, PLAN, ep_size=ep_size, ep_rank=rank)
        assert list(shards) == _expert_fqns(num_layers)
        params = dict(model.named_parameters())
        for fqn, shard in shards.items():
            assert shard == ExpertShard(fqn=fqn, num_experts=ep_size * local, ep_size=ep_size, ep_rank=rank)
            assert (shard.start, shard.stop, shard.local_experts) == (rank * local, (rank + 1) * local, local)
            param = params[fqn]
            assert type(param) is nn.Parameter and param.is_contiguous()
            assert expert_shard_of(param) is shard
            assert param.requires_grad == (fqn != "layers.0.moe.experts.down_proj")
        assert expert_shards(model) == shards
        assert expert_shards(model.layers[0]) == {
            k[len("layers.0.") :]: v for k, v in shards.items() if k.startswith("layers.0.")
        }
        per_rank.append(params)
    for fqn, original in full.named_parameters():
        if fqn in set(_expert_fqns(num_layers)):
            assert torch.equal(torch.cat([params[fqn] for params in per_rank]), original)
        else:
            assert all(torch.equal(params[fqn], original) for params in per_rank)


def test_meta_device_model():
    with torch.device("meta"):
        model = _Model(num_layers=3, num_experts=8, hidden=16, inter=4)
    shards = apply_expert_plan(model, PLAN, ep_size=4, ep_rank=3)
    gate_up = model.layers[2].moe.experts.gate_up_proj
    assert gate_up.device.type == "meta" and gate_up.shape == (2, 8, 16)
    assert shards["layers.2.moe.experts.gate_up_proj"].start == 6
    # The parameter object does not survive to_empty; the module-side record does.
    model.to_empty(device="cpu")
    assert expert_shard_of(model.layers[2].moe.experts.gate_up_proj) is None
    assert expert_shards(model) == shards
    with pytest.raises(ValueError, match="already EP-sharded"):
        apply_expert_plan(model, PLAN, ep_size=4, ep_rank=3)


def test_expert_module_fqns():
    model = _Model(num_layers=11)
    fqns = expert_module_fqns(model, PLAN)
    assert fqns == sorted(f"layers.{i}.moe.experts" for i in range(11))
    assert fqns[:3] == ["layers.0.moe.experts", "layers.1.moe.experts", "layers.10.moe.experts"]
    apply_expert_plan(model, PLAN, ep_size=2, ep_rank=0)
    assert expert_module_fqns(model, PLAN) == fqns  # names survive sharding
    assert expert_module_fqns(model.layers[0].moe.experts, ExpertPlan(patterns=("down_proj",))) == [""]


# Errors -----------------------------------------------------------------------------------------------------
def _assert_untouched(model, before):
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]) and expert_shard_of(param) is None
    assert expert_shards(model) == {}


@pytest.mark.parametrize(
    "ep_size, ep_rank, message",
    [
        (0, 0, "ep_size must be a positive int, got 0"),
        (True, 0, "ep_size must be a positive int, got True"),
        (2, 2, r"ep_rank must be an int in \[0, 2\), got 2"),
        (2, -1, r"ep_rank must be an int in \[0, 2\), got -1"),
        (3, 0, "has shape \\(4, 4, 3\\): its 4 experts \\(dim 0\\) cannot be split evenly across ep_size=3"),
    ],
)
def test_bad_ep_size_or_rank(ep_size, ep_rank, message):
    model = _Model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=message):
        apply_expert_plan(model, PLAN, ep_size=ep_size, ep_rank=ep_rank)
    _assert_untouched(model, before)


def test_pattern_matching_nothing_names_it_and_the_parameters():
    model = _Model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    plan = ExpertPlan(patterns=("layers.*.moe.experts.down_proj", "layers.*.mlp.experts.*"))
    with pytest.raises(
        ValueError, match=r"\['layers.\*.mlp.experts.\*'\] matched no parameter of _Model.*embed"
    ):
        apply_expert_plan(model, plan, ep_size=2, ep_rank=0)
    _assert_untouched(model, before)
    with pytest.raises(ValueError, match="matched no parameter"):
        expert_module_fqns(model, plan)


def test_zero_dim_and_tied_and_applied_twice():
    model = _Model()
    model.layers[1].moe.experts.down_proj = nn.Parameter(torch.tensor(1.0))
    with pytest.raises(
        ValueError, match="'layers.1.moe.experts.down_proj' is 0-dim; expected a fused tensor"
    ):
        apply_expert_plan(model, PLAN, ep_size=1, ep_rank=0)
    assert expert_shards(model) == {}  # nothing was changed before the error

    tied = _Model()
    tied.layers[1].moe.experts.down_proj = tied.layers[0].moe.experts.down_proj
    with pytest.raises(ValueError, match="is tied to"):
        apply_expert_plan(tied, PLAN, ep_size=2, ep_rank=0)

    model = _Model()
    apply_expert_plan(model, PLAN, ep_size=2, ep_rank=0)
    with pytest.raises(ValueError, match="'layers.0.moe.experts.gate_up_proj' is already EP-sharded"):
        apply_expert_plan(model, PLAN, ep_size=2, ep_rank=0)
    with pytest.raises(ValueError, match="already EP-sharded"):  # even with ep_size=1
        apply_expert_plan(
            model, ExpertPlan(patterns=("layers.1.moe.experts.down_proj",)), ep_size=1, ep_rank=0
        )


# Real EP groups ---------------------------------------------------------------------------------------------
def _shard_on_ranks(ctx, ep: int, num_experts: int, seed: int):
    """Each rank shards the same seeded model for its EP rank, all-gathers the slices over the EP group."""
    torch.manual_seed(seed)
    with ctx.device:
        model = _Model(num_layers=2, num_experts=num_experts, hidden=3, inter=2)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    if ep == 1:
        group, ep_rank = dist.group.WORLD if ctx.world_size == 1 else None, 0
    elif ep == ctx.world_size:  # the world itself; spares building meshes (seconds on gloo)
        group, ep_rank = dist.group.WORLD, ctx.rank
    else:
        state = build_parallel_state(ParallelDims(dp_shard=ctx.world_size, ep=ep), ctx.device_type)
        group, ep_rank = state.ep_group, state.ep_rank
    shards = apply_expert_plan(model, PLAN, ep_size=ep, ep_rank=ep_rank)
    rebuilt_ok = True
    for fqn, param in model.named_parameters():
        if fqn in shards:
            parts = [torch.empty_like(param) for _ in range(ep)]
            if group is not None:
                dist.all_gather(parts, param.detach().contiguous(), group=group)
            else:
                parts = [param.detach()]
            rebuilt_ok &= torch.equal(torch.cat(parts), original[fqn])
        else:
            rebuilt_ok &= torch.equal(param, original[fqn])
    return {
        "ep_rank": ep_rank,
        "device": str(model.layers[0].moe.experts.down_proj.device),
        "shards": shards,
        "local": {fqn: p.detach().cpu() for fqn, p in model.named_parameters() if fqn in shards},
        "rebuilt_ok": rebuilt_ok,
    }


@pytest.mark.parametrize("world_size, backend", backend_params(1, 2, 4))
def test_apply_plan_on_real_ep_groups(dist_pools, world_size, backend):
    pool = dist_pools.get(world_size, backend)
    for ep in [d for d in (1, 2, 4) if world_size % d == 0]:
        for num_experts in (ep, 2 * ep):
            res = pool.run(_shard_on_ranks, ep, num_experts, 1234 + num_experts)
            for rank, r in enumerate(res):
                assert r["rebuilt_ok"] and r["ep_rank"] == rank % ep
                assert r["device"].startswith("cuda" if backend == "nccl" else "cpu")
                assert all(s.ep_size == ep and s.ep_rank == rank % ep for s in r["shards"].values())
            # EP groups are runs of consecutive ranks: each group's slices concatenate to the same tensors.
            for start in range(0, world_size, ep):
                group = res[start : start + ep]
                for fqn in _expert_fqns(2):
                    full = torch.cat([r["local"][fqn] for r in group])
                    assert full.shape[0] == num_experts
                    assert torch.equal(full, torch.cat([r["local"][fqn] for r in res[:ep]]))
