"""Load-balancing loss: fused Triton kernels vs the eager oracle (vs HF when installed), determinism, masks,
and the global-batch mode on real gloo groups."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from veomni.kernels.moe_loss import (
    global_router_counts,
    load_balancing_loss,
    load_balancing_loss_from_stats,
    load_balancing_loss_global,
    router_stats,
)


def _inputs(seed: int, layers: int, batch: int, seq: int, experts: int, dtype, masked: bool, ties: bool):
    gen = torch.Generator().manual_seed(seed)
    logits = []
    for _ in range(layers):
        if ties:  # few distinct values: exact ties exercise the lowest-index rule
            raw = torch.randint(-2, 3, (batch * seq, experts), generator=gen).float()
        else:
            raw = torch.randn(batch * seq, experts, generator=gen) * 2
        logits.append(raw.to(dtype).requires_grad_())
    mask = None
    if masked:
        mask = (torch.rand(batch, seq, generator=gen) < 0.7).long()
        mask[0, 0] = 1  # at least one real token, else W = 0 and the loss is NaN (as in HF)
    return logits, mask


def _loss_and_grads(logits, experts, top_k, mask, impl):
    for t in logits:
        t.grad = None
    loss = load_balancing_loss(logits, experts, top_k, mask, impl=impl)
    loss.backward()
    return loss.detach(), [t.grad.clone() for t in logits]


@pytest.mark.triton_cpu
@settings(max_examples=40)
@given(
    seed=st.integers(0, 2**31 - 1),
    layers=st.integers(1, 3),
    batch=st.integers(1, 3),
    seq=st.integers(1, 24),
    experts=st.integers(1, 20),
    top_k=st.integers(1, 4),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    masked=st.booleans(),
    ties=st.booleans(),
)
def test_triton_matches_eager(seed, layers, batch, seq, experts, top_k, dtype, masked, ties):
    top_k = min(top_k, experts)
    logits, mask = _inputs(seed, layers, batch, seq, experts, dtype, masked, ties)
    ref_loss, ref_grads = _loss_and_grads(logits, experts, top_k, mask, "eager")
    loss, grads = _loss_and_grads(logits, experts, top_k, mask, "triton")
    assert loss.dtype == torch.float32 and loss.dim() == 0
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    # fp32 tight; bf16 grads are rounded once to bf16 on both sides.
    tol = {"rtol": 1e-5, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-5}
    for g, ref in zip(grads, ref_grads, strict=True):
        assert g.dtype == dtype
        torch.testing.assert_close(g, ref, **tol)


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
@pytest.mark.parametrize("impl", ["eager", pytest.param("triton", marks=pytest.mark.triton_cpu)])
def test_matches_transformers(impl, masked):
    modeling = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    logits, mask = _inputs(7, 3, 2, 11, 8, torch.float32, masked, ties=False)
    hf = modeling.load_balancing_loss_func(tuple(logits), 8, 2, mask)
    hf.backward()
    hf_grads = [t.grad.clone() for t in logits]
    loss, grads = _loss_and_grads(logits, 8, 2, mask, impl)
    torch.testing.assert_close(loss, hf.detach(), rtol=1e-6, atol=1e-7)
    for g, ref in zip(grads, hf_grads, strict=True):
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-8)


@pytest.mark.triton_cpu
def test_triton_is_bitwise_deterministic():
    # Several programs, several tiles each, a partial last tile and an E that is not a power of two.
    logits, mask = _inputs(3, 2, 3, 401, 12, torch.float32, masked=True, ties=False)
    first_loss, first_grads = _loss_and_grads(logits, 12, 3, mask, "triton")
    for _ in range(2):
        loss, grads = _loss_and_grads(logits, 12, 3, mask, "triton")
        assert torch.equal(loss, first_loss)
        assert all(torch.equal(g, f) for g, f in zip(grads, first_grads, strict=True))


@pytest.mark.triton_cpu
def test_known_values():
    # Collapse onto expert 0 with k = 1 gives E; uniform routing over E experts with k picks gives k.
    experts = 6
    collapsed = torch.full((10, experts), -30.0)
    collapsed[:, 0] = 30.0
    for impl in ("eager", "triton"):
        torch.testing.assert_close(load_balancing_loss([collapsed], experts, 1, impl=impl), torch.tensor(6.0))
        uniform = torch.zeros(12, experts)
        # Ties: every token picks experts 0..k-1, yet P_e = 1/E makes the loss k * E * (1/E) = k.
        torch.testing.assert_close(load_balancing_loss([uniform], experts, 2, impl=impl), torch.tensor(2.0))


@pytest.mark.triton_cpu
def test_padding_tokens_do_not_count():
    logits, _ = _inputs(5, 2, 1, 9, 5, torch.float32, masked=False, ties=False)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0, 0]])
    trimmed = [t[:6] for t in logits]
    for impl in ("eager", "triton"):
        torch.testing.assert_close(
            load_balancing_loss(logits, 5, 2, mask, impl=impl), load_balancing_loss(trimmed, 5, 2, impl=impl)
        )


@pytest.mark.triton_cpu
def test_bad_inputs_raise():
    logits = [torch.randn(6, 4)]
    with pytest.raises(ValueError, match="attention_mask has 5 positions"):
        load_balancing_loss(logits, 4, 2, torch.ones(1, 5))
    with pytest.raises(ValueError, match="top_k"):
        load_balancing_loss(logits, 4, 5)
    with pytest.raises(ValueError, match=r"router_logits\[1\] has shape"):
        load_balancing_loss([torch.randn(6, 4), torch.randn(5, 4)], 4, 2)
    with pytest.raises(ValueError, match="empty"):
        load_balancing_loss([], 4, 2)
    with pytest.raises(ValueError, match="unknown load-balancing loss impl"):
        load_balancing_loss(logits, 4, 2, impl="cuda")


# ----- global-batch mode on real gloo groups -----

EXPERTS, TOP_K, LAYERS = 7, 2, 2


def _micro_batch(seed: int, seq: int):
    gen = torch.Generator().manual_seed(seed)
    logits = [torch.randn(2 * seq, EXPERTS, generator=gen) for _ in range(LAYERS)]
    mask = (torch.rand(2, seq, generator=gen) < 0.75).long()
    mask[0, 0] = 1
    return logits, mask


def _global_step(ctx, micro_specs: list[list[tuple[int, int]]], impl: str):
    """micro_specs[rank] = [(seed, seq), ...] micro-batches of that rank; every rank builds the same data."""
    data = [[_micro_batch(*spec) for spec in rank_specs] for rank_specs in micro_specs]

    # Oracle: one process, every rank's micro-batches concatenated into one batch.
    flat = [mb for rank_batches in data for mb in rank_batches]
    ref_logits = [torch.cat([mb[0][i] for mb in flat]).requires_grad_() for i in range(LAYERS)]
    ref_mask = torch.cat([mb[1].reshape(-1) for mb in flat])[None]
    ref = load_balancing_loss(ref_logits, EXPERTS, TOP_K, ref_mask, impl="eager")
    ref.backward()

    mine = [([t.clone().requires_grad_() for t in lg], m) for lg, m in data[ctx.rank]]
    group = dist.group.WORLD
    if len(mine) == 1:
        local = load_balancing_loss_global(mine[0][0], EXPERTS, TOP_K, mine[0][1], group=group, impl=impl)
    else:
        stats = [router_stats(lg, EXPERTS, TOP_K, m, impl=impl) for lg, m in mine]
        counts, weight = global_router_counts(stats, group)
        local = load_balancing_loss_from_stats(stats, counts, weight, EXPERTS)
    local.backward()
    total = local.detach().clone()
    dist.all_reduce(total, group=group)
    torch.testing.assert_close(total, ref.detach(), rtol=1e-5, atol=1e-6)

    # This rank's gradients are the oracle's gradients on the rows that came from this rank.
    start = sum(mb[0][0].shape[0] for rank_batches in data[: ctx.rank] for mb in rank_batches)
    for lg, _ in mine:
        rows = lg[0].shape[0]
        for i in range(LAYERS):
            torch.testing.assert_close(
                lg[i].grad, ref_logits[i].grad[start : start + rows], rtol=1e-5, atol=1e-8
            )
        start += rows
    return float(total)


@pytest.mark.parametrize("impl", ["eager", pytest.param("triton", marks=pytest.mark.triton_cpu)])
@settings(max_examples=6)
@given(data=st.data())
def test_global_mode_matches_single_process(dist_pools, impl, data):
    micro = data.draw(st.integers(1, 2))
    specs = [
        [(data.draw(st.integers(0, 10**6)), data.draw(st.integers(1, 9))) for _ in range(micro)]
        for _ in range(2)
    ]
    losses = dist_pools.get(2).run(_global_step, specs, impl)
    assert losses[0] == losses[1]


def test_global_mode_without_group_is_the_plain_loss():
    logits, mask = _micro_batch(11, 5)
    plain = load_balancing_loss(logits, EXPERTS, TOP_K, mask, impl="eager")
    solo = load_balancing_loss_global(logits, EXPERTS, TOP_K, mask, group=None, impl="eager")
    torch.testing.assert_close(solo, plain, rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_eager_cuda(dtype):
    logits, mask = _inputs(0, 4, 4, 512, 64, dtype, masked=True, ties=False)
    logits = [t.detach().cuda().requires_grad_() for t in logits]
    mask = mask.cuda()
    ref_loss, ref_grads = _loss_and_grads(logits, 64, 8, mask, "eager")
    loss, grads = _loss_and_grads(logits, 64, 8, mask, "triton")
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    tol = {"rtol": 1e-5, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-5}
    for g, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, ref, **tol)
    again, _ = _loss_and_grads(logits, 64, 8, mask, "triton")
    assert torch.equal(again, loss)


def test_triton_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        load_balancing_loss([torch.randn(4, 3)], 3, 1, impl="triton")
