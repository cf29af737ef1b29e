"""Cross-attention under SP (`sp_cross_attention`): sharded queries, replicated keys/values, no collective.

SP=2 on real gloo ranks equals one process: the output of every query shard and the gradients of the
queries and (summed over ranks) of the replicated keys/values. Sequence lengths that P does not divide pad the
query shards; the keys' length is unrelated to the queries'.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_harness import backend_params
from hypothesis import given, settings
from hypothesis import strategies as st

from veomni.core.sp import pad_to_multiple, slice_sequence, sp_cross_attention

TIGHT = {"rtol": 1e-9, "atol": 1e-10}


def cross_bshd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False) -> torch.Tensor:
    """``[B, Sq, Hq, D]`` queries over ``[B, Sk, Hkv, D(v)]`` keys/values, all keys visible."""
    assert not causal
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def cross_bhsd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """HF layout ``[B, H, S, D]`` in and out."""
    return cross_bshd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def _parity(ctx, case: dict) -> None:
    from veomni.core.parallel_state import ParallelDims, build_parallel_state

    group = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type).sp_group
    gen = torch.Generator().manual_seed(case["seed"])
    b, sq, sk, hq, hkv, d, dv = (case[n] for n in ("b", "sq", "sk", "hq", "hkv", "d", "dv"))

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(ctx.device).requires_grad_()

    q, k, v = rand(b, sq, hq, d), rand(b, sk, hkv, d), rand(b, sk, hkv, dv)
    probe = torch.randn(b, sq, hq, dv, generator=gen, dtype=torch.float64).to(ctx.device)
    ref = cross_bshd(q, k, v)
    (ref * probe).sum().backward()
    ref_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None

    # Only the queries are sharded; k and v are the same full tensors on every rank.
    q_local = slice_sequence(q, 1, group)
    if case["layout"] == "BHSD":
        out = sp_cross_attention(
            q_local.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), cross_bhsd, seq_dim=2, head_dim=1
        ).transpose(1, 2)
    else:
        out = sp_cross_attention(q_local, k, v, cross_bshd, seq_dim=1, head_dim=2, causal=False)
    local_ref = slice_sequence(pad_to_multiple(ref.detach(), 1, ctx.world_size), 1, group)
    keep = slice_sequence(pad_to_multiple(torch.ones(sq, dtype=torch.bool, device=ctx.device), 0, ctx.world_size), 0, group)
    torch.testing.assert_close(out[:, keep], local_ref[:, keep], **TIGHT)
    # Padded query rows are dropped by the caller: they get no gradient signal.
    local_probe = slice_sequence(pad_to_multiple(probe, 1, ctx.world_size), 1, group)
    (out * local_probe * keep[None, :, None, None]).sum().backward()
    for t, want in zip((q, k, v), ref_grads, strict=True):
        total = t.grad.clone()
        dist.all_reduce(total, group=group)
        torch.testing.assert_close(total, want, **TIGHT)


@st.composite
def cross_cases(draw, world_size: int):
    hkv = draw(st.sampled_from([1, 2, 3]))
    return {
        "b": draw(st.integers(1, 2)),
        "sq": draw(st.integers(1, 11)),
        "sk": draw(st.integers(1, 9)),
        # No head-count constraint from P: nothing is exchanged.
        "hq": hkv * draw(st.sampled_from([1, 2])),
        "hkv": hkv,
        "d": draw(st.integers(1, 4)),
        "dv": draw(st.integers(1, 4)),
        "layout": draw(st.sampled_from(["BSHD", "BHSD"])),
        "seed": draw(st.integers(0, 10**6)),
    }


@pytest.mark.parametrize("world_size, backend", backend_params(1, 2))
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_cross_attention_sp_matches_single_process(dist_pools, world_size, backend, data):
    case = data.draw(cross_cases(world_size))
    if case["layout"] == "BHSD":
        case["dv"] = case["d"]
    dist_pools.get(world_size, backend).run(_parity, case)


def test_cross_attention_rejects_bad_layouts():
    q, k = torch.randn(2, 4, 4, 8), torch.randn(2, 6, 2, 8)
    with pytest.raises(ValueError, match="must be non-causal"):
        sp_cross_attention(q, k, k, cross_bshd, seq_dim=1, head_dim=2, causal=True)
    with pytest.raises(ValueError, match=r"k \(1, 6, 2, 8\) must match q \(2, 4, 4, 8\) outside"):
        sp_cross_attention(q, k[:1], k[:1], cross_bshd, seq_dim=1, head_dim=2)
    with pytest.raises(ValueError, match="equal lengths and heads"):
        sp_cross_attention(q, k, k[:, :5], cross_bshd, seq_dim=1, head_dim=2)
    with pytest.raises(ValueError, match=r"query heads \(4\) must be a multiple of KV heads \(3\)"):
        sp_cross_attention(
            q,
            k[:, :, :1].expand(2, 6, 3, 8),
            k[:, :, :1].expand(2, 6, 3, 8),
            cross_bshd,
            seq_dim=1,
            head_dim=2,
        )
    with pytest.raises(ValueError, match="same rank"):
        sp_cross_attention(q, k[0], k[0], cross_bshd, seq_dim=1, head_dim=2)
