"""Numeric parity of the ``npu`` backend (torch_npu) against the eager oracles, forward and backward, at real
shapes. Marked ``npu``: skipped without an Ascend NPU and torch_npu; run on an NPU runner (docs/kernels.md)."""

from __future__ import annotations

import pytest
import torch

from veomni.kernels import KERNELS

pytestmark = pytest.mark.npu
DEVICE = "npu"


def _t(gen: torch.Generator, *shape: int, dtype=torch.bfloat16, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype).requires_grad_()


def _fwd_bwd(fn, args, kwargs=None):
    args = [a.detach().clone().requires_grad_(a.requires_grad) if a.is_floating_point() else a for a in args]
    out = fn(*args, **(kwargs or {}))
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(7)
    total = sum((o.float() * torch.randn(o.shape, generator=gen).to(o.device)).sum() for o in outs)
    leaves = [a for a in args if a.is_floating_point() and a.requires_grad]
    return [o.detach().float() for o in outs], [g.float() for g in torch.autograd.grad(total, leaves)]


def _compare(variant_op: tuple[str, str], args, kwargs=None, tol=2e-2, upcast_ref=True):
    op, variant = variant_op
    ref_args = (
        [a.detach().float().requires_grad_() if a.is_floating_point() else a for a in args]
        if upcast_ref
        else args
    )
    want_out, want_grads = _fwd_bwd(KERNELS.get(op, variant, "eager").factory(), ref_args, kwargs)
    got_out, got_grads = _fwd_bwd(KERNELS.get(op, variant, "npu").factory(), args, kwargs)
    for got, want in zip(got_out + got_grads, want_out + want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("variant", ["standard", "offset", "unweighted", "residual"])
def test_rms_norm(variant):
    g = torch.Generator().manual_seed(0)
    x, w = _t(g, 4096, 2048), _t(g, 2048, scale=0.1)
    args = {"standard": (x, w, 1e-6), "offset": (x, w, 1e-6), "unweighted": (x, 1e-6),
            "residual": (x, _t(g, 4096, 2048), w, 1e-6)}[variant]  # fmt: skip
    _compare(("rms_norm", variant), args)


@pytest.mark.parametrize(("variant", "rotary_dim"), [("full", None), ("partial", 64)])
def test_rope(variant, rotary_dim):
    g = torch.Generator().manual_seed(0)
    b, s, d = 2, 1024, 128
    angles = torch.randn(b, s, (rotary_dim or d) // 2, generator=g)
    angles = torch.cat([angles, angles], -1).to(DEVICE)
    q, k = _t(g, b, 16, s, d), _t(g, b, 4, s, d)
    _compare(
        ("rope", variant),
        (q, k, angles.cos().bfloat16(), angles.sin().bfloat16()),
        {"rotary_dim": rotary_dim},
    )


@pytest.mark.parametrize("packed", [False, True])
def test_attention_causal_gqa_and_varlen(packed):
    g = torch.Generator().manual_seed(0)
    s = 1024
    q, k, v = _t(g, 1, s, 8, 128), _t(g, 1, s, 2, 128), _t(g, 1, s, 2, 128)
    kwargs = {"causal": True}
    if packed:
        kwargs |= {
            "cu_seqlens": torch.tensor([0, 300, 700, s], dtype=torch.int32, device=DEVICE),
            "max_seqlen": 400,
        }
    _compare(("attention", "default"), (q, k, v), kwargs)


def test_moe_experts_grouped_and_routed():
    g = torch.Generator().manual_seed(0)
    e, h, i, t, k = 8, 256, 128, 512, 2
    gate_up, down = _t(g, e, 2 * i, h, scale=0.05), _t(g, e, h, i, scale=0.05)
    counts = torch.tensor([100, 0, 60, 80, 70, 50, 90, 62], device=DEVICE)
    _compare(("moe_experts", "grouped"), (_t(g, int(counts.sum()), h), counts, gate_up, down))
    idx = torch.randint(0, e, (t, k), generator=g).to(DEVICE)
    weights = torch.softmax(torch.randn(t, k, generator=g), -1).to(DEVICE).requires_grad_()
    _compare(("moe_experts", "routed"), (_t(g, t, h), idx, weights, gate_up, down))
