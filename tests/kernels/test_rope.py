"""RoPE: Triton kernel vs the eager oracle (forward and backward), the eager oracle vs HF, and layouts.

On CPU the Triton kernel runs through Triton's interpreter (see tests/conftest.py), so shapes stay tiny.
Tolerances follow the documented dtype behaviour: the kernel computes in fp32 and rounds once, the eager
oracle computes in the input dtype. fp32: ~1e-5. bf16: 1e-2 against eager, and at most one bf16 rounding
(half an ulp on GPU, a full one in the interpreter, which truncates) away from an fp64 evaluation of the
same formula on the same inputs. Also: eager == HF bitwise, RoPE on sequence shards + Ulysses == one process.
"""

from __future__ import annotations

import os

import pytest
import torch
from dist_harness import backend_params
from hypothesis import given, settings
from hypothesis import strategies as st

from veomni.kernels.rope import apply_rope_eager, apply_rope_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter converts fp32 -> bf16 by truncation, GPUs round to nearest: one ulp vs half an ulp.
BF16_ONE_ROUNDING = 2**-7 if os.environ.get("TRITON_INTERPRET") == "1" else 2**-8


def packed_positions(seg_lens: list[int], offset: int) -> torch.Tensor:
    """Position ids of a packed row: every segment restarts at ``offset``."""
    return torch.cat([torch.arange(n) + offset for n in seg_lens])


def cos_sin(pos: torch.Tensor, rotary_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """HF-style tables gathered at ``pos`` (``[..., S]``): duplicated halves, ``[..., S, rotary_dim]``."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    freqs = pos[..., None].double() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).to(DEV), emb.sin().to(dtype).to(DEV)


def make_qk(b, hq, hkv, s, d, dtype, layout, gen):
    """q ``[B, Hq, S, D]``, k ``[B, Hkv, S, D]`` as leaves in one of three memory layouts."""
    if layout == "bhsd":  # contiguous
        q, k = torch.randn(b, hq, s, d, generator=gen), torch.randn(b, hkv, s, d, generator=gen)
    elif layout == "bshd":  # HF: projection output viewed [B, S, H, D], then transpose(1, 2)
        q = torch.randn(b, s, hq, d, generator=gen).transpose(1, 2)
        k = torch.randn(b, s, hkv, d, generator=gen).transpose(1, 2)
    else:  # slices of one fused qkv buffer: not dense, odd strides
        qkv = torch.randn(b, s, hq + 2 * hkv, d + 3, generator=gen)
        q = qkv[:, :, :hq, 1 : d + 1].transpose(1, 2)
        k = qkv[:, :, hq : hq + hkv, 1 : d + 1].transpose(1, 2)
    return (q.to(DEV, dtype).detach().requires_grad_(), k.to(DEV, dtype).detach().requires_grad_())


def fwd_bwd(fn, q, k, cos, sin, gq, gk, rotary_dim):
    qo, ko = fn(q, k, cos, sin, rotary_dim=rotary_dim)
    dq, dk = torch.autograd.grad((qo, ko), (q, k), (gq, gk))
    return qo, ko, dq, dk


def reference64(q, k, cos, sin, gq, gk, rotary_dim):
    """The same formula in fp64 on the same (already rounded) inputs: the kernel's ideal result."""
    up = [t.detach().double().requires_grad_(t.requires_grad) for t in (q, k)]
    return fwd_bwd(apply_rope_eager, *up, cos.double(), sin.double(), gq.double(), gk.double(), rotary_dim)


@st.composite
def rope_cases(draw):
    b = draw(st.integers(1, 2))
    seg_lens = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    hkv = draw(st.integers(1, 2))
    half = draw(st.integers(1, 7))
    return {
        "b": b,
        "seg_lens": seg_lens,
        "offset": draw(st.integers(0, 50)),
        "hkv": hkv,
        "hq": hkv * draw(st.sampled_from([1, 2, 4])),
        "rotary_dim": 2 * half,
        "n_pass": draw(st.sampled_from([0, 0, 1, 3, 6])),  # 0: the full variant; odd D for partial
        "cs_shape": draw(st.sampled_from(["bsr", "1sr", "sr"])),
        "layout": draw(st.sampled_from(["bhsd", "bshd", "fused"])),
        "explicit_dim": draw(st.booleans()),
        "grad_transposed": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def build(case, dtype):
    gen = torch.Generator().manual_seed(case["seed"])
    b, s = case["b"], sum(case["seg_lens"])
    r = case["rotary_dim"]
    d = r + case["n_pass"]
    q, k = make_qk(b, case["hq"], case["hkv"], s, d, dtype, case["layout"], gen)
    if case["cs_shape"] == "bsr":  # per-row position ids: each row packs its own segments
        rows = [
            packed_positions(case["seg_lens"][i:] + case["seg_lens"][:i], case["offset"]) for i in range(b)
        ]
        cos, sin = cos_sin(torch.stack(rows), r, dtype)
    else:
        cos, sin = cos_sin(packed_positions(case["seg_lens"], case["offset"])[None], r, dtype)
        if case["cs_shape"] == "sr":
            cos, sin = cos[0], sin[0]

    def upstream(t):
        g = torch.randn(t.shape[0], t.shape[2], t.shape[1], t.shape[3], generator=gen).transpose(1, 2)
        g = g if case["grad_transposed"] else g.contiguous()
        return g.to(DEV, dtype)

    gq, gk = upstream(q), upstream(k)
    return q, k, cos, sin, gq, gk, (r if case["explicit_dim"] else None)


@settings(max_examples=40)
@given(case=rope_cases())
def test_triton_matches_eager_fp32(case):
    args = build(case, torch.float32)
    got, want = fwd_bwd(apply_rope_triton, *args), fwd_bwd(apply_rope_eager, *args)
    for name, g, w in zip(("q", "k", "dq", "dk"), got, want, strict=True):
        assert g.dtype == torch.float32 and g.shape == w.shape, name
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@settings(max_examples=20)
@given(case=rope_cases())
def test_triton_matches_eager_bf16(case):
    args = build(case, torch.bfloat16)
    got, want = fwd_bwd(apply_rope_triton, *args), fwd_bwd(apply_rope_eager, *args)
    ideal = reference64(*args)
    for name, g, w, i in zip(("q", "k", "dq", "dk"), got, want, ideal, strict=True):
        assert g.dtype == torch.bfloat16, name
        torch.testing.assert_close(g, w, rtol=1e-2, atol=1e-2, msg=lambda m, n=name: f"{n} vs eager: {m}")
        # fp32 math with one rounding to bf16.
        torch.testing.assert_close(
            g.double(), i, rtol=BF16_ONE_ROUNDING, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_eager_is_hf_bitwise():
    """Full rotary vs HF Llama, partial vs HF GPT-NeoX (rotate-half layout with pass-through dims)."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    neox = pytest.importorskip("transformers.models.gpt_neox.modeling_gpt_neox")
    gen = torch.Generator().manual_seed(0)
    q, k = make_qk(2, 4, 2, 5, 16, torch.bfloat16, "bshd", gen)
    pos = torch.stack([packed_positions([2, 3], 0), packed_positions([5], 7)])
    for module, rotary_dim in ((llama, 16), (neox, 8)):
        cos, sin = cos_sin(pos, rotary_dim, torch.bfloat16)
        want = module.apply_rotary_pos_emb(q, k, cos, sin)
        for got, ref in zip(apply_rope_eager(q, k, cos, sin), want, strict=True):
            assert got.dtype == ref.dtype and torch.equal(got, ref)


def test_backward_is_rotation_by_minus_sin():
    gen = torch.Generator().manual_seed(1)
    q, k = make_qk(1, 2, 1, 6, 12, torch.float32, "bhsd", gen)
    cos, sin = cos_sin(packed_positions([6], 3)[None], 8, torch.float32)
    gq, gk = torch.randn(q.shape, generator=gen).to(DEV), torch.randn(k.shape, generator=gen).to(DEV)
    _, _, dq, dk = fwd_bwd(apply_rope_triton, q, k, cos, sin, gq, gk, None)
    rq, rk = apply_rope_triton(gq, gk, cos, -sin)
    torch.testing.assert_close(dq, rq, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dk, rk, rtol=1e-6, atol=1e-6)


def test_layout_grad_subsets_and_no_cos_grad():
    gen = torch.Generator().manual_seed(2)
    q, k = make_qk(1, 4, 2, 3, 8, torch.float32, "bshd", gen)
    cos, sin = cos_sin(torch.arange(3)[None], 8, torch.float32)
    cos.requires_grad_()
    qo, ko = apply_rope_triton(q, k, cos, sin)
    assert qo.stride() == q.stride() and ko.stride() == k.stride()  # HF's transposed layout is kept
    # Only one output used: the other gets no kernel work and its input a zero/None gradient.
    (dq,) = torch.autograd.grad(qo.sum(), (q,), retain_graph=True)
    assert dq.shape == q.shape
    assert torch.autograd.grad(ko.sum(), (cos,), allow_unused=True)[0] is None
    # k as a constant: the Function skips its gradient.
    qo, _ = apply_rope_triton(q, k.detach(), cos, sin)
    (dq2,) = torch.autograd.grad(qo.sum(), (q,))
    torch.testing.assert_close(dq, dq2)


def test_empty_sequence():
    q, k = torch.zeros(1, 2, 0, 4, device=DEV), torch.zeros(1, 1, 0, 4, device=DEV)
    cos = torch.zeros(0, 4, device=DEV)
    qo, ko = apply_rope_triton(q, k, cos, cos)
    assert qo.shape == q.shape and ko.shape == k.shape


@pytest.mark.parametrize(
    ("q_shape", "k_shape", "cs_shape", "rotary_dim", "match"),
    [
        ((1, 2, 3, 8), (1, 1, 4, 8), (3, 8), None, "k must be"),
        ((1, 2, 3), (1, 1, 3, 8), (3, 8), None, r"\[B, H, S, D\]"),
        ((1, 2, 3, 8), (1, 1, 3, 8), (3, 6), 8, "rotary_dim=8"),
        ((1, 2, 3, 8), (1, 1, 3, 8), (3, 5), None, "even"),
        ((1, 2, 3, 8), (1, 1, 3, 8), (3, 10), None, "even"),
        ((2, 2, 3, 8), (2, 1, 3, 8), (3, 3, 8), None, r"\[B, S, R\]"),
    ],
)
@pytest.mark.parametrize("fn", [apply_rope_eager, apply_rope_triton])
def test_bad_inputs_raise(fn, q_shape, k_shape, cs_shape, rotary_dim, match):
    cos = torch.zeros(cs_shape)
    with pytest.raises(ValueError, match=match):
        fn(torch.zeros(q_shape), torch.zeros(k_shape), cos, cos, rotary_dim=rotary_dim)


@pytest.mark.cuda
@pytest.mark.parametrize("rotary_dim", [128, 64])
def test_cuda_real_shape_bf16(rotary_dim):
    b, s, hq, hkv, d = 1, 4096, 32, 8, 128
    gen = torch.Generator().manual_seed(3)
    q, k = make_qk(b, hq, hkv, s, d, torch.bfloat16, "bshd", gen)
    pos = torch.stack([packed_positions([1000, 3000, 96], 0)])
    cos, sin = cos_sin(pos, rotary_dim, torch.bfloat16)
    gq = torch.randn(q.shape, generator=gen).to(DEV, torch.bfloat16)
    gk = torch.randn(k.shape, generator=gen).to(DEV, torch.bfloat16)
    args = (q, k, cos, sin, gq, gk, rotary_dim)
    got, want, ideal = fwd_bwd(apply_rope_triton, *args), fwd_bwd(apply_rope_eager, *args), reference64(*args)
    for name, g, w, i in zip(("q", "k", "dq", "dk"), got, want, ideal, strict=True):
        # Eager rounds its intermediates to bf16 (as HF does), so it may sit two roundings from the truth;
        # the strict bound is the one against the fp64 evaluation below.
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2, msg=lambda m, n=name: f"{n} vs eager: {m}")
        torch.testing.assert_close(
            g.double(), i, rtol=BF16_ONE_ROUNDING, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


def _sdpa_bhsd(q, k, v):
    """HF-layout causal attention with GQA: ``[B, H, S, D]`` in, ``[B, S, H, D]`` out."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


def _rope_then_ulysses(ctx, case: dict) -> None:
    """RoPE on each rank's sequence shard, then Ulysses attention == RoPE + attention on one process."""
    from veomni.core.parallel_state import ParallelDims, build_parallel_state
    from veomni.core.sp import slice_sequence, ulysses_attention

    group = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type).sp_group
    b, s, hq, hkv, d, r = case["b"], case["s"], case["hq"], case["hkv"], case["d"], case["r"]
    gen = torch.Generator().manual_seed(case["seed"])

    def leaf(*shape):  # [B, S, H, D] projections, identical on every rank
        return torch.randn(*shape, generator=gen).to(ctx.device).requires_grad_()

    q, k, v = leaf(b, s, hq, d), leaf(b, s, hkv, d), leaf(b, s, hkv, d)
    probe = torch.randn(b, s, hq, d, generator=gen).to(ctx.device)
    pos = torch.stack([packed_positions(case["segs"], 0)] * b)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, r, 2).double() / r))
    emb = torch.cat([pos[..., None].double() * inv_freq] * 2, dim=-1)
    cos, sin = emb.cos().float().to(ctx.device), emb.sin().float().to(ctx.device)

    qr, kr = apply_rope_eager(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    ref = _sdpa_bhsd(qr, kr, v.transpose(1, 2))
    ref_grads = torch.autograd.grad((ref * probe).sum(), (q, k, v))

    q_sh, k_sh, v_sh = (slice_sequence(t.transpose(1, 2), 2, group) for t in (q, k, v))
    cos_sh, sin_sh = slice_sequence(cos, 1, group), slice_sequence(sin, 1, group)
    q_sh, k_sh = apply_rope_triton(q_sh, k_sh, cos_sh, sin_sh)
    out = ulysses_attention(
        q_sh,
        k_sh,
        v_sh,
        _sdpa_bhsd,
        group,
        seq_dim=2,
        head_dim=1,
        unpadded_len=s,
        out_seq_dim=1,
        out_head_dim=2,
    )
    torch.testing.assert_close(out, slice_sequence(ref.detach(), 1, group), rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad((out * slice_sequence(probe, 1, group)).sum(), (q, k, v))
    for got, want in zip(grads, ref_grads, strict=True):
        total = got.clone(memory_format=torch.contiguous_format)  # NCCL needs contiguous buffers
        torch.distributed.all_reduce(total, group=group)  # each rank's grad covers only its shard
        torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # starting the two-rank pool dominates: ~20 s alone on 2 cores, shared in a full run
@pytest.mark.parametrize("world_size, backend", backend_params(2))
@settings(max_examples=6)
@given(
    segs=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    hkv=st.sampled_from([1, 2]),
    ratio=st.sampled_from([1, 2]),
    partial=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_rope_then_ulysses_matches_single_process(
    dist_pools, world_size, backend, segs, hkv, ratio, partial, seed
):
    hq = max(hkv * ratio, world_size)
    hq += (-hq) % hkv  # H_q: a multiple of both H_kv and the SP size
    case = {"b": 2, "s": sum(segs), "hq": hq, "hkv": hkv, "d": 8, "r": 4 if partial else 8, "segs": segs}
    dist_pools.get(world_size, backend).run(_rope_then_ulysses, {**case, "seed": seed})
