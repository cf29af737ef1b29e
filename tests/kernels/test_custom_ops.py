"""veomni's Triton kernels as torch custom ops: registrations (``torch.library.opcheck``: schema, fake tensors,
autograd registration, AOT dispatch) and ``torch.compile(fullgraph=True)`` through the public functions, which
must equal their eager calls bitwise (the same kernels run; only the dispatch differs).

On CPU the kernels run through Triton's interpreter (tests/conftest.py), so shapes stay tiny. ``aot_eager``
traces the whole autograd graph (forward and backward) without generating code: cheap proof of no graph break.
"""

from __future__ import annotations

import pytest
import torch

from veomni.kernels.rms_norm import ops as rms_ops
from veomni.kernels.rms_norm import triton_impl as rms
from veomni.kernels.rope import ops as rope_ops
from veomni.kernels.rope import triton_impl as rope
from veomni.kernels.swiglu import ops as swiglu_ops
from veomni.kernels.swiglu import triton_impl as swiglu

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def _t(*shape: int, dtype: torch.dtype = torch.float32, grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE, dtype=dtype).requires_grad_(grad)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch.manual_seed(0)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", [0, 1, 2], ids=["standard", "offset", "unweighted"])
def test_rms_norm_fwd_opcheck(mode):
    x = _t(2, 3, 16)
    w = None if mode == 2 else _t(16)
    torch.library.opcheck(rms_ops.rms_norm_fwd, (x, w, EPS, mode))


def test_add_rms_norm_fwd_opcheck():
    torch.library.opcheck(rms_ops.add_rms_norm_fwd, (_t(5, 16), _t(5, 16), _t(16), EPS))


@pytest.mark.parametrize("with_dz", [False, True])
@pytest.mark.parametrize("compute_dw", [False, True])
def test_rms_norm_bwd_opcheck(with_dz, compute_dw):
    x = _t(2, 5, 16, grad=False)
    rstd = torch.rand(10, device=DEVICE) + 0.5
    dz = _t(2, 5, 16, grad=False) if with_dz else None
    args = (_t(2, 5, 16, grad=False), dz, x, _t(16, grad=False), rstd, 0, compute_dw)
    torch.library.opcheck(rms_ops.rms_norm_bwd, args)


def test_rope_opcheck_strided_and_gqa():
    # HF hands q/k over as transposed views of [B, S, H, D]; the outputs keep that layout.
    q = torch.randn(2, 6, 4, 8, device=DEVICE).transpose(1, 2).requires_grad_()
    k = _t(2, 2, 6, 8)
    cos, sin = torch.randn(2, 6, 8, device=DEVICE), torch.randn(2, 6, 8, device=DEVICE)
    torch.library.opcheck(rope_ops.rope, (q, k, cos, sin, False))
    out_q, _ = rope_ops.rope(q, k, cos, sin, False)
    assert out_q.stride() == q.stride()


def test_rope_opcheck_partial_rotary_backward_direction():
    q, k = _t(1, 4, 5, 12), _t(1, 2, 5, 12)
    cos, sin = torch.randn(5, 8, device=DEVICE), torch.randn(5, 8, device=DEVICE)
    torch.library.opcheck(rope_ops.rope, (q, k, cos, sin, True))


def test_swiglu_opchecks():
    gate_up = _t(3, 5, 24)
    gate, up = gate_up.chunk(2, dim=-1)  # the halves of a merged projection: row stride 24, not 12
    torch.library.opcheck(swiglu_ops.swiglu_fwd, (gate, up))
    torch.library.opcheck(swiglu_ops.swiglu_bwd, (_t(3, 5, 12, grad=False), gate.detach(), up.detach()))


def _compare(fn, inputs: tuple[torch.Tensor, ...]) -> None:
    """``fn`` eager vs compiled (aot_eager, fullgraph): equal outputs and input gradients, no graph break."""
    explained = torch._dynamo.explain(fn)(*inputs)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    eager_out = fn(*inputs)
    eager_grads = torch.autograd.grad(eager_out, inputs)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out = compiled(*inputs)
    grads = torch.autograd.grad(out, inputs)
    assert torch.equal(out, eager_out)
    for got, want in zip(grads, eager_grads, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_variants_compile_without_graph_breaks_and_match_eager(dtype):
    def fn(x, w, r):
        y = rms.rms_norm_standard(x, w, EPS)
        a, b = rms.fused_add_rms_norm(y.to(x.dtype), r, w, EPS)
        u = rms.rms_norm_unweighted(b, EPS)
        o = rms.rms_norm_offset(b, w, EPS)
        return a.float().square().sum() + u.float().sum() + (o.float() * b.float()).sum()

    _compare(fn, (_t(2, 3, 16, dtype=dtype), _t(16, dtype=dtype), _t(2, 3, 16, dtype=dtype)))


def test_rope_and_swiglu_compile_without_graph_breaks_and_match_eager():
    cos, sin = torch.randn(1, 6, 8, device=DEVICE), torch.randn(1, 6, 8, device=DEVICE)

    def fn(q, k, gate, up):
        a, b = rope.apply_rope_triton(q, k, cos, sin)
        return (a * a).sum() + (b * b * 0.5).sum() + swiglu.swiglu_triton(gate, up).square().sum()

    _compare(fn, (_t(2, 4, 6, 8), _t(2, 2, 6, 8), _t(3, 12), _t(3, 12)))


def test_compiled_path_uses_the_custom_ops():
    def fn(x, w, gate, up):
        return rms.rms_norm_standard(x, w, EPS).sum() + swiglu.swiglu_triton(gate, up).sum()

    seen: list[str] = []

    def backend(gm, example_inputs):  # noqa: ANN001, ANN202
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch.compile(fn, fullgraph=True, backend=backend)(_t(3, 16), _t(16), _t(3, 8), _t(3, 8))
    assert "veomni.rms_norm_fwd.default" in seen and "veomni.swiglu_fwd.default" in seen


def test_eager_path_keeps_the_autograd_functions():
    # Outside dynamo nothing goes through the dispatcher-level ops (no extra host cost in eager training).
    y = rms.rms_norm_standard(_t(3, 16), _t(16), EPS)
    assert type(y.grad_fn).__name__ == "_RMSNormFunctionBackward"
    out = swiglu.swiglu_triton(_t(3, 8), _t(3, 8))
    assert type(out.grad_fn).__name__ in ("_SwiGLUFunctionBackward", "ViewBackward0")
