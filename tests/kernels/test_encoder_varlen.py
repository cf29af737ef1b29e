"""`encoder_varlen_attention` (packed ``[T, H, D]``, bidirectional) equals attention on each sequence alone,
forward and backward, on every backend that runs here; cross-attention (``Sk != Sq``) in the kernels.

The per-sequence oracle is written out here (softmax attention on one sequence), independent of the
kernels' own masks.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from veomni.kernels.attention import (
    ATTENTION_FUNCTIONS,
    available_attention_functions,
    encoder_varlen_attention,
)


def one_sequence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> torch.Tensor:
    """``[L, Hq, D]`` x ``[Lk, Hkv, D]`` -> ``[L, Hq, D]``: plain softmax attention, GQA by repetition."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if causal:
        keep = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def per_sequence(q, k, v, lengths: list[int], scale: float, causal: bool) -> torch.Tensor:
    offsets = [0, *itertools.accumulate(lengths)]
    parts = [one_sequence(q[a:b], k[a:b], v[a:b], scale, causal) for a, b in itertools.pairwise(offsets)]
    return torch.cat(parts)


def _grads(out: torch.Tensor, probe: torch.Tensor, leaves) -> list[torch.Tensor]:
    return list(torch.autograd.grad((out * probe).sum(), leaves))


CPU_BACKENDS = ["eager", "sdpa"]
FP32 = {"rtol": 1e-5, "atol": 1e-5}  # eager computes in fp32


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=5),
    heads=st.sampled_from([(2, 2), (4, 2), (4, 1), (3, 3)]),
    dim=st.sampled_from([4, 8]),
    scale=st.sampled_from([None, 0.25]),
    causal=st.booleans(),
    int64=st.booleans(),
    seed=st.integers(0, 10**6),
)
def test_encoder_varlen_equals_each_sequence_alone(backend, lengths, heads, dim, scale, causal, int64, seed):
    hq, hkv = heads
    total = sum(lengths)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(total, hq, dim, generator=gen, dtype=torch.float32).requires_grad_()
    k = torch.randn(total, hkv, dim, generator=gen, dtype=torch.float32).requires_grad_()
    v = torch.randn(total, hkv, dim, generator=gen, dtype=torch.float32).requires_grad_()
    probe = torch.randn(total, hq, dim, generator=gen, dtype=torch.float32)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64 if int64 else torch.int32)

    out = encoder_varlen_attention(q, k, v, cu, max(lengths), causal=causal, scale=scale, backend=backend)
    ref = per_sequence(q, k, v, lengths, dim**-0.5 if scale is None else scale, causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, **FP32)
    for got, want in zip(_grads(out, probe, (q, k, v)), _grads(ref, probe, (q, k, v)), strict=True):
        torch.testing.assert_close(got, want, **FP32)


def test_encoder_varlen_takes_an_attention_function_too():
    q = torch.randn(7, 2, 4)
    cu = torch.tensor([0, 3, 7])
    by_name = encoder_varlen_attention(q, q, q, cu, backend="eager")
    by_fn = encoder_varlen_attention(q, q, q, cu, backend=ATTENTION_FUNCTIONS["eager"])
    torch.testing.assert_close(by_fn, by_name)


def test_encoder_varlen_bad_inputs_raise():
    q = torch.randn(6, 2, 4)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"packed \[T, H, D\] tensors, got q \(1, 6, 2, 4\)"):
        encoder_varlen_attention(q[None], q[None], q[None], cu)
    with pytest.raises(ValueError, match="the same T tokens"):
        encoder_varlen_attention(q, q[:5], q[:5], cu)
    with pytest.raises(ValueError, match="1-D integer tensor"):
        encoder_varlen_attention(q, q, q, cu.float())
    with pytest.raises(ValueError, match="1-D integer tensor"):
        encoder_varlen_attention(q, q, q, torch.tensor([6]))
    with pytest.raises(TypeError, match="max_seqlen must be a python int or None, got Tensor"):
        encoder_varlen_attention(q, q, q, cu, torch.tensor(4))
    with pytest.raises(ValueError, match="from 0 to S=6 without decreasing"):
        encoder_varlen_attention(q, q, q, torch.tensor([0, 4, 3, 6], dtype=torch.int32), backend="eager")
    with pytest.raises(KeyError, match="no 'nope' implementation; registered backends"):
        encoder_varlen_attention(q, q, q, cu, backend="nope")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without a GPU")
def test_encoder_varlen_gpu_backend_on_cpu_names_the_problem():
    q = torch.randn(6, 2, 4)
    with pytest.raises(RuntimeError, match="'varlen' is unavailable here"):
        encoder_varlen_attention(q, q, q, torch.tensor([0, 6]), backend="varlen")


# ---------------------------------------------------------------- cross-attention (Sk != Sq) in the kernels


@settings(max_examples=30, deadline=None)
@given(
    batch=st.integers(1, 2),
    sq=st.integers(1, 9),
    sk=st.integers(1, 9),
    heads=st.sampled_from([(2, 2), (4, 2), (4, 1)]),
    seed=st.integers(0, 10**6),
)
def test_kernels_cross_attention_matches_oracle(batch, sq, sk, heads, seed):
    hq, hkv = heads
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, sq, hq, 4, generator=gen, dtype=torch.float32).requires_grad_()
    k = torch.randn(batch, sk, hkv, 4, generator=gen, dtype=torch.float32).requires_grad_()
    v = torch.randn(batch, sk, hkv, 4, generator=gen, dtype=torch.float32).requires_grad_()
    probe = torch.randn(batch, sq, hq, 4, generator=gen, dtype=torch.float32)
    ref = torch.stack([one_sequence(q[b], k[b], v[b], 0.5, causal=False) for b in range(batch)])
    want = _grads(ref, probe, (q, k, v))
    for name in CPU_BACKENDS:
        out = ATTENTION_FUNCTIONS[name](q, k, v, causal=False, scale=0.5)
        torch.testing.assert_close(out, ref, **FP32)
        for got, exp in zip(_grads(out, probe, (q, k, v)), want, strict=True):
            torch.testing.assert_close(got, exp, **FP32)


@pytest.mark.parametrize("name", sorted(ATTENTION_FUNCTIONS))
def test_kernels_refuse_causal_or_packed_cross_attention(name):
    q, k = torch.randn(1, 5, 2, 4), torch.randn(1, 7, 2, 4)
    with pytest.raises(ValueError, match=r"keys \(7\) and queries \(5\) differ .*causal=True"):
        ATTENTION_FUNCTIONS[name](q, k, k, causal=True)
    with pytest.raises(ValueError, match="non-causal and unpacked"):
        ATTENTION_FUNCTIONS[name](q, k, k, causal=False, cu_seqlens=torch.tensor([0, 5], dtype=torch.int32))


# ---------------------------------------------------------------- GPU backends (bf16)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["sdpa", "varlen", "flash_attn_2", "flash_attn_3", "flash_attn_4"])
def test_gpu_encoder_varlen_matches_oracle_bf16(backend):
    status = available_attention_functions()[backend]
    if status != "ok":
        pytest.skip(f"{backend}: {status}")
    lengths = [64, 16, 100, 4]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), 4, 64, generator=gen).cuda() for _ in range(3))
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    low = [t.bfloat16() for t in (q, k, v)]
    out = encoder_varlen_attention(*low, cu, max(lengths), backend=backend)
    ref = per_sequence(*(t.float() for t in low), lengths, 64**-0.5, causal=False)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "backend", ["sdpa", "flex", "varlen", "flash_attn_2", "flash_attn_3", "flash_attn_4"]
)
def test_gpu_cross_attention_matches_oracle_bf16(backend):
    status = available_attention_functions()[backend]
    if status != "ok":
        pytest.skip(f"{backend}: {status}")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 96, 4, 64, generator=gen).cuda().bfloat16()
    k, v = (torch.randn(2, 40, 2, 64, generator=gen).cuda().bfloat16() for _ in range(2))
    out = ATTENTION_FUNCTIONS[backend](q, k, v, causal=False)
    ref = torch.stack(
        [one_sequence(q[b].float(), k[b].float(), v[b].float(), 64**-0.5, False) for b in range(2)]
    )
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
