"""Packed SDPA on the CPU runs segment by segment (`veomni.kernels.attention.segments`): the same result as SDPA
under the block-diagonal mask, forward and backward, in fp32, bf16 and fp64, with GQA and empty segments; the ops pass
torch's custom-op checks; a compiled caller traces them without graph breaks or recompiles; the cases the kernel
cannot take (another value head size, windows, sinks) keep the mask path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from veomni.kernels.attention import ATTENTION_FUNCTIONS
from veomni.kernels.attention.functions import allowed_mask
from veomni.kernels.attention.segments import (
    runs_per_segment,
    sdpa_segments,
    sdpa_segments_bwd,
    sdpa_segments_fwd,
)

sdpa = ATTENTION_FUNCTIONS["sdpa"]


def qkv(
    seed: int, seq: int, heads_kv: int, groups: int, dim: int, dtype: torch.dtype, dim_v: int | None = None
):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((seq, heads_kv * groups, dim), (seq, heads_kv, dim), (seq, heads_kv, dim_v or dim))
    return [torch.randn(1, *shape, generator=gen).to(dtype).requires_grad_() for shape in shapes]


def masked(q, k, v, cu, causal, scale):
    """SDPA under the explicit block-diagonal (causal) mask: the path the segment ops replace."""
    mask = allowed_mask(q.shape[1], causal, cu, q.device)
    out = F.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)),
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def out_and_grads(fn, tensors, grad_out):
    inputs = [t.detach().requires_grad_() for t in tensors]
    out = fn(*inputs)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in inputs]


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    lens=st.lists(st.integers(0, 9), min_size=2, max_size=5).filter(lambda xs: sum(xs) > 0),
    heads_kv=st.integers(1, 2),
    groups=st.sampled_from([1, 2, 3]),
    causal=st.booleans(),
    scale=st.sampled_from([None, 0.3]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
)
def test_segments_equal_the_masked_call(seed, lens, heads_kv, groups, causal, scale, dtype):
    tensors = qkv(seed, sum(lens), heads_kv, groups, 8, dtype)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    grad_out = torch.randn(tensors[0].shape, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    out, grads = out_and_grads(lambda q, k, v: sdpa_segments(q, k, v, cu, causal, scale), tensors, grad_out)
    want, want_grads = out_and_grads(lambda q, k, v: masked(q, k, v, cu, causal, scale), tensors, grad_out)
    assert out.dtype == dtype and out.shape == tensors[0].shape
    # fp32/fp64: the same flash kernel, over fewer keys; bf16: its rounding differs from the masked call's by ulps.
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(out, want, **tol)
    for got, ref, name in zip(grads, want_grads, "qkv", strict=True):
        assert got.dtype == dtype, name
        torch.testing.assert_close(got, ref, **tol, msg=lambda m, name=name: f"d{name}: {m}")


def test_sdpa_routes_packed_cpu_rows_through_the_segment_op():
    q, k, v = qkv(0, 12, 2, 2, 8, torch.float32)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    direct = sdpa_segments(q, k, v, cu, True, None)
    assert torch.equal(sdpa(q, k, v, cu_seqlens=cu), direct)
    # One segment is plain causal attention (no mask, no loop), as before.
    whole = torch.tensor([0, 12], dtype=torch.int32)
    assert torch.equal(sdpa(q, k, v, cu_seqlens=whole), sdpa(q, k, v))


def test_what_the_kernel_cannot_take_keeps_the_mask_path():
    q, k, v = qkv(1, 10, 1, 2, 8, torch.float32, dim_v=4)
    assert not runs_per_segment(q, v, None, None)
    assert runs_per_segment(q, q, None, None)
    assert not runs_per_segment(q, q, 3, None) and not runs_per_segment(q, q, None, torch.zeros(2))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    eager = ATTENTION_FUNCTIONS["eager"]
    torch.testing.assert_close(
        sdpa(q, k, v, cu_seqlens=cu), eager(q, k, v, cu_seqlens=cu), rtol=1e-5, atol=1e-5
    )


def test_bad_offsets_name_what_was_expected():
    q, k, v = qkv(2, 6, 1, 1, 4, torch.float32)
    with pytest.raises(ValueError, match=r"from 0 to S=6 without decreasing.*\[0, 4, 3, 6\]"):
        sdpa_segments(q, k, v, torch.tensor([0, 4, 3, 6], dtype=torch.int32), True, None)


def test_the_ops_pass_torch_custom_op_checks():
    q, k, v = qkv(3, 9, 2, 2, 8, torch.float32)
    cu = torch.tensor([0, 2, 2, 9], dtype=torch.int32)
    torch.library.opcheck(sdpa_segments_fwd, (q, k, v, cu, True, None))
    out, lse = sdpa_segments_fwd(q.detach(), k.detach(), v.detach(), cu, True, None)
    args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, cu, True, None)
    torch.library.opcheck(sdpa_segments_bwd, args)


def test_the_ops_pass_custom_op_checks_on_hf_layout_views():
    """q/k/v as HF hands them over: ``[1, S, H, D]`` views of ``[1, H, S, D]`` buffers (``transpose(1, 2)``). The
    fake kernels promise contiguous gradients, so the real ones must return contiguous ones too; otherwise a
    compiled backward (inductor) asserts on the strides of dq."""
    q, k, v = (
        t.detach().transpose(1, 2).contiguous().transpose(1, 2) for t in qkv(4, 9, 2, 2, 8, torch.float32)
    )
    assert not q.is_contiguous()
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    torch.library.opcheck(sdpa_segments_fwd, (q, k, v, cu, True, None))
    out, lse = sdpa_segments_fwd(q, k, v, cu, True, None)
    torch.library.opcheck(sdpa_segments_bwd, (torch.randn_like(out), q, k, v, out, lse, cu, True, None))


def test_compiled_caller_traces_one_graph_and_equals_eager_bitwise():
    """fullgraph: the host read of the offsets hides inside the op, so the number of documents can change freely."""
    from torch._dynamo.testing import CompileCounterWithBackend

    backend = CompileCounterWithBackend("aot_eager")

    def attend(q, k, v, cu):
        return sdpa(q, k, v, cu_seqlens=cu) * 2.0

    compiled = torch.compile(attend, backend=backend, fullgraph=True, dynamic=True)
    for seed, lens in enumerate(([3, 9], [2, 2, 8], [1, 4, 4, 3])):
        tensors = qkv(seed, 12, 2, 2, 8, torch.float32)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        grad_out = torch.randn(tensors[0].shape)
        got, got_grads = out_and_grads(lambda q, k, v, cu=cu: compiled(q, k, v, cu), tensors, grad_out)
        want, want_grads = out_and_grads(lambda q, k, v, cu=cu: attend(q, k, v, cu), tensors, grad_out)
        assert torch.equal(got, want)
        for g, w in zip(got_grads, want_grads, strict=True):
            assert torch.equal(g, w)
    assert backend.frame_count == 1
