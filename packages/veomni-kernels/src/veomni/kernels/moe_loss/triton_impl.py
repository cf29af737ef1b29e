"""Load-balancing loss with fused Triton kernels: one pass computes softmax, top-k and both per-expert sums.

Forward: every program owns a fixed, contiguous range of rows, walks it in ``[BLOCK_N, BLOCK_E]`` tiles
(fp32 softmax, iterative arg-max top-k with lowest-index ties) and writes its partial ``count`` and ``P``
vectors to its own row of a ``[programs, E]`` buffer; ``torch.sum`` over that buffer finishes the job. No
float atomics anywhere and a grid that depends only on ``N``, so results are bitwise reproducible.

Backward: only ``P_e = sum_n w_n p_{n,e}`` depends on the logits (counts are piecewise constant). With
``g = dLoss/dP`` the per-row gradient is the softmax Jacobian applied to ``w_n g``:
``dz_{n,j} = w_n p_{n,j} (g_j - sum_e g_e p_{n,e})``; one program per tile recomputes the softmax.
See ``eager.py`` for the notation.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from veomni.kernels.moe_loss.eager import RouterStats, check_router_logits, flat_row_weights, switch_loss

# Tiles hold at most this many elements, so registers stay bounded for E up to a few hundred.
_TILE_ELEMS = 4096
# Row tiles one forward program walks: fewer, larger partial buffers without serialising small inputs.
_TILES_PER_PROGRAM = 8


def _tile_shape(num_experts: int) -> tuple[int, int]:
    block_e = triton.next_power_of_2(num_experts)
    block_n = max(1, min(64, _TILE_ELEMS // block_e))
    return block_n, block_e


@triton.jit
def _softmax_tile(logits_ptr, stride_n, rows, cols, row_ok, col_ok):
    """fp32 softmax of a [BLOCK_N, BLOCK_E] tile; padded rows read zeros (finite), padded columns get p=0."""
    # int64 offsets: layers x tokens x experts passes 2**31 elements at scale (58 x 145k x 256).
    x = tl.load(
        logits_ptr + rows[:, None].to(tl.int64) * stride_n + cols[None, :],
        mask=row_ok[:, None] & col_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    x = tl.where(col_ok[None, :], x, float("-inf"))
    e = tl.exp(x - tl.max(x, axis=1)[:, None])
    return e / tl.sum(e, axis=1)[:, None]


@triton.jit
def _stats_fwd_kernel(
    logits_ptr,
    weights_ptr,
    counts_ptr,
    probs_ptr,
    n_rows,
    n_experts,
    stride_n,
    TOP_K: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
    TILES: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < n_experts
    count_acc = tl.zeros([BLOCK_E], dtype=tl.float32)
    prob_acc = tl.zeros([BLOCK_E], dtype=tl.float32)
    for t in tl.static_range(TILES):
        rows = (pid * TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < n_rows
        p = _softmax_tile(logits_ptr, stride_n, rows, cols, row_ok, col_ok)
        # Top-k on the probabilities (as HF does); padded columns sit at -1 so they are never picked.
        rest = tl.where(col_ok[None, :], p, -1.0)
        chosen = tl.zeros([BLOCK_N, BLOCK_E], dtype=tl.float32)
        for _ in tl.static_range(TOP_K):
            best = tl.max(rest, axis=1)
            first = tl.min(tl.where(rest == best[:, None], cols[None, :], BLOCK_E), axis=1)
            hit = cols[None, :] == first[:, None]
            chosen = tl.where(hit, 1.0, chosen)
            rest = tl.where(hit, -2.0, rest)
        if HAS_WEIGHTS:
            w = tl.load(weights_ptr + rows, mask=row_ok, other=0.0)
        else:
            w = tl.where(row_ok, 1.0, 0.0)
        # where, not multiply: padded rows must contribute exactly zero.
        count_acc += tl.sum(tl.where(row_ok[:, None], chosen * w[:, None], 0.0), axis=0)
        prob_acc += tl.sum(tl.where(row_ok[:, None], p * w[:, None], 0.0), axis=0)
    tl.store(counts_ptr + pid * BLOCK_E + cols, count_acc)
    tl.store(probs_ptr + pid * BLOCK_E + cols, prob_acc)


@triton.jit
def _stats_bwd_kernel(
    logits_ptr,
    weights_ptr,
    grad_probs_ptr,
    grad_logits_ptr,
    n_rows,
    n_experts,
    stride_n,
    stride_gn,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < n_experts
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    p = _softmax_tile(logits_ptr, stride_n, rows, cols, row_ok, col_ok)
    g = tl.load(grad_probs_ptr + cols, mask=col_ok, other=0.0)
    dot = tl.sum(p * g[None, :], axis=1)
    grad = p * (g[None, :] - dot[:, None])
    if HAS_WEIGHTS:
        w = tl.load(weights_ptr + rows, mask=row_ok, other=0.0)
        grad = grad * w[:, None]
    out = grad_logits_ptr + rows[:, None].to(tl.int64) * stride_gn + cols[None, :]
    tl.store(out, grad.to(grad_logits_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


class _RouterStatsFn(torch.autograd.Function):
    """``(logits [N, E], weights [N] fp32 | None, top_k) -> (counts [E], prob_sums [E])``, both fp32."""

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, weights: torch.Tensor | None, top_k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n_rows, n_experts = logits.shape
        block_n, block_e = _tile_shape(n_experts)
        tiles = max(1, min(_TILES_PER_PROGRAM, triton.cdiv(n_rows, block_n)))
        programs = max(1, triton.cdiv(n_rows, block_n * tiles))
        partial = torch.empty(2, programs, block_e, dtype=torch.float32, device=logits.device)
        has_w = weights is not None
        _stats_fwd_kernel[(programs,)](
            logits,
            weights if has_w else logits,
            partial[0],
            partial[1],
            n_rows,
            n_experts,
            logits.stride(0),
            TOP_K=top_k,
            HAS_WEIGHTS=has_w,
            BLOCK_N=block_n,
            BLOCK_E=block_e,
            TILES=tiles,
        )
        # Counts are integers (for 0/1 masks): fp64 keeps the sum exact past 2**24 picks.
        counts = partial[0, :, :n_experts].double().sum(0).float()
        prob_sums = partial[1, :, :n_experts].sum(0)
        ctx.save_for_backward(logits, weights if has_w else None)
        ctx.has_w = has_w
        ctx.mark_non_differentiable(counts)
        return counts, prob_sums

    @staticmethod
    def backward(
        ctx: Any, _grad_counts: torch.Tensor | None, grad_probs: torch.Tensor
    ) -> tuple[torch.Tensor, None, None]:
        logits, weights = ctx.saved_tensors
        n_rows, n_experts = logits.shape
        block_n, block_e = _tile_shape(n_experts)
        grad = torch.empty_like(logits)
        g = grad_probs.float().contiguous()
        _stats_bwd_kernel[(max(1, triton.cdiv(n_rows, block_n)),)](
            logits,
            weights if ctx.has_w else logits,
            g,
            grad,
            n_rows,
            n_experts,
            logits.stride(0),
            grad.stride(0),
            HAS_WEIGHTS=ctx.has_w,
            BLOCK_N=block_n,
            BLOCK_E=block_e,
        )
        return grad, None, None


def router_stats_triton(
    router_logits: Sequence[torch.Tensor],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
) -> RouterStats:
    """Fused, deterministic `RouterStats` (same contract as ``router_stats_eager``).

    Args:
        router_logits: one raw ``[T, E]`` tensor per layer (fp32/bf16/fp16), same device.
        attention_mask: optional ``[B, S]`` with ``B * S == T``.
    Returns:
        `RouterStats`: counts ``[E]`` fp32 (no grad), prob_sums ``[E]`` fp32 (grad flows to every layer's
        logits, in their dtype), weight 0-d fp32.
    """
    tokens = check_router_logits(router_logits, num_experts, top_k)
    device = router_logits[0].device
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"load-balancing loss 'triton' needs CUDA tensors (got {device}); use impl='eager', or set "
            "TRITON_INTERPRET=1 before importing triton to run the kernels through its CPU interpreter"
        )
    weights = flat_row_weights(attention_mask, tokens, device)
    layers = len(router_logits)
    logits = torch.cat([t.contiguous() for t in router_logits]) if layers > 1 else router_logits[0]
    logits = logits.contiguous()
    row_weights = weights.repeat(layers).contiguous() if weights is not None else None
    counts, prob_sums = _RouterStatsFn.apply(logits, row_weights, top_k)
    # A fill, not torch.tensor: a blocking host -> device copy would stall the host every step.
    rows = weights.sum() if weights is not None else torch.full((), float(tokens), device=device)
    return RouterStats(counts, prob_sums, rows * layers)


def load_balancing_loss_triton(
    router_logits: Sequence[torch.Tensor],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Switch load-balancing loss with the fused kernels; same contract as ``load_balancing_loss_eager``.

    Returns:
        0-d fp32 loss, bitwise reproducible for a given input on a given device.
    """
    stats = router_stats_triton(router_logits, num_experts, top_k, attention_mask)
    return switch_loss(stats.counts, stats.prob_sums, stats.weight, num_experts)
