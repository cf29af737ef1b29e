"""MoE experts (`moe_experts`): the torch and triton backends against the eager oracle, forward and backward.

Both variants: ``routed`` (hidden, top-k ids and weights -> combined tokens; gradients for hidden, the routing
weights and both expert weights) and ``grouped`` (expert-major rows and device counts, the EP entry point).
Drawn cases include duplicate routes (one token picking an expert twice), experts with no tokens (their weight
gradients must be exactly zero) and T = 0.

Without CUDA the Triton kernels run through Triton's interpreter (tests/conftest.py), so shapes stay tiny;
on a GPU runner the same tests run on CUDA, and the ``cuda`` tests check the Qwen3-30B-A3B shapes.
Tolerances: fp32 1e-5 (reduction order only: the Triton dots run in IEEE fp32). bf16 is compared by relative
Frobenius error against the eager oracle evaluated in fp64 on the same bf16 inputs: the eager bf16 path itself
lands near 4e-3; we allow 1e-2 on GPUs and 3e-2 in the interpreter, which rounds fp32 -> bf16 toward zero
(biased) instead of to nearest.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from veomni.kernels.moe_experts import triton_kernels
from veomni.kernels.moe_experts.common import expert_major_order
from veomni.kernels.moe_experts.configs import kernel_config
from veomni.kernels.moe_experts.eager import moe_experts_grouped_eager, moe_experts_routed_eager
from veomni.kernels.moe_experts.torch_impl import moe_experts_grouped_torch, moe_experts_routed_torch
from veomni.kernels.moe_experts.triton_impl import moe_experts_grouped_triton, moe_experts_routed_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BF16_TOL = 3e-2 if _INTERPRETED else 1e-2
ROUTED = {"torch": moe_experts_routed_torch, "triton": moe_experts_routed_triton}
GROUPED = {"torch": moe_experts_grouped_torch, "triton": moe_experts_grouped_triton}
# Each new shape class compiles new kernels on a GPU: fewer drawn examples there.
EXAMPLES = 6 if DEVICE == "cuda" else 14


def routed_inputs(
    seed, tokens, top_k, experts, hidden, inter, dtype, *, dup=False, empty=False, device=DEVICE
):
    """hidden, ids, weights, W1, W2 with ids drawn from the first half of the experts when ``empty``."""
    gen = torch.Generator().manual_seed(seed)
    active = max(1, experts // 2) if empty else experts
    ids = torch.randint(0, active, (tokens, top_k), generator=gen)
    if dup and top_k > 1:
        ids[::2, 1] = ids[::2, 0]  # every other token routes twice to one expert
    x = torch.randn(tokens, hidden, generator=gen)
    weights = torch.rand(tokens, top_k, generator=gen)
    w1 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    leaf = lambda t, dt=dtype: t.to(device, dt).requires_grad_()  # noqa: E731
    return leaf(x), ids.to(device), leaf(weights, torch.float32), leaf(w1), leaf(w2)


def grouped_inputs(seed, counts, hidden, inter, dtype, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    experts = len(counts)
    x = torch.randn(sum(counts), hidden, generator=gen)
    w1 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    leaf = lambda t: t.to(device, dtype).requires_grad_()  # noqa: E731
    return leaf(x), torch.tensor(counts, device=device), leaf(w1), leaf(w2)


def fwd_bwd(fn, *args):
    """Output and the gradients of every floating leaf (zeros where autograd returns none)."""
    out = fn(*args)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device, out.dtype)
    grads = (
        torch.autograd.grad(out, leaves, probe, allow_unused=True)
        if out.requires_grad
        else [None] * len(leaves)
    )
    return [out.detach()] + [
        torch.zeros_like(a) if g is None else g for a, g in zip(leaves, grads, strict=True)
    ]


def as_fp64(args):
    return [a.detach().double().requires_grad_() if a.is_floating_point() else a for a in args]


def assert_fp32_close(got, want, names):
    for name, a, b in zip(names, got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


ROUTED_NAMES = ("out", "d_hidden", "d_weights", "d_gate_up", "d_down")
GROUPED_NAMES = ("out", "d_x", "d_gate_up", "d_down")


@st.composite
def routed_cases(draw):
    return {
        "seed": draw(st.integers(0, 2**16)),
        "tokens": draw(st.sampled_from([0, 1, 5, 13, 40])),
        "top_k": draw(st.integers(1, 4)),
        "experts": draw(st.integers(1, 9)),
        "hidden": draw(st.sampled_from([8, 16, 36])),
        "inter": draw(st.sampled_from([4, 8, 20])),
        "dup": draw(st.booleans()),
        "empty": draw(st.booleans()),
    }


@pytest.mark.parametrize("backend", ["torch", "triton"])
@settings(max_examples=EXAMPLES)
@given(case=routed_cases())
def test_routed_matches_eager_fp32(backend, case):
    args = routed_inputs(dtype=torch.float32, **case)
    got, want = fwd_bwd(ROUTED[backend], *args), fwd_bwd(moe_experts_routed_eager, *args)
    assert_fp32_close(got, want, ROUTED_NAMES)
    if case["empty"] and case["experts"] > 1:
        unused = torch.ones(case["experts"], dtype=torch.bool)
        unused[args[1].unique().cpu()] = False
        for grad in got[3:]:
            assert bool((grad[unused.to(grad.device)] == 0).all()), "experts without tokens need zero grads"


@pytest.mark.parametrize("backend", ["torch", "triton"])
@settings(max_examples=EXAMPLES)
@given(
    seed=st.integers(0, 2**16),
    counts=st.lists(st.sampled_from([0, 0, 1, 3, 17, 40]), min_size=1, max_size=6),
    hidden=st.sampled_from([8, 24]),
    inter=st.sampled_from([4, 12]),
)
def test_grouped_matches_eager_fp32(backend, seed, counts, hidden, inter):
    args = grouped_inputs(seed, counts, hidden, inter, torch.float32)
    got, want = fwd_bwd(GROUPED[backend], *args), fwd_bwd(moe_experts_grouped_eager, *args)
    assert_fp32_close(got, want, GROUPED_NAMES)
    for e, count in enumerate(counts):
        if count == 0:
            assert bool((got[2][e] == 0).all()) and bool((got[3][e] == 0).all()), f"expert {e} has no rows"


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", [(21, 4, 6, 64, 40), (9, 2, 3, 32, 16)])
def test_routed_bf16_against_fp64(backend, case):
    tokens, top_k, experts, hidden, inter = case
    args = routed_inputs(3, tokens, top_k, experts, hidden, inter, torch.bfloat16, dup=True)
    got, ideal = fwd_bwd(ROUTED[backend], *args), fwd_bwd(moe_experts_routed_eager, *as_fp64(args))
    for name, a, c in zip(ROUTED_NAMES, got, ideal, strict=True):
        assert a.dtype == (torch.float32 if name == "d_weights" else torch.bfloat16), name
        assert rel_err(a, c) < BF16_TOL, (name, rel_err(a, c))


def test_bf16_routing_weights_keep_their_dtype():
    hidden, ids, weights, w1, w2 = routed_inputs(5, 6, 2, 3, 16, 8, torch.float32)
    weights = weights.detach().bfloat16().requires_grad_()
    for fn in (moe_experts_routed_triton, moe_experts_routed_torch, moe_experts_routed_eager):
        out = fn(hidden, ids, weights, w1, w2)
        (grad,) = torch.autograd.grad(out.sum(), (weights,))
        assert out.dtype == torch.float32 and grad.dtype == torch.bfloat16


def test_many_experts_and_top16_triton():
    # k = 16, E = 130 (a 256-wide prefix sum, most experts empty); E = 512 runs in the cuda test below (the
    # interpreter pays ~10 ms per program, and the wgrad launches E of them).
    args = routed_inputs(11, 3, 16, 130, 8, 4, torch.float32, dup=True)
    got, want = fwd_bwd(moe_experts_routed_triton, *args), fwd_bwd(moe_experts_routed_eager, *args)
    assert_fp32_close(got, want, ROUTED_NAMES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("routed", [True, False])
def test_down_dgrad_split_matches_fused(dtype, routed):
    # The two implementations of the SwiGLU backward (fused epilogue / GEMM + elementwise pass) on one input.
    gen = torch.Generator().manual_seed(9)
    tokens, top_k, experts, hidden, inter = 11, 3, 4, 32, 40
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen).to(DEVICE)
    order, offsets = expert_major_order(ids, experts)
    rows = tokens * top_k
    grad = torch.randn(tokens if routed else rows, hidden, generator=gen).to(DEVICE, dtype)
    gu = torch.randn(rows, 2 * inter, generator=gen).to(DEVICE, dtype)
    w2 = torch.randn(experts, hidden, inter, generator=gen).to(DEVICE, dtype)
    weights = torch.rand(tokens, top_k, generator=gen).to(DEVICE) if routed else None
    cfg = dict(kernel_config("down_dgrad", dtype, torch.device(DEVICE)))
    args = (grad, order if routed else None, top_k if routed else 1, offsets, w2, gu, weights, routed)
    fused = triton_kernels.down_dgrad(*args, cfg | {"SPLIT": False})
    split = triton_kernels.down_dgrad(*args, cfg | {"SPLIT": True})
    tol = 1e-5 if dtype == torch.float32 else BF16_TOL
    assert rel_err(split[0], fused[0]) < tol
    if routed:
        assert rel_err(split[1], fused[1]) < tol
    else:
        assert split[1] is None and fused[1] is None


@pytest.mark.parametrize("frozen", ["gate_up", "down", "both"])
def test_frozen_weights_skip_their_wgrad(frozen, monkeypatch):
    hidden, ids, weights, w1, w2 = routed_inputs(2, 9, 2, 4, 16, 8, torch.float32)
    if frozen in ("gate_up", "both"):
        w1.requires_grad_(False)
    if frozen in ("down", "both"):
        w2.requires_grad_(False)
    calls = []
    real = triton_kernels.wgrad
    monkeypatch.setattr(triton_kernels, "wgrad", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = fwd_bwd(moe_experts_routed_triton, hidden, ids, weights, w1, w2)
    want = fwd_bwd(moe_experts_routed_eager, hidden, ids, weights, w1, w2)
    assert len(calls) == {"gate_up": 1, "down": 1, "both": 0}[frozen]
    assert_fp32_close(got, want, [f"grad {i}" for i in range(len(got))])


def test_no_grad_inputs_give_plain_outputs():
    hidden, ids, weights, w1, w2 = (a.detach() for a in routed_inputs(4, 5, 2, 3, 8, 4, torch.float32))
    for fn in (moe_experts_routed_triton, moe_experts_routed_torch):
        out = fn(hidden, ids, weights, w1, w2)
        assert not out.requires_grad
        torch.testing.assert_close(out, moe_experts_routed_eager(hidden, ids, weights, w1, w2))


# ---- errors ----

ALL_ROUTED = [moe_experts_routed_eager, moe_experts_routed_torch, moe_experts_routed_triton]
ALL_GROUPED = [moe_experts_grouped_eager, moe_experts_grouped_torch, moe_experts_grouped_triton]


def _bad_routed(kind):
    hidden, ids, weights, w1, w2 = (a.detach() for a in routed_inputs(0, 4, 2, 3, 8, 4, torch.float32))
    if kind == "ids_dtype":
        return (hidden, ids.int(), weights, w1, w2), TypeError, "int64"
    if kind == "ids_shape":
        return (hidden, ids[:3], weights, w1, w2), ValueError, r"top_k_index must be \[T, k\]"
    if kind == "weights_shape":
        return (hidden, ids, weights[:, :1], w1, w2), ValueError, "top_k_weights must be"
    if kind == "hidden_size":
        return (hidden[:, :6], ids, weights, w1, w2), ValueError, "H = 8"
    if kind == "down_shape":
        return (hidden, ids, weights, w1, w2[:, :, :3]), ValueError, "down_proj must be"
    if kind == "weight_dtype":
        return (hidden, ids, weights, w1.double(), w2), TypeError, "share one dtype"
    if kind == "ids_range":
        return (hidden, ids + 3, weights, w1, w2), ValueError, r"outside \[0, 3\)"
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind", ["ids_dtype", "ids_shape", "weights_shape", "hidden_size", "down_shape", "weight_dtype"]
)
@pytest.mark.parametrize("fn", ALL_ROUTED, ids=lambda f: f.__name__)
def test_routed_bad_inputs_raise(fn, kind):
    args, err, match = _bad_routed(kind)
    with pytest.raises(err, match=match):
        fn(*args)


@pytest.mark.skipif(DEVICE == "cuda", reason="on CUDA the range check is an asynchronous device assert")
@pytest.mark.parametrize("fn", ALL_ROUTED, ids=lambda f: f.__name__)
def test_routed_ids_out_of_range_raise(fn):
    args, err, match = _bad_routed("ids_range")
    with pytest.raises(err, match=match):
        fn(*args)


@pytest.mark.parametrize("fn", ALL_GROUPED, ids=lambda f: f.__name__)
def test_grouped_bad_inputs_raise(fn):
    x, counts, w1, w2 = (a.detach() for a in grouped_inputs(0, [2, 0, 3], 8, 4, torch.float32))
    with pytest.raises(TypeError, match="must be a"):
        fn(x, [2, 0, 3], w1, w2)
    with pytest.raises(ValueError, match=r"\[E\] = \[3\]"):
        fn(x, counts[:2], w1, w2)
    with pytest.raises(TypeError, match="int32 or int64"):
        fn(x, counts.float(), w1, w2)
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="sum to the 5 rows"):
            fn(x, counts + 1, w1, w2)


def test_torch_backend_refuses_unaligned_rows():
    args = [a.detach() for a in routed_inputs(0, 4, 2, 3, 6, 4, torch.float32)]
    with pytest.raises(ValueError, match="16-byte row strides"):
        moe_experts_routed_torch(*args)


# ---- GPU: real shapes, determinism, no host syncs ----

QWEN3_30B = {"experts": 128, "top_k": 8, "hidden": 2048, "inter": 768}


def _router_like(seed, tokens, top_k, experts, hidden, inter, device="cuda"):
    """bf16 inputs with softmax-top-k routing (skewed loads, some experts possibly empty)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, device=device, generator=gen).bfloat16()
    logits = torch.randn(tokens, experts, device=device, generator=gen) * 2
    weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
    weights = (weights / weights.sum(-1, keepdim=True)).requires_grad_()
    w1 = torch.randn(experts, 2 * inter, hidden, device=device, generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, device=device, generator=gen) * inter**-0.5
    return x.requires_grad_(), ids, weights, w1.bfloat16().requires_grad_(), w2.bfloat16().requires_grad_()


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_qwen3_moe_shape_against_fp32(backend):
    args = _router_like(0, 4096, **QWEN3_30B)
    got = fwd_bwd(ROUTED[backend], *args)
    ideal = fwd_bwd(
        moe_experts_routed_eager,
        *[a.detach().float().requires_grad_() if a.is_floating_point() else a for a in args],
    )
    eager = fwd_bwd(moe_experts_routed_eager, *args)
    for name, a, c, e in zip(ROUTED_NAMES, got, ideal, eager, strict=True):
        # Ours should be at least as close to the fp32 oracle as the eager bf16 path is (plus slack).
        assert rel_err(a, c) < max(1e-2, 1.5 * rel_err(e, c)), (name, rel_err(a, c), rel_err(e, c))


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_grouped_zero_count_experts_and_determinism(backend):
    counts = [0, 700, 0, 1, 129, 0, 2048, 64]
    x, counts_t, w1, w2 = grouped_inputs(1, counts, 2048, 768, torch.bfloat16, device="cuda")
    first = fwd_bwd(GROUPED[backend], x, counts_t, w1, w2)
    second = fwd_bwd(GROUPED[backend], x, counts_t, w1, w2)
    ideal = fwd_bwd(
        moe_experts_grouped_eager,
        *[a.detach().float().requires_grad_() if a.is_floating_point() else a for a in (x, counts_t, w1, w2)],
    )
    for name, a, b, c in zip(GROUPED_NAMES, first, second, ideal, strict=True):
        assert torch.equal(a, b), f"{name} is not bitwise reproducible"
        assert rel_err(a, c) < 1e-2, (name, rel_err(a, c))
    for e, count in enumerate(counts):
        if count == 0:
            assert bool((first[2][e] == 0).all()) and bool((first[3][e] == 0).all()), f"expert {e}"


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_no_host_sync(backend):
    args = _router_like(2, 2048, **QWEN3_30B)
    fwd_bwd(ROUTED[backend], *args)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = ROUTED[backend](*args)
        torch.autograd.backward(out, torch.ones_like(out))
        counts = torch.full((128,), 16, device="cuda", dtype=torch.int32)
        rows = args[0].detach()[:2048].requires_grad_()
        GROUPED[backend](rows, counts, args[3], args[4]).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.cuda
def test_cuda_many_experts_top16_and_empty_batch():
    args = _router_like(3, 1024, experts=512, top_k=16, hidden=1024, inter=256)
    got = fwd_bwd(moe_experts_routed_triton, *args)
    ideal = fwd_bwd(
        moe_experts_routed_eager,
        *[a.detach().float().requires_grad_() if a.is_floating_point() else a for a in args],
    )
    for name, a, c in zip(ROUTED_NAMES, got, ideal, strict=True):
        assert rel_err(a, c) < 1e-2, (name, rel_err(a, c))
    empty = [
        a[:0].detach().requires_grad_(a.requires_grad) if a.dim() == 2 and a.shape[0] == 1024 else a
        for a in args
    ]
    for fn in (moe_experts_routed_triton, moe_experts_routed_torch):
        out = fwd_bwd(fn, *empty)
        assert out[0].shape == (0, 1024) and all(bool((g == 0).all()) for g in out[3:])
