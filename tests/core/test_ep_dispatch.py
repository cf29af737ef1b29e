"""EP token dispatch/combine against a single-process oracle, on real process groups.

Every rank rebuilds the same seeded full problem (tokens of every rank, routing, all experts' weights),
runs its own tokens through dispatch -> local experts -> combine with only its EP rank's expert weights,
and returns outputs and gradients; the driver compares them with the single-process weighted expert sum
``y[t] = sum_j w[t, j] * f_{e[t, j]}(x[t])``, ``f_e(x) = silu(x @ W1[e]) @ W2[e]``.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_harness import backend_params
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from veomni.core.ep import (
    ExpertPlan,
    all_to_all_rows,
    apply_expert_plan,
    combine_tokens,
    dispatch_tokens,
)
from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import build_parallel_state

WORLDS = backend_params(1, 2, 4)


def _ep_group(ctx, ep: int):
    """(group, ep_rank, index of this rank's EP group); EP groups are runs of ``ep`` consecutive ranks."""
    if ep == 1:
        # A size-1 group on a 1-rank world, else None: both mean "no expert parallelism".
        return (dist.group.WORLD if ctx.world_size == 1 else None), 0, ctx.rank
    if ep == ctx.world_size:  # the world itself; spares building meshes (seconds on gloo)
        return dist.group.WORLD, ctx.rank, 0
    state = build_parallel_state(ParallelDims(dp_shard=ctx.world_size, ep=ep), ctx.device_type)
    return state.ep_group, state.ep_rank, ctx.rank // ep


def _problem(case: dict, group_index: int) -> dict:
    """The full, seeded problem of one EP group: every rank of the group builds the same tensors."""
    gen = torch.Generator().manual_seed(case["seed"] * 8 + group_index)
    tokens = case["tokens"][group_index * case["ep"] : (group_index + 1) * case["ep"]]
    num_tokens, k, num_experts, hidden, inter = sum(tokens), case["k"], case["E"], case["H"], case["I"]
    allowed = torch.tensor(case["allowed"])
    if case["distinct"]:
        picks = torch.rand(num_tokens, len(allowed), generator=gen).argsort(dim=1)[:, :k]
    else:
        picks = torch.randint(len(allowed), (num_tokens, k), generator=gen)
    f64 = torch.float64
    return {
        "tokens": tokens,
        "x": torch.randn(num_tokens, hidden, generator=gen, dtype=f64),
        "ids": allowed[picks],
        "w": torch.rand(num_tokens, k, generator=gen, dtype=f64),
        "w1": torch.randn(num_experts, hidden, inter, generator=gen, dtype=f64),
        "w2": torch.randn(num_experts, inter, hidden, generator=gen, dtype=f64),
        "cotangent": torch.randn(num_tokens, hidden, generator=gen, dtype=f64),
    }


def _oracle(p: dict) -> dict:
    x, w = p["x"].clone().requires_grad_(), p["w"].clone().requires_grad_()
    w1, w2 = p["w1"].clone().requires_grad_(), p["w2"].clone().requires_grad_()
    y = torch.zeros_like(x)
    for j in range(p["ids"].shape[1]):
        e = p["ids"][:, j]
        h = F.silu(torch.einsum("th,thi->ti", x, w1[e]))
        y = y + w[:, j : j + 1] * torch.einsum("ti,tih->th", h, w2[e])
    (y * p["cotangent"]).sum().backward()
    return {"y": y.detach(), "gx": x.grad, "gw": w.grad, "gw1": w1.grad, "gw2": w2.grad}


class _Experts(nn.Module):
    def __init__(self, w1: torch.Tensor, w2: torch.Tensor) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Parameter(w1.clone()), nn.Parameter(w2.clone())


def _ep_step(ctx, case: dict) -> dict:
    group, ep_rank, group_index = _ep_group(ctx, case["ep"])
    p = _problem(case, group_index)
    lo = sum(p["tokens"][:ep_rank])
    hi = lo + p["tokens"][ep_rank]
    dev = ctx.device
    x = p["x"][lo:hi].to(dev).requires_grad_()
    w = p["w"][lo:hi].to(dev).requires_grad_()
    ids = p["ids"][lo:hi].to(dev)
    experts = _Experts(p["w1"], p["w2"]).to(dev)
    apply_expert_plan(experts, ExpertPlan(patterns=("w1", "w2")), case["ep"], ep_rank)

    xd, counts, handle = dispatch_tokens(x, ids, case["E"], group)
    # The layout contract: local expert by local expert, each in (source rank, token, slot) order.
    local = case["E"] // case["ep"]
    expected = []
    for j in range(local):
        e = ep_rank * local + j
        rows = [t for t in range(p["ids"].shape[0]) for s in range(case["k"]) if p["ids"][t, s] == e]
        expected.append(p["x"][rows])
    layout_ok = torch.equal(xd.detach().cpu(), torch.cat(expected)) and counts == [len(t) for t in expected]
    layout_ok &= handle.local_expert_counts.tolist() == counts

    outs = [F.silu(xe @ experts.w1[j]) @ experts.w2[j] for j, xe in enumerate(torch.split(xd, counts))]
    y = combine_tokens(torch.cat(outs), w, handle)
    (y * p["cotangent"][lo:hi].to(dev)).sum().backward()
    return {
        "layout_ok": layout_ok,
        "y": y.detach().cpu(),
        "gx": x.grad.cpu(),
        "gw": w.grad.cpu(),
        "gw1": experts.w1.grad.cpu(),
        "gw2": experts.w2.grad.cpu(),
    }


@st.composite
def _cases(draw, world_size: int) -> dict:
    ep = draw(st.sampled_from([d for d in (1, 2, 4) if world_size % d == 0]))
    num_experts = ep * draw(st.integers(1, 3))
    k = draw(st.integers(1, 3))
    # A subset of experts is routable, so some experts (and whole EP ranks) receive no tokens.
    allowed = draw(st.lists(st.integers(0, num_experts - 1), min_size=1, max_size=num_experts, unique=True))
    return {
        "ep": ep,
        "E": num_experts,
        "k": k,
        "H": draw(st.integers(1, 5)),
        "I": draw(st.integers(1, 4)),
        "tokens": draw(st.lists(st.integers(0, 5), min_size=world_size, max_size=world_size)),
        "allowed": sorted(allowed),
        "distinct": draw(st.booleans()) and k <= len(allowed),
        "seed": draw(st.integers(0, 2**20)),
    }


@pytest.mark.parametrize("world_size, backend", WORLDS)
def test_dispatch_combine_matches_single_process(dist_pools, world_size, backend):
    pool = dist_pools.get(world_size, backend)

    @settings(max_examples=60)
    @given(case=_cases(world_size))
    def check(case):
        res = pool.run(_ep_step, case)
        ep = case["ep"]
        for g in range(world_size // ep):
            ranks = res[g * ep : (g + 1) * ep]
            assert all(r["layout_ok"] for r in ranks)
            want = _oracle(_problem(case, g))
            for key in ("y", "gx", "gw", "gw1", "gw2"):
                got = torch.cat([r[key] for r in ranks])  # tokens and experts are both rank-major
                torch.testing.assert_close(got, want[key], rtol=1e-10, atol=1e-10, msg=f"{key} (group {g})")

    check()


# The all-to-all and its adjoint -----------------------------------------------------------------------------
def _rows(seed: int, rank: int, n: int, hidden: int, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 16 + rank)
    return torch.randn(n, hidden, generator=gen, dtype=torch.float64).to(device)


def _all_to_all_adjoint(ctx, splits: list[list[int]], hidden: int, seed: int) -> dict:
    """``splits[s][d]``: rows rank s sends rank d. Returns local inner products and exactness checks."""
    me, n = ctx.rank, ctx.world_size
    input_splits, output_splits = splits[me], [splits[s][me] for s in range(n)]
    x = _rows(seed, me, sum(input_splits), hidden, ctx.device).requires_grad_()
    y = _rows(seed + 1, me, sum(output_splits), hidden, ctx.device)
    fx = all_to_all_rows(x, input_splits, output_splits, dist.group.WORLD)
    lhs = (fx * y).sum()
    lhs.backward()  # x.grad = f*(y): the objective is the sum over ranks of each rank's <f(x), y>
    rhs = (x.detach() * x.grad).sum()

    def block(tensor, sizes, i):
        start = sum(sizes[:i])
        return tensor[start : start + sizes[i]]

    # f(x) on me = block s->me of every source's x; f*(y) on me = block me->d of every destination's y.
    xs = [_rows(seed, s, sum(splits[s]), hidden, ctx.device) for s in range(n)]
    ys = [_rows(seed + 1, d, sum(splits[r][d] for r in range(n)), hidden, ctx.device) for d in range(n)]
    fwd = torch.cat([block(xs[s], splits[s], me) for s in range(n)])
    bwd = torch.cat([block(ys[d], [splits[r][d] for r in range(n)], me) for d in range(n)])
    return {
        "lhs": lhs.item(),
        "rhs": rhs.item(),
        "fwd_ok": torch.equal(fx, fwd),
        "bwd_ok": torch.equal(x.grad, bwd),
    }


@pytest.mark.parametrize("world_size, backend", WORLDS)
def test_all_to_all_is_its_own_adjoint_with_swapped_splits(dist_pools, world_size, backend):
    pool = dist_pools.get(world_size, backend)

    @settings(max_examples=40)
    @given(
        splits=st.lists(
            st.lists(st.integers(0, 4), min_size=world_size, max_size=world_size),
            min_size=world_size,
            max_size=world_size,
        ),
        hidden=st.integers(1, 4),
        seed=st.integers(0, 2**20),
    )
    def check(splits, hidden, seed):
        res = pool.run(_all_to_all_adjoint, splits, hidden, seed)
        assert all(r["fwd_ok"] and r["bwd_ok"] for r in res)
        lhs, rhs = sum(r["lhs"] for r in res), sum(r["rhs"] for r in res)
        assert abs(lhs - rhs) <= 1e-9 * max(1.0, abs(lhs))

    check()


def test_all_to_all_rejects_mismatched_splits():
    with pytest.raises(ValueError, match="x has 3 rows but input_splits sum to 2"):
        all_to_all_rows(torch.zeros(3, 2), [2], [2], None)


# fp32 accumulation ------------------------------------------------------------------------------------------
def test_combine_accumulates_in_fp32_single_rank():
    # bf16 has 8 significant bits: 1 + 2**-8 is a tie that rounds back to 1, so a bf16 running sum of
    # 1, 2**-8, 2**-8 stays at 1.0, while the fp32 sum 1 + 2**-7 is exactly representable in bf16.
    x = torch.zeros(1, 1, dtype=torch.bfloat16)
    _, counts, handle = dispatch_tokens(x, torch.tensor([[0, 1, 2]]), 3, None)
    expert_out = torch.tensor([[1.0], [2.0**-8], [2.0**-8]], dtype=torch.bfloat16)
    weights = torch.ones(1, 3)
    y = combine_tokens(expert_out, weights, handle)
    naive = expert_out[0] + expert_out[1] + expert_out[2]
    assert y.dtype == torch.bfloat16 and naive.item() == 1.0
    assert y.item() == 1.0 + 2.0**-7


def _bf16_step(ctx, ep: int, tokens: list[int], k: int, num_experts: int, hidden: int, seed: int) -> dict:
    """Dyadic bf16 data: fp32 products and sums are exact, so the fp32 path is the exact sum, rounded once."""
    group, ep_rank, group_index = _ep_group(ctx, ep)
    gen = torch.Generator().manual_seed(seed * 8 + group_index)
    mine = tokens[group_index * ep : (group_index + 1) * ep]
    total = sum(mine)
    x = torch.randint(-255, 256, (total, hidden), generator=gen).to(torch.bfloat16)
    ids = torch.randint(num_experts, (total, k), generator=gen)
    w = torch.randint(1, 16, (total, k), generator=gen).float() / 16
    lo = sum(mine[:ep_rank])
    hi = lo + mine[ep_rank]
    dev = ctx.device
    xd, counts, handle = dispatch_tokens(x[lo:hi].to(dev), ids[lo:hi].to(dev), num_experts, group)
    local = num_experts // ep
    # Expert e scales by 2**(e % 4): exact in bf16 and distinguishes experts.
    scales = [2.0 ** ((ep_rank * local + j) % 4) for j in range(local)]
    out = torch.cat([xe * s for xe, s in zip(torch.split(xd, counts), scales, strict=True)])
    y = combine_tokens(out, w[lo:hi].to(dev), handle).cpu()
    rows = x[lo:hi].double().unsqueeze(1) * (2.0 ** (ids[lo:hi] % 4)).double().unsqueeze(-1)
    exact = (rows * w[lo:hi].double().unsqueeze(-1)).sum(1)
    naive = torch.zeros_like(y)
    for j in range(k):  # what a bf16 running sum of bf16 products gives
        naive = naive + (rows[:, j].bfloat16() * w[lo:hi, j : j + 1].bfloat16())
    return {
        "dtype": str(y.dtype),
        "exact_ok": torch.equal(y, exact.bfloat16()),
        "naive_err": (naive.double() - exact).abs().sum().item(),
        "err": (y.double() - exact).abs().sum().item(),
    }


@pytest.mark.parametrize("world_size, backend", WORLDS)
def test_combine_accumulates_in_fp32(dist_pools, world_size, backend):
    pool = dist_pools.get(world_size, backend)
    ep = world_size
    tokens = [7, 0, 9, 5][:world_size]
    res = pool.run(_bf16_step, ep, tokens, 4, 2 * ep, 16, 7)
    assert all(r["dtype"] == "torch.bfloat16" and r["exact_ok"] for r in res)
    assert sum(r["err"] for r in res) < sum(r["naive_err"] for r in res)


# Errors -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "hidden, ids, num_experts, error, message",
    [
        (torch.zeros(4), torch.zeros(4, 1, dtype=torch.long), 2, ValueError, r"hidden must be \[T, H\]"),
        (torch.zeros(4, 2, dtype=torch.long), torch.zeros(4, 1, dtype=torch.long), 2, TypeError, "floating"),
        (torch.zeros(4, 2), torch.zeros(3, 1, dtype=torch.long), 2, ValueError, r"T = hidden.shape\[0\] = 4"),
        (torch.zeros(4, 2), torch.zeros(4, dtype=torch.long), 2, ValueError, r"expert_ids must be \[T, k\]"),
        (torch.zeros(4, 2), torch.zeros(4, 0, dtype=torch.long), 2, ValueError, "k = 0"),
        (
            torch.zeros(4, 2),
            torch.zeros(4, 1, dtype=torch.int32),
            2,
            TypeError,
            "must be int64, got torch.int32",
        ),
        (
            torch.zeros(4, 2),
            torch.zeros(4, 1, dtype=torch.long),
            0,
            ValueError,
            "num_experts must be a positive",
        ),
        (
            torch.zeros(4, 2),
            torch.tensor([[0], [1], [2], [-1]]),
            2,
            ValueError,
            r"outside \[0, 2\).*\{0: 2\}",
        ),
    ],
)
def test_dispatch_input_errors(hidden, ids, num_experts, error, message):
    with pytest.raises(error, match=message):
        dispatch_tokens(hidden, ids, num_experts, None)


def test_combine_input_errors():
    _, counts, handle = dispatch_tokens(torch.zeros(3, 2), torch.tensor([[0, 1], [1, 1], [0, 0]]), 2, None)
    assert counts == [3, 3]
    good_out, good_w = torch.zeros(6, 2), torch.zeros(3, 2)
    cases = [
        (
            (torch.zeros(5, 2), good_w, handle),
            ValueError,
            r"\[N, H\] with N = 6 dispatched rows, got shape \(5, 2\)",
        ),
        ((torch.zeros(6, 2, dtype=torch.long), good_w, handle), TypeError, "expert_out must be floating"),
        ((good_out, torch.zeros(2, 3), handle), ValueError, r"routing_weights must be \[T, k\] = \[3, 2\]"),
        (
            (good_out, torch.zeros(3, 2, dtype=torch.long), handle),
            TypeError,
            "routing_weights must be floating",
        ),
        ((good_out, good_w, "handle"), TypeError, "handle must be a DispatchHandle"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            combine_tokens(*args)


def _collective_error(ctx, variant: str):
    """Bad input on rank 1 only; every rank must raise the same error (none left hanging), then recover."""
    group = dist.group.WORLD
    ids = torch.zeros(3, 2, dtype=torch.long, device=ctx.device)
    hidden = torch.zeros(3, 4, device=ctx.device)
    num_experts = 2 * ctx.world_size
    if ctx.rank == 1:
        if variant == "ids":
            ids[2, 1] = num_experts
        elif variant == "hidden_size":
            hidden = torch.zeros(3, 5, device=ctx.device)
        elif variant == "dtype":
            hidden = hidden.double()
    if variant == "divisible":
        num_experts = 2 * ctx.world_size + 1
    try:
        dispatch_tokens(hidden, ids, num_experts, group)
        message = None
    except (ValueError, TypeError) as exc:
        message = f"{type(exc).__name__}: {exc}"
    # The group must still be usable: a healthy dispatch runs to the end on every rank.
    x = torch.ones(2, 4, device=ctx.device)
    _, counts, _ = dispatch_tokens(
        x, torch.zeros(2, 1, dtype=torch.long, device=ctx.device), ctx.world_size, group
    )
    return message, counts


@pytest.mark.parametrize("world_size, backend", backend_params(2))
@pytest.mark.parametrize(
    "variant, message",
    [
        ("ids", r"ValueError: .*outside \[0, 4\) on EP rank\(s\) \[1\] \(count per rank: \{1: 1\}\)"),
        ("hidden_size", r"ValueError: .*hidden size differs across EP ranks: \[4, 5\]"),
        ("dtype", "TypeError: .*hidden dtype differs across EP ranks"),
        ("divisible", "ValueError: .*num_experts=5 is not divisible by the EP group size 2"),
    ],
)
def test_bad_input_on_one_rank_raises_on_every_rank(dist_pools, world_size, backend, variant, message):
    res = dist_pools.get(world_size, backend).run(_collective_error, variant)
    for rank, (error, counts) in enumerate(res):
        assert error is not None, f"rank {rank} did not raise"
        assert re.search(message, error), error
        assert counts == ([4] if rank == 0 else [0])


# Host syncs (CUDA only: the sync debug mode reports synchronising CUDA calls) -------------------------------
def _count_syncs(ctx) -> dict:
    import linecache
    import warnings

    group = dist.group.WORLD
    num_experts, hidden = 4 * ctx.world_size, 8
    gen = torch.Generator().manual_seed(ctx.rank)
    x = torch.randn(6 + ctx.rank, hidden, generator=gen).to(ctx.device).requires_grad_()
    ids = torch.randint(num_experts, (x.shape[0], 2), generator=gen).to(ctx.device)
    w = torch.rand(x.shape[0], 2, generator=gen).to(ctx.device).requires_grad_()
    scale = torch.rand(num_experts // ctx.world_size, 1, 1, generator=gen).to(ctx.device).requires_grad_()
    torch.cuda.synchronize()
    counts = {}
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            xd, per_expert, handle = dispatch_tokens(x, ids, num_experts, group)
            counts["dispatch"] = [
                linecache.getline(c.filename, c.lineno)
                for c in caught
                if "synchronizing CUDA operation" in str(c.message)
            ]
            caught.clear()
            out = torch.cat([xe * s for xe, s in zip(torch.split(xd, per_expert), scale, strict=True)])
            y = combine_tokens(out, w, handle)
            y.square().sum().backward()
            counts["combine_and_backward"] = [
                linecache.getline(c.filename, c.lineno)
                for c in caught
                if "synchronizing CUDA operation" in str(c.message)
            ]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return counts


@pytest.mark.parametrize("world_size, backend", [p for p in backend_params(2, 4) if p.values[1] == "nccl"])
def test_exactly_one_host_sync(dist_pools, world_size, backend):
    res = dist_pools.get(world_size, backend).run(_count_syncs)
    for r in res:
        assert len(r["dispatch"]) == 1 and ".tolist()" in r["dispatch"][0], r
        assert r["combine_and_backward"] == [], r
