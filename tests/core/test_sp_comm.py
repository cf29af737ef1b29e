"""Ulysses SP primitives on real process groups: round trips, adjoints, padding and documented errors.

Every rank regenerates the same full tensors from the example's seed, so each rank can check its own result
against a single-process oracle without shipping data around.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import backend_params
from hypothesis import given, settings
from hypothesis import strategies as st

from veomni.core.sp import (
    all_reduce_sum,
    all_to_all,
    gather_sequence,
    heads_to_seq,
    pad_and_slice,
    pad_to_multiple,
    qkv_seq_to_heads,
    seq_to_heads,
    slice_sequence,
    unpad,
)


def _rand(seed: int, *shape: int, device="cpu", dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).to(device)


# Layouts: (full shape builder, seq_dim, head_dim)
LAYOUTS = {
    "BSHD": (lambda b, s, h, d: (b, s, h, d), 1, 2),
    "SHD": (lambda b, s, h, d: (s, h, d), 0, 1),
    "BHSD": (lambda b, s, h, d: (b, h, s, d), 2, 1),
}


def _round_trip(ctx, layout: str, b: int, s: int, heads_per_rank: int, d: int, seed: int):
    from veomni.core.parallel_state import ParallelDims, build_parallel_state

    group = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type).sp_group
    shape_fn, seq_dim, head_dim = LAYOUTS[layout]
    h = heads_per_rank * ctx.world_size
    full = _rand(seed, *shape_fn(b, s, h, d), device=ctx.device)
    local = slice_sequence(full, seq_dim, group)
    assert local.shape[seq_dim] == -(-s // ctx.world_size)
    heads = seq_to_heads(local, group, seq_dim=seq_dim, head_dim=head_dim, unpadded_len=s)
    mine = full.narrow(head_dim, ctx.rank * heads_per_rank, heads_per_rank)
    torch.testing.assert_close(heads, mine, rtol=0, atol=0)
    back = heads_to_seq(heads, group, seq_dim=seq_dim, head_dim=head_dim)
    torch.testing.assert_close(back, local, rtol=0, atol=0)


@pytest.mark.parametrize("world_size, backend", backend_params(1, 2, 4))
@settings(max_examples=60)
@given(
    layout=st.sampled_from(sorted(LAYOUTS)),
    b=st.integers(1, 2),
    s=st.integers(1, 13),
    heads_per_rank=st.integers(1, 3),
    d=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_seq_heads_round_trip_any_length(
    dist_pools, world_size, backend, layout, b, s, heads_per_rank, d, seed
):
    dist_pools.get(world_size, backend).run(_round_trip, layout, b, s, heads_per_rank, d, seed)


def _qkv_round_trip(ctx, s: int, heads_per_rank: int, d: int, seed: int):
    from veomni.core.parallel_state import ParallelDims, build_parallel_state

    group = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type).sp_group
    h = heads_per_rank * ctx.world_size
    q, k, v = (_rand(seed + i, 2, s, h, d, device=ctx.device) for i in range(3))
    fused = torch.cat([q.flatten(-2), k.flatten(-2), v.flatten(-2)], dim=-1)  # [B, S, 3*H*D]
    out = qkv_seq_to_heads(slice_sequence(fused, 1, group), group, seq_dim=1, num_heads=h, unpadded_len=s)
    out = out.unflatten(-1, (3, heads_per_rank, d))
    for i, t in enumerate((q, k, v)):
        torch.testing.assert_close(
            out[:, :, i], t[:, :, ctx.rank * heads_per_rank : (ctx.rank + 1) * heads_per_rank]
        )


@pytest.mark.parametrize("world_size, backend", backend_params(2, 4))
@settings(max_examples=25)
@given(s=st.integers(1, 11), heads_per_rank=st.integers(1, 2), d=st.integers(1, 3), seed=st.integers(0, 999))
def test_fused_qkv_matches_separate(dist_pools, world_size, backend, s, heads_per_rank, d, seed):
    dist_pools.get(world_size, backend).run(_qkv_round_trip, s, heads_per_rank, d, seed)


# --- adjoints: sum_r <f(x)_r, y_r> == sum_r <x_r, f*(y)_r>, with f* computed by autograd -----------------------
def _adjoint(ctx, op: str, n: int, seed: int):
    from veomni.core.parallel_state import ParallelDims, build_parallel_state

    group = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type).sp_group
    p = ctx.world_size
    gen = torch.Generator().manual_seed(seed * 97 + ctx.rank)
    if op == "gather_sequence":  # shards of different lengths, some empty
        x = torch.randn(
            int(torch.randint(0, n + 1, (1,), generator=gen)), 3, generator=gen, dtype=torch.float64
        )
    elif op in ("all_to_all", "seq_to_heads"):
        x = torch.randn(2, n, 2 * p, 3, generator=gen, dtype=torch.float64)
    elif op == "heads_to_seq":
        x = torch.randn(2, n, 2, 3, generator=gen, dtype=torch.float64)  # any full length
    elif op == "qkv_seq_to_heads":
        x = torch.randn(n, 3 * p * 2, generator=gen, dtype=torch.float64)
    else:  # slice_sequence / pad_and_slice / all_reduce_sum
        x = torch.randn(n, 2, generator=gen, dtype=torch.float64)
    x = x.to(ctx.device).requires_grad_()
    if op == "all_to_all":
        y = all_to_all(x, group, scatter_dim=2, gather_dim=1)
    elif op == "seq_to_heads":
        y = seq_to_heads(x, group, seq_dim=1, head_dim=2, unpadded_len=max(n * p - 1, 0))
    elif op == "heads_to_seq":
        y = heads_to_seq(x, group, seq_dim=1, head_dim=2)
    elif op == "qkv_seq_to_heads":
        y = qkv_seq_to_heads(x, group, seq_dim=0, num_heads=p)
    elif op == "gather_sequence":
        y = gather_sequence(x, group, dim=0)
    elif op == "slice_sequence":
        y = slice_sequence(x, 0, group)
    elif op == "pad_and_slice":
        y = pad_and_slice(x, 0, group, pad_value=0, pad_scale=3)
    else:
        y = all_reduce_sum(x, group)
    probe = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(ctx.device)
    forward_term = (y * probe).sum()
    forward_term.backward()
    return float(forward_term), float((x.detach() * x.grad).sum())


OPS = [
    "all_to_all", "seq_to_heads", "heads_to_seq", "qkv_seq_to_heads", "gather_sequence",
    "slice_sequence", "pad_and_slice", "all_reduce_sum",
]  # fmt: skip


@pytest.mark.parametrize("world_size, backend", backend_params(1, 2, 4))
@settings(max_examples=60)
@given(op=st.sampled_from(OPS), n=st.integers(1, 6), seed=st.integers(0, 10**6))
def test_collectives_are_adjoint_to_their_backward(dist_pools, world_size, backend, op, n, seed):
    results = dist_pools.get(world_size, backend).run(_adjoint, op, n, seed)
    lhs = sum(r[0] for r in results)
    rhs = sum(r[1] for r in results)
    assert lhs == pytest.approx(rhs, rel=1e-10, abs=1e-10)


# --- gather: values, variable lengths, dtype guard --------------------------------------------------------------
def _gather_values(ctx, lengths: list[int], seed: int):
    from veomni.core.parallel_state import ParallelDims, build_parallel_state

    group = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type).sp_group
    shards = [_rand(seed + r, 2, lengths[r], 3, device=ctx.device) for r in range(ctx.world_size)]
    out = gather_sequence(shards[ctx.rank], group, dim=1)
    torch.testing.assert_close(out, torch.cat(shards, dim=1), rtol=0, atol=0)
    if len(set(lengths)) == 1:
        same = gather_sequence(shards[ctx.rank], group, dim=1, equal_sizes=True)
        torch.testing.assert_close(same, out, rtol=0, atol=0)


@pytest.mark.parametrize("world_size, backend", backend_params(2, 4))
@settings(max_examples=30)
@given(data=st.data(), seed=st.integers(0, 999))
def test_gather_variable_lengths(dist_pools, world_size, backend, data, seed):
    lengths = data.draw(st.lists(st.integers(0, 5), min_size=world_size, max_size=world_size))
    dist_pools.get(world_size, backend).run(_gather_values, lengths, seed)


def _gather_mismatch(ctx, kind: str):
    from veomni.core.parallel_state import ParallelDims, build_parallel_state

    group = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type).sp_group
    dtype = torch.float64 if (kind == "dtype" and ctx.rank == 1) else torch.float32
    width = 4 if (kind == "shape" and ctx.rank == 1) else 3
    try:
        gather_sequence(torch.zeros(2, width, dtype=dtype, device=ctx.device), group, dim=0)
    except (TypeError, ValueError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


@pytest.mark.parametrize("world_size, backend", backend_params(2))
def test_gather_refuses_mismatched_dtype_and_shape(dist_pools, world_size, backend):
    pool = dist_pools.get(world_size, backend)
    msgs = pool.run(_gather_mismatch, "dtype")
    assert "TypeError: gather_sequence: dtype mismatch" in msgs[0] and "torch.float64" in msgs[0]
    assert "torch.float32" in msgs[1]
    msgs = pool.run(_gather_mismatch, "shape")
    assert all("shapes must agree outside dim 0" in m for m in msgs)


# --- padding and slicing never drop tokens ----------------------------------------------------------------------
def _slices_cover(ctx, s: int, scale: int):
    from veomni.core.parallel_state import ParallelDims, build_parallel_state

    group = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type).sp_group
    full = torch.arange(1, s + 1, dtype=torch.float64, device=ctx.device)
    mine = pad_and_slice(full, 0, group, pad_value=0, pad_scale=scale)
    assert mine.numel() % scale == 0
    return mine.cpu()


@pytest.mark.parametrize("world_size, backend", backend_params(1, 2, 4))
@settings(max_examples=30)
@given(s=st.integers(0, 40), scale=st.sampled_from([1, 2, 4]))
def test_pad_and_slice_keeps_every_token(dist_pools, world_size, backend, s, scale):
    chunks = dist_pools.get(world_size, backend).run(_slices_cover, s, scale)
    assert len({c.numel() for c in chunks}) == 1
    joined = torch.cat(chunks)
    assert joined.numel() % (world_size * scale) == 0 and joined.numel() - s < world_size * scale
    torch.testing.assert_close(joined[:s], torch.arange(1, s + 1, dtype=torch.float64))
    assert bool((joined[s:] == 0).all())


def test_pad_unpad_local():
    x = torch.arange(10.0).view(2, 5)
    padded = pad_to_multiple(x, 1, 4, value=-1)
    assert padded.shape == (2, 8) and bool((padded[:, 5:] == -1).all())
    torch.testing.assert_close(unpad(padded, 1, 5), x)
    assert pad_to_multiple(x, 1, 5) is x
    with pytest.raises(ValueError, match="cannot unpad dim 1"):
        unpad(x, 1, 6)
    with pytest.raises(ValueError, match="out of range"):
        pad_to_multiple(x, 2, 2)


def _bad_heads(ctx):
    from veomni.core.parallel_state import ParallelDims, build_parallel_state

    group = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type).sp_group
    errors = []
    for call in (
        lambda: seq_to_heads(torch.zeros(1, 2, 3, 4), group, seq_dim=1, head_dim=2),
        lambda: qkv_seq_to_heads(torch.zeros(1, 2, 10), group, seq_dim=1, num_heads=2),
        lambda: all_to_all(torch.zeros(3, 2), group, scatter_dim=0, gather_dim=0),
        lambda: all_to_all(torch.zeros(3, 2), group, scatter_dim=0, gather_dim=1),
    ):
        try:
            call()
            errors.append("no error")
        except ValueError as err:
            errors.append(str(err))
    return errors


def test_bad_shapes_raise_documented_errors(dist_pools):
    errors = dist_pools.get(2).run(_bad_heads)[0]
    assert "number of heads divisible by the SP size 2, got 3" in errors[0]
    assert "fused QKV last dim 10 is not 3 * num_heads(2) * head_dim" in errors[1]
    assert "scatter_dim and gather_dim must differ" in errors[2]
    assert "its size must be divisible by 2" in errors[3]
