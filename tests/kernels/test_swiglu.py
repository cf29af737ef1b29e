"""SwiGLU: Triton kernel vs the eager oracle (forward and backward), layouts, saved tensors, peak memory.

On CPU the Triton kernels run through Triton's interpreter (tests/conftest.py), so shapes stay tiny. The
kernel computes in fp32 and rounds once; the eager oracle rounds silu(gate) to the input dtype first. fp32:
~1e-5. bf16/fp16: 1e-2 against eager, and within one rounding of an fp64 evaluation on the same inputs.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from veomni.kernels.swiglu import swiglu_eager, swiglu_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# Relative size of one rounding to the output dtype: half an ulp on GPUs (round to nearest), a full ulp in
# the interpreter, which converts fp32 -> bf16/fp16 by truncation.
_ULP = {torch.bfloat16: 2**-7, torch.float16: 2**-10}
_INTERP = os.environ.get("TRITON_INTERPRET") == "1"


def one_rounding(dtype: torch.dtype) -> float:
    return _ULP[dtype] if _INTERP else _ULP[dtype] / 2


def make_inputs(lead, n, dtype, layout, gen):
    """gate, up ``[*lead, n]`` as leaves (or views of one leaf, returned third) in one of four layouts."""
    if layout == "contiguous":
        g, u = torch.randn(*lead, n, generator=gen), torch.randn(*lead, n, generator=gen)
    elif layout == "merged":  # one gate_up projection output split in two: row stride 2n
        merged = torch.randn(*lead, 2 * n, generator=gen).to(DEV, dtype).requires_grad_()
        g, u = merged.chunk(2, dim=-1)
        return g, u, merged
    elif layout == "strided_rows" and lead:  # every other row of a taller buffer: row stride 2n
        tall = (*lead[:-1], 2 * lead[-1], n)
        g = torch.randn(*tall, generator=gen)[..., ::2, :]
        u = torch.randn(*tall, generator=gen)[..., ::2, :]
    elif layout == "strided_rows":  # a single row has no row stride to vary
        g, u = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    else:  # "transposed": last dim not unit-stride, copied by the wrapper
        g = torch.randn(n, *lead, generator=gen).movedim(0, -1)
        u = torch.randn(n, *lead, generator=gen).movedim(0, -1)
    g = g.to(DEV, dtype).detach().requires_grad_()
    u = u.to(DEV, dtype).detach().requires_grad_()
    return g, u, None


def fwd_bwd(fn, g, u, leaf, dy):
    out = fn(g, u)
    wrt = (leaf,) if leaf is not None else (g, u)
    return (out, *torch.autograd.grad(out, wrt, dy))


def reference64(g, u, leaf, dy):
    """The eager formula in fp64 on the same (already rounded) inputs."""
    if leaf is not None:
        leaf64 = leaf.detach().double().requires_grad_()
        g64, u64 = leaf64.chunk(2, dim=-1)
        return fwd_bwd(swiglu_eager, g64, u64, leaf64, dy.double())
    g64, u64 = (t.detach().double().requires_grad_() for t in (g, u))
    return fwd_bwd(swiglu_eager, g64, u64, None, dy.double())


@st.composite
def swiglu_cases(draw):
    return {
        "lead": draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)),
        "n": draw(st.integers(1, 70)),  # odd widths and more than one column block are both drawn
        "layout": draw(st.sampled_from(["contiguous", "merged", "strided_rows", "transposed"])),
        "grad_transposed": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def build(case, dtype):
    gen = torch.Generator().manual_seed(case["seed"])
    g, u, leaf = make_inputs(case["lead"], case["n"], dtype, case["layout"], gen)
    dy = torch.randn(case["n"], *case["lead"], generator=gen).movedim(0, -1)
    dy = (dy if case["grad_transposed"] else dy.contiguous()).to(DEV, dtype)
    return g, u, leaf, dy


@settings(max_examples=50)
@given(case=swiglu_cases())
def test_triton_matches_eager_fp32(case):
    args = build(case, torch.float32)
    got, want = fwd_bwd(swiglu_triton, *args), fwd_bwd(swiglu_eager, *args)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == torch.float32 and a.shape == b.shape, i
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, i=i: f"output {i}: {m}")


@settings(max_examples=15)
@given(case=swiglu_cases(), dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_triton_matches_eager_low_precision(case, dtype):
    args = build(case, dtype)
    got, want, ideal = fwd_bwd(swiglu_triton, *args), fwd_bwd(swiglu_eager, *args), reference64(*args)
    tol = one_rounding(dtype)
    for i, (a, b, c) in enumerate(zip(got, want, ideal, strict=True)):
        assert a.dtype == dtype, i
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2, msg=lambda m, i=i: f"output {i} vs eager: {m}")
        torch.testing.assert_close(a.double(), c, rtol=tol, atol=1e-5, msg=lambda m, i=i: f"output {i}: {m}")


def _saved_numel(fn, g, u) -> int:
    """Elements autograd keeps for the backward of ``fn(g, u)`` (leaf inputs count too)."""
    saved: list[int] = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(g, u)
    return sum(saved)


def test_saves_only_gate_and_up():
    g = torch.randn(3, 10, device=DEV, requires_grad=True)
    u = torch.randn(3, 10, device=DEV, requires_grad=True)
    assert _saved_numel(swiglu_triton, g, u) == 2 * g.numel()
    assert _saved_numel(swiglu_eager, g, u) == 3 * g.numel()


def test_single_input_grad_and_empty():
    g = torch.randn(2, 5, device=DEV, requires_grad=True)
    u = torch.randn(2, 5, device=DEV)
    (dg,) = torch.autograd.grad(swiglu_triton(g, u).sum(), (g,))
    torch.testing.assert_close(dg, torch.autograd.grad(swiglu_eager(g, u).sum(), (g,))[0])
    e = torch.zeros(0, 7, device=DEV, requires_grad=True)
    out = swiglu_triton(e, e)
    assert out.shape == (0, 7)
    assert torch.autograd.grad(out.sum(), (e,))[0].shape == (0, 7)


@pytest.mark.parametrize(
    ("g", "u", "match"),
    [
        (torch.zeros(2, 3), torch.zeros(2, 4), "one shape"),
        (torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float64), "dtype"),
        (torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.int64), "float"),
        (torch.zeros(()), torch.zeros(()), "at least one"),
    ],
)
@pytest.mark.parametrize("fn", [swiglu_eager, swiglu_triton])
def test_bad_inputs_raise(fn, g, u, match):
    with pytest.raises(ValueError, match=match):
        fn(g, u)


def _peak_fwd_bwd(fn, g, u, dy) -> int:
    """Peak CUDA bytes above the live inputs during ``fn`` forward + backward (grads freed after)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn(g, u)
    grads = torch.autograd.grad(out, (g, u), dy)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out, grads
    return peak


@pytest.mark.cuda
def test_cuda_real_shape_bf16_and_peak_memory():
    m, n = 16 * 1024, 8192
    gen = torch.Generator(device=DEV).manual_seed(4)
    g = torch.randn(m, n, device=DEV, generator=gen, dtype=torch.bfloat16, requires_grad=True)
    u = torch.randn(m, n, device=DEV, generator=gen, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device=DEV, generator=gen, dtype=torch.bfloat16)
    got, want = fwd_bwd(swiglu_triton, g, u, None, dy), fwd_bwd(swiglu_eager, g, u, None, dy)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2, msg=lambda msg, i=i: f"output {i}: {msg}")
    # fp32 reference on row slices keeps the check exact without an fp64 copy of 128M elements.
    rows = slice(0, 512)
    g32, u32 = g[rows].detach().float().requires_grad_(), u[rows].detach().float().requires_grad_()
    ref = fwd_bwd(lambda a, b: F.silu(a) * b, g32, u32, None, dy[rows].float())
    for a, c in zip(got, ref, strict=True):
        torch.testing.assert_close(a[rows].float(), c, rtol=one_rounding(torch.bfloat16), atol=1e-5)
    del got, want
    tensor_bytes = m * n * 2
    ours, eager = _peak_fwd_bwd(swiglu_triton, g, u, dy), _peak_fwd_bwd(swiglu_eager, g, u, dy)
    # Ours: out + d gate + d up. Eager also holds silu(gate) (saved) or its d silu temporary at its peak.
    assert ours <= 3 * tensor_bytes + (64 << 20), (ours, eager)
    assert ours < eager, (ours, eager)
