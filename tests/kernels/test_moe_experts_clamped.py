"""gpt-oss's clamped experts (`moe_experts/clamped_routed`, `clamped_grouped`) on the torch and triton backends.

Against the eager oracle in fp32 (biases included, experts with no rows, T = 0, a token routed twice to one
expert), and the properties the fast backends promise beyond the values: weight gradients in the parameters'
own layout (autograd would otherwise copy them whole into ``param.grad``), bias gradients as per-expert row sums
without a scatter-add (``index_select``'s backward is an atomic ``index_add_`` on CUDA), and the same numbers
under ``torch.compile`` with no graph break. Without CUDA the Triton kernels run in Triton's interpreter.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from veomni.kernels.moe_experts.clamped import (
    moe_experts_clamped_grouped_eager,
    moe_experts_clamped_grouped_torch,
    moe_experts_clamped_grouped_triton,
    moe_experts_clamped_routed_eager,
    moe_experts_clamped_routed_torch,
    moe_experts_clamped_routed_triton,
)
from veomni.kernels.moe_experts.torch_impl import expert_row_sums, moe_experts_routed_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROUTED = {"torch": moe_experts_clamped_routed_torch, "triton": moe_experts_clamped_routed_triton}
GROUPED = {"torch": moe_experts_clamped_grouped_torch, "triton": moe_experts_clamped_grouped_triton}
# A low limit so both clamps clip some pre-activations (gpt-oss: 7.0).
OPTIONS = {"limit": 1.5, "alpha": 1.702}
ROUTED_NAMES = ("out", "d_hidden", "d_weights", "d_gate_up", "d_gate_up_bias", "d_down", "d_down_bias")


def _params(gen, experts, hidden, inter, dtype):
    """``gate_up_proj [E, H, 2I]``, ``gate_up_bias [E, 2I]``, ``down_proj [E, I, H]``, ``down_bias [E, H]``."""
    shapes = ((experts, hidden, 2 * inter), (experts, 2 * inter), (experts, inter, hidden), (experts, hidden))
    scales = (hidden**-0.5 * 2, 0.5, inter**-0.5, 0.5)
    return [
        (torch.randn(s, generator=gen) * c).to(DEVICE, dtype).requires_grad_()
        for s, c in zip(shapes, scales, strict=True)
    ]


def routed_inputs(seed, tokens, top_k, experts, hidden=16, inter=8, *, empty=False, dtype=torch.float32):
    """hidden, ids (the first half of the experts only when ``empty``; token 0 twice to one expert), routing
    weights and the four expert tensors."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, max(1, experts // 2) if empty else experts, (tokens, top_k), generator=gen)
    if tokens and top_k > 1:
        ids[0, 1] = ids[0, 0]
    x = (torch.randn(tokens, hidden, generator=gen) * 2).to(DEVICE, dtype).requires_grad_()
    weights = torch.rand(tokens, top_k, generator=gen).to(DEVICE).requires_grad_()
    return [x, ids.to(DEVICE), weights, *_params(gen, experts, hidden, inter, dtype)]


def fwd_bwd(fn, args):
    """Output and the gradient of every floating leaf (zeros where autograd returns none)."""
    out = fn(*args, **OPTIONS)
    leaves = [a for a in args if a.requires_grad]
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device, out.dtype)
    grads = torch.autograd.grad(out, leaves, probe, allow_unused=True)
    return [out.detach()] + [
        torch.zeros_like(a) if g is None else g for a, g in zip(leaves, grads, strict=True)
    ]


def assert_close_all(got, want, names, tol=1e-5):
    for name, a, b in zip(names, got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}")


CASES = [
    # seed, tokens, top_k, experts, empty
    (0, 13, 2, 5, False),
    (1, 9, 4, 6, True),  # experts 3-5 get no rows: their gradients are exact zeros
    (2, 0, 2, 3, False),  # no tokens
    (3, 7, 1, 1, False),  # one expert
]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton_cpu)])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"seed{c[0]}-T{c[1]}-k{c[2]}-E{c[3]}")
def test_routed_matches_eager_fp32(backend, case):
    seed, tokens, top_k, experts, empty = case
    args = routed_inputs(seed, tokens, top_k, experts, empty=empty)
    got = fwd_bwd(ROUTED[backend], args)
    want = fwd_bwd(moe_experts_clamped_routed_eager, args)
    assert_close_all(got, want, ROUTED_NAMES)
    if empty:  # the experts past the first half got no rows: exact zeros for their biases' gradients
        unused = slice(experts // 2, None)
        assert not got[4][unused].any() and not got[6][unused].any()


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton_cpu)])
def test_grouped_matches_eager_fp32(backend):
    gen = torch.Generator().manual_seed(4)
    counts = torch.tensor([3, 0, 5, 1], device=DEVICE)
    x = torch.randn(9, 16, generator=gen).to(DEVICE).requires_grad_()
    args = [x, counts, *_params(gen, 4, 16, 8, torch.float32)]
    got = fwd_bwd(GROUPED[backend], args)
    want = fwd_bwd(moe_experts_clamped_grouped_eager, args)
    assert_close_all(got, want, ("out", "d_x", "d_gate_up", "d_gate_up_bias", "d_down", "d_down_bias"))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton_cpu)])
def test_weight_grads_come_back_in_the_parameters_layout(backend):
    # gpt-oss's weights are [E, in, out]; a gradient with other strides (e.g. the transpose of an [E, out, in]
    # GEMM output) is copied whole by autograd when it lands in param.grad.
    args = routed_inputs(5, 11, 2, 4)
    grads = fwd_bwd(ROUTED[backend], args)[1:]
    for name, grad, leaf in zip(ROUTED_NAMES[1:], grads, [a for a in args if a.requires_grad], strict=True):
        assert grad.stride() == leaf.stride(), (name, grad.stride(), leaf.stride())
    # The generic routed variant's [E, out, in] weights keep theirs too.
    gen = torch.Generator().manual_seed(6)
    w1 = torch.randn(4, 16, 16, generator=gen).to(DEVICE).requires_grad_()
    w2 = torch.randn(4, 16, 8, generator=gen).to(DEVICE).requires_grad_()
    out = moe_experts_routed_torch(args[0], args[1], args[2], w1, w2)
    for grad in torch.autograd.grad(out.sum(), (w1, w2)):
        assert grad.is_contiguous()


def _backward_nodes(out: torch.Tensor) -> Counter[str]:
    seen, names, stack = set(), Counter(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names[type(node).__name__] += 1
        stack.extend(n for n, _ in node.next_functions)
    return names


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton_cpu)])
def test_no_scatter_add_in_the_backward(backend):
    # index_select / indexing backward scatter-adds N rows onto E bias rows (atomics on CUDA); our biases and
    # permutations take their gradients by gathers and per-expert sums.
    args = routed_inputs(7, 10, 2, 3)
    nodes = _backward_nodes(ROUTED[backend](*args, **OPTIONS))
    assert not {n for n in nodes if n.startswith(("IndexSelect", "IndexAdd", "IndexPut", "Index", "Scatter"))}
    assert {"_ExpertBiasBackward", "_TritonExpertBiasBackward"} & set(nodes)


def test_frozen_biases_skip_their_row_sums():
    args = routed_inputs(8, 9, 2, 4)
    args[4].requires_grad_(False)  # gate_up_bias
    nodes = _backward_nodes(moe_experts_clamped_routed_torch(*args, **OPTIONS))
    assert nodes["_ExpertBiasBackward"] == 1  # the down bias only: no row sums for the frozen one
    got = fwd_bwd(moe_experts_clamped_routed_torch, args)
    want = fwd_bwd(moe_experts_clamped_routed_eager, args)
    assert_close_all(got, want, [n for n in ROUTED_NAMES if n != "d_gate_up_bias"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_row_sums(dtype):
    gen = torch.Generator().manual_seed(9)
    counts = [4, 0, 7, 2]
    rows = torch.randn(sum(counts), 16, generator=gen).to(DEVICE, dtype)
    ends = torch.tensor(counts, device=DEVICE).cumsum(0).to(torch.int32)
    got = expert_row_sums(rows, ends)
    want = torch.stack([part.double().sum(0) for part in rows.split(counts)])
    assert got.dtype == dtype and got.is_contiguous() and not got[1].any()
    # fp32 accumulation, one rounding: within a unit in the last place of the result dtype.
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    empty = expert_row_sums(rows[:0], torch.zeros(3, dtype=torch.int32, device=DEVICE))
    assert empty.shape == (3, 16) and not empty.any()


def _capturing_backend(graphs: dict[str, list[str]]):
    """An AOT-autograd backend that runs the traced graphs as they are and records their ATen ops."""

    def compiler(kind):
        def compile_graph(gm, example_inputs):  # noqa: ANN001, ANN202
            graphs[kind] += [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
            return make_boxed_func(gm.forward)

        return compile_graph

    return aot_autograd(fw_compiler=compiler("fwd"), bw_compiler=compiler("bwd"))


def test_compiled_traces_whole_and_matches_eager():
    # fullgraph: our autograd Functions trace without a graph break; the traced backward holds the grouped
    # GEMMs (2 dgrad, 2 wgrad, 2 bias row sums) and no scatter-add.
    args = routed_inputs(10, 12, 2, 4)
    graphs: dict[str, list[str]] = {"fwd": [], "bwd": []}
    compiled = torch.compile(
        moe_experts_clamped_routed_torch, fullgraph=True, backend=_capturing_backend(graphs)
    )
    got, want = fwd_bwd(compiled, args), fwd_bwd(moe_experts_clamped_routed_torch, args)
    for name, a, b in zip(ROUTED_NAMES, got, want, strict=True):
        assert torch.equal(a, b), name
    assert graphs["bwd"].count("aten._grouped_mm.default") == 6, graphs["bwd"]
    assert not [op for op in graphs["bwd"] if "index_add" in op or "index_put" in op or "scatter_add" in op]


@pytest.mark.slow
def test_inductor_matches_eager_oracle_fp32():
    # Inductor fuses the gathers, bias adds, activation and combine around the grouped GEMMs (CPU C++ code here,
    # Triton on a GPU); its gradients must still be the oracle's.
    args = routed_inputs(11, 12, 2, 4)
    compiled = torch.compile(moe_experts_clamped_routed_torch, fullgraph=True, backend="inductor")
    got = fwd_bwd(compiled, args)
    want = fwd_bwd(moe_experts_clamped_routed_eager, args)
    assert_close_all(got, want, ROUTED_NAMES)
    for grad, leaf in zip(got[1:], [a for a in args if a.requires_grad], strict=True):
        assert grad.stride() == leaf.stride()
