"""MoE experts with per-expert LoRA (`moe_experts/lora_*`): the eager and torch backends against the merged-weight
oracle ``moe_experts_*_eager(..., W + scaling * B @ A)``, forward and backward (hidden, routing weights, base
weights, adapters), with one projection or both adapted, ranks the torch backend pads, duplicate routes and empty
experts; and the refusals."""

from __future__ import annotations

import pytest
import torch

from veomni.kernels import KERNELS
from veomni.kernels.moe_experts.eager import moe_experts_grouped_eager, moe_experts_routed_eager
from veomni.kernels.moe_experts.lora import (
    moe_experts_lora_grouped_eager,
    moe_experts_lora_grouped_torch,
    moe_experts_lora_routed_eager,
    moe_experts_lora_routed_torch,
)

ROUTED = {"eager": moe_experts_lora_routed_eager, "torch": moe_experts_lora_routed_torch}
GROUPED = {"eager": moe_experts_lora_grouped_eager, "torch": moe_experts_lora_grouped_torch}
E, H, I = 4, 8, 16  # noqa: E741


def _leaf(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).requires_grad_()


def _weights(gen: torch.Generator, rank: int, which: tuple[str, ...]) -> list[torch.Tensor | None]:
    w1, w2 = _leaf(gen, E, 2 * I, H, scale=H**-0.5), _leaf(gen, E, H, I, scale=I**-0.5)
    a1 = b1 = a2 = b2 = None
    if "gate_up" in which:
        a1, b1 = _leaf(gen, E, rank, H, scale=0.3), _leaf(gen, E, 2 * I, rank, scale=0.3)
    if "down" in which:
        a2, b2 = _leaf(gen, E, rank, I, scale=0.3), _leaf(gen, E, H, rank, scale=0.3)
    return [w1, w2, a1, b1, a2, b2]


def _merged(params: list, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    w1, w2, a1, b1, a2, b2 = params
    if a1 is not None:
        w1 = w1 + scaling * torch.bmm(b1, a1)
    if a2 is not None:
        w2 = w2 + scaling * torch.bmm(b2, a2)
    return w1, w2


def _grads(out: torch.Tensor, leaves: list) -> list:
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    return list(torch.autograd.grad((out * probe).sum(), [t for t in leaves if t is not None]))


@pytest.mark.parametrize("backend", ["eager", "torch"])
@pytest.mark.parametrize("which", [("gate_up", "down"), ("gate_up",), ("down",)])
@pytest.mark.parametrize("rank", [1, 3, 4])
def test_routed_equals_merged_weights(backend, which, rank):
    gen = torch.Generator().manual_seed(rank)
    hidden, weights = _leaf(gen, 9, H), torch.rand(9, 2, generator=gen).requires_grad_()
    ids = torch.randint(0, E - 1, (9, 2), generator=gen)  # the last expert gets no token
    ids[::3, 1] = ids[::3, 0]  # duplicate routes
    params, scaling = _weights(gen, rank, which), 1.5
    want = moe_experts_routed_eager(hidden, ids, weights, *_merged(params, scaling))
    got = ROUTED[backend](hidden, ids, weights, *params, scaling=scaling)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    leaves = [hidden, weights, *params]
    got_grads = _grads(got, leaves)
    for g, w in zip(got_grads, _grads(want, leaves), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    # An expert without tokens gets exactly zero weight and adapter gradients.
    for t, g in zip([t for t in leaves if t is not None], got_grads, strict=True):
        if t.dim() == 3:
            assert torch.equal(g[E - 1], torch.zeros_like(g[E - 1]))


@pytest.mark.parametrize("backend", ["eager", "torch"])
def test_grouped_equals_merged_weights(backend):
    gen = torch.Generator().manual_seed(0)
    x, counts = _leaf(gen, 10, H), torch.tensor([4, 0, 5, 1])
    params, scaling = _weights(gen, 2, ("gate_up", "down")), 0.25
    want = moe_experts_grouped_eager(x, counts, *_merged(params, scaling))
    got = GROUPED[backend](x, counts, *params, scaling=scaling)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(_grads(got, [x, *params]), _grads(want, [x, *params]), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_fp32_adapters_on_a_bf16_base():
    gen = torch.Generator().manual_seed(1)
    hidden, weights = torch.randn(6, H, generator=gen).bfloat16(), torch.rand(6, 2, generator=gen)
    ids = torch.randint(0, E, (6, 2), generator=gen)
    w1, w2, a1, b1, a2, b2 = _weights(gen, 4, ("gate_up", "down"))
    base = [w1.detach().bfloat16().requires_grad_(), w2.detach().bfloat16().requires_grad_()]
    eager = moe_experts_lora_routed_eager(hidden, ids, weights, *base, a1, b1, a2, b2, scaling=2.0)
    fast = moe_experts_lora_routed_torch(hidden, ids, weights, *base, a1, b1, a2, b2, scaling=2.0)
    assert eager.dtype == fast.dtype == torch.bfloat16
    torch.testing.assert_close(fast.float(), eager.float(), rtol=2e-2, atol=2e-2)
    (ga,) = torch.autograd.grad(fast.float().sum(), [a1])
    assert ga.dtype == torch.float32 and ga.abs().sum() > 0


def test_bad_adapters_are_refused():
    gen = torch.Generator().manual_seed(2)
    hidden, weights, ids = torch.randn(3, H), torch.rand(3, 2), torch.zeros(3, 2, dtype=torch.long)
    w1, w2, a1, b1, a2, b2 = _weights(gen, 2, ("gate_up", "down"))
    with pytest.raises(ValueError, match="come together"):
        moe_experts_lora_routed_eager(hidden, ids, weights, w1, w2, a1, None, None, None, scaling=1.0)
    with pytest.raises(ValueError, match="no adapter given"):
        moe_experts_lora_routed_torch(hidden, ids, weights, w1, w2, None, None, None, None, scaling=1.0)
    with pytest.raises(ValueError, match=r"gate_up_A must be \[E, r, in\]"):
        moe_experts_lora_routed_eager(
            hidden, ids, weights, w1, w2, a1.transpose(1, 2), b1, a2, b2, scaling=1.0
        )
    with pytest.raises(ValueError, match="one rank and dtype"):
        moe_experts_lora_routed_eager(
            hidden, ids, weights, w1, w2, a1, b1, a2[:, :1], b2[:, :, :1], scaling=1.0
        )
    with pytest.raises(ValueError, match="scaling must be a positive number"):
        moe_experts_lora_routed_eager(hidden, ids, weights, w1, w2, a1, b1, a2, b2, scaling=0.0)


def test_lora_variants_exist_for_eager_and_torch_only():
    for variant in ("lora_routed", "lora_grouped"):
        have = {s.backend for s in KERNELS.specs() if (s.op, s.variant) == ("moe_experts", variant)}
        assert have == {"eager", "torch"}, have
