"""Ulysses attention equals single-process attention in output and every gradient.

Covers MHA, GQA with H_kv % P == 0 and with H_kv < P (repeat before the exchange), HF's [B, H, S, D] layout
with SDPA, sequence lengths not divisible by P, and packed variable-length sequences with full-sequence
cu_seqlens.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from dist_harness import backend_params
from hypothesis import given, settings
from hypothesis import strategies as st

from veomni.core.sp import kv_repeats_for_sp, slice_sequence, ulysses_attention


def eager_attention(q, k, v, *, causal: bool = True, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Reference attention on ``[B, S, H, D]`` with GQA (consecutive query heads share a KV head) and an
    optional packed layout: ``cu_seqlens`` [n+1] marks sequence boundaries, attention stays inside each."""
    b, s, hq, d = q.shape
    group = hq // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / d**0.5
    allowed = torch.ones(s, s, dtype=torch.bool, device=q.device)
    if causal:
        allowed = torch.tril(allowed)
    if cu_seqlens is not None:
        seg = torch.zeros(s, dtype=torch.long, device=q.device)
        for start in cu_seqlens[1:-1].tolist():
            seg[start:] += 1
        allowed = allowed & (seg[:, None] == seg[None, :])
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def sdpa_bhsd(q, k, v):
    """HF-style attention: inputs ``[B, H, S, D]``, output transposed to ``[B, S, H, D]``."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


def _parity(ctx, case: dict):
    from veomni.core.parallel_state import ParallelDims, build_parallel_state

    group = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type).sp_group
    b, s, hq, hkv, d, dv = case["b"], case["s"], case["hq"], case["hkv"], case["d"], case["dv"]
    gen = torch.Generator().manual_seed(case["seed"])
    bhsd = case["layout"] == "BHSD"

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(ctx.device).requires_grad_()

    q, k, v = rand(b, s, hq, d), rand(b, s, hkv, d), rand(b, s, hkv, dv)
    probe = torch.randn(b, s, hq, dv, generator=gen, dtype=torch.float64).to(ctx.device)
    kwargs = {}
    if case["cu_seqlens"] is not None:
        kwargs["cu_seqlens"] = torch.tensor(case["cu_seqlens"], device=ctx.device)

    # Oracle: one process, full sequence, all heads.
    if bhsd:
        ref = sdpa_bhsd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    else:
        ref = eager_attention(q, k, v, **kwargs)
    (ref * probe).sum().backward()
    ref_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None

    # Ulysses: each rank slices its shard of the (identical) full tensors.
    if bhsd:
        shards = [slice_sequence(t.transpose(1, 2), 2, group) for t in (q, k, v)]
        out = ulysses_attention(
            *shards, sdpa_bhsd, group, seq_dim=2, head_dim=1, unpadded_len=s, out_seq_dim=1, out_head_dim=2
        )
    else:
        shards = [slice_sequence(t, 1, group) for t in (q, k, v)]
        out = ulysses_attention(
            *shards, eager_attention, group, seq_dim=1, head_dim=2, unpadded_len=s, **kwargs
        )
    local_ref = slice_sequence(ref.detach(), 1, group)
    torch.testing.assert_close(out, local_ref, rtol=1e-9, atol=1e-10)
    (out * slice_sequence(probe, 1, group)).sum().backward()
    # Each rank's grads land only in its slice of the full leaves; the sum over ranks is the full gradient.
    for t, ref_grad in zip((q, k, v), ref_grads, strict=True):
        total = t.grad.clone()
        torch.distributed.all_reduce(total, group=group)
        torch.testing.assert_close(total, ref_grad, rtol=1e-9, atol=1e-10)


@st.composite
def attention_cases(draw, world_size: int):
    hkv_choices = [h for h in (1, 2, 4, 8) if h % world_size == 0 or world_size % h == 0]
    hkv = draw(st.sampled_from(hkv_choices))
    hq = math.lcm(hkv, world_size) * draw(st.sampled_from([1, 2]))
    s = draw(st.integers(1, 12))
    cu_seqlens = None
    layout = draw(st.sampled_from(["BSHD", "BHSD"]))
    if layout == "BSHD" and draw(st.booleans()):
        cuts = sorted(draw(st.sets(st.integers(1, max(1, s - 1)), max_size=3)) - {s})
        cu_seqlens = [0, *cuts, s]
    return {
        "b": draw(st.integers(1, 2)) if cu_seqlens is None else 1,
        "s": s,
        "hq": hq,
        "hkv": hkv,
        "d": draw(st.integers(1, 4)),
        "dv": draw(st.integers(1, 4)) if layout == "BSHD" else None,
        "layout": layout,
        "cu_seqlens": cu_seqlens,
        "seed": draw(st.integers(0, 10**6)),
    }


@pytest.mark.parametrize("world_size, backend", backend_params(1, 2, 4))
@settings(max_examples=40)
@given(data=st.data())
def test_ulysses_attention_matches_single_process(dist_pools, world_size, backend, data):
    case = data.draw(attention_cases(world_size))
    if case["dv"] is None:
        case["dv"] = case["d"]
    assert case["hq"] % world_size == 0 and case["hq"] % case["hkv"] == 0
    dist_pools.get(world_size, backend).run(_parity, case)


@pytest.mark.parametrize("world_size, backend", backend_params(4))
def test_gqa_single_kv_head_over_four_ranks(dist_pools, world_size, backend):
    case = {
        "b": 2,
        "s": 10,
        "hq": 8,
        "hkv": 1,
        "d": 3,
        "dv": 3,
        "layout": "BSHD",
        "cu_seqlens": None,
        "seed": 7,
    }
    dist_pools.get(world_size, backend).run(_parity, case)
    case.update(hkv=2, cu_seqlens=[0, 3, 9, 10], b=1)
    dist_pools.get(world_size, backend).run(_parity, case)


def test_kv_repeats_rules():
    assert kv_repeats_for_sp(8, 8, 4) == 1
    assert kv_repeats_for_sp(8, 2, 4) == 2
    assert kv_repeats_for_sp(8, 1, 4) == 4
    with pytest.raises(ValueError, match="query heads divisible by the SP size: H_q=6, P=4"):
        kv_repeats_for_sp(6, 2, 4)
    with pytest.raises(ValueError, match="H_kv % P == 0 or P % H_kv == 0 .*H_kv=3, P=4"):
        kv_repeats_for_sp(12, 3, 4)
    with pytest.raises(ValueError, match="must be a multiple of KV heads"):
        kv_repeats_for_sp(8, 3, 2)


def _padded_past_a_multiple_of_p(ctx) -> list[tuple]:
    from veomni.core.parallel_dims import ParallelDims
    from veomni.core.parallel_state import build_parallel_state
    from veomni.core.sp import async_ulysses_attention, pad_and_slice

    group = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type).sp_group
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(1, 5, 2 * ctx.world_size, 4, generator=gen) for _ in range(3)]

    def attn(q, k, v):
        return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)

    want = attn(*full)
    # Vision-style slicing pads to a multiple of P x 4 (merge groups never straddle ranks): 5 -> 8 rows.
    q, k, v = (pad_and_slice(t, 1, group, pad_scale=4) for t in full)
    mine = slice(ctx.rank * q.shape[1], (ctx.rank + 1) * q.shape[1])
    sync = ulysses_attention(q, k, v, attn, group, seq_dim=1, head_dim=2, unpadded_len=5)

    def project(x):
        yield from zip("qkv", (q, k, v), strict=True)

    overlapped = async_ulysses_attention(
        q, project, attn, group, seq_dim=1, head_dim=2, query_heads=q.shape[2], unpadded_len=5
    )
    expected = torch.cat([want, torch.zeros(1, 3, *want.shape[2:])], dim=1)[:, mine]
    return [
        (tuple(q.shape), tuple(out.shape), float((out - expected).abs().max())) for out in (sync, overlapped)
    ]


@pytest.mark.parametrize("world_size", [1, 2])
def test_output_covers_the_whole_shard_when_padding_exceeds_a_multiple_of_p(dist_pools, world_size):
    # The output is the input shard's length again, padding rows (zeros) included, not cut to the next multiple
    # of P above the true length.
    for results in dist_pools.get(world_size).run(_padded_past_a_multiple_of_p):
        for shard, out, err in results:
            assert out == shard and err < 1e-6, (shard, out, err)
