"""MoE experts on our Triton grouped GEMMs: forward, dgrad and wgrad, with no host syncs.

Routed forward (``N = T*k``): one stable sort gives the expert-major ``order`` and the ``[E + 1]`` offsets;
the gate/up GEMM gathers ``hidden[order // k]`` in its loads and applies SwiGLU and the routing weight in its
epilogue (writing the pre-activations ``gu [N, 2I]`` and ``hw = w * silu(gate) * up [N, I]``); the down GEMM
scatters row ``m`` to (token, slot) position ``order[m]``; one pass sums each token's ``k`` rows in fp32.

Backward (four grouped GEMMs and one row sum): the down dgrad gathers ``grad_out`` rows and applies the
SwiGLU backward, the routing weight and the routing-weight gradient (in its epilogue, or in one elementwise
pass after it: the ``SPLIT`` tile config, sm_90's default, which costs a transient ``[N, I]``); ``dW2`` reduces
``grad_out`` rows against ``hw``; ``dW1`` reduces ``d[gate, up]`` against gathered ``hidden`` rows; the up
dgrad scatters rows back to (token, slot) order and one pass sums each token's ``k`` rows. Experts without
rows get zero weight gradients; a frozen weight (``requires_grad=False``) skips its wgrad. No atomics:
results are deterministic. Saved for backward: ``gu`` and ``hw`` (plus the inputs).

Rounding differs from the eager oracle in one place: the routing weight multiplies ``h`` before the down GEMM
(rounded to the activation dtype) instead of the fp32 output rows, which is the same function in exact
arithmetic and within bf16 rounding of it.
"""

from __future__ import annotations

from typing import Any

import torch

from veomni.kernels.moe_experts import triton_kernels as kern
from veomni.kernels.moe_experts.common import (
    check_grouped_inputs,
    check_routed_inputs,
    expert_major_order,
    group_offsets,
)
from veomni.kernels.moe_experts.configs import KINDS, KernelConfig, interpreting, kernel_config


class _ExpertsFn(torch.autograd.Function):
    """Routed (``order`` given: ``x`` is ``hidden [T, H]``) or grouped (``order`` None: ``x`` is ``[N, H]``)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        order: torch.Tensor | None,
        offsets: torch.Tensor,
        weights: torch.Tensor | None,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        top_k: int,
    ) -> torch.Tensor:
        cfg = _configs(x)
        gu, hw = kern.gate_up(x, order, top_k, offsets, gate_up_proj, weights, cfg["gate_up"])
        y = kern.rows_gemm(hw, offsets, down_proj, True, order, cfg["down"])
        out = kern.sum_rows(y, x.shape[0], top_k) if order is not None else y
        ctx.save_for_backward(x, order, offsets, weights, gate_up_proj, down_proj, gu, hw)
        ctx.top_k = top_k
        return out

    @staticmethod
    def backward(
        ctx: Any, grad_out: torch.Tensor
    ) -> tuple[
        torch.Tensor | None, None, None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None
    ]:
        x, order, offsets, weights, gate_up_proj, down_proj, gu, hw = ctx.saved_tensors
        need_x, _, _, need_w, need_w1, need_w2, _ = ctx.needs_input_grad
        top_k, experts = ctx.top_k, gate_up_proj.shape[0]
        cfg = _configs(x)
        grad_out = grad_out.contiguous()
        grad_x = grad_w1 = grad_w2 = grad_weights = None
        if need_w2:
            # dW2[e] = sum over its rows of grad_out[token]^T (w * h): hw already carries the routing weight.
            grad_w2 = kern.wgrad(grad_out, order, hw, None, top_k, offsets, experts, cfg["wgrad_down"])
        if need_x or need_w1 or need_w:
            dgu, dw = kern.down_dgrad(
                grad_out, order, top_k, offsets, down_proj, gu, weights, need_w, cfg["down_dgrad"]
            )
            if dw is not None:  # down_dgrad returns dw exactly when need_w
                grad_weights = dw.to(weights.dtype)
            if need_w1:
                grad_w1 = kern.wgrad(dgu, None, x, order, top_k, offsets, experts, cfg["wgrad_gate_up"])
            if need_x:
                dx = kern.rows_gemm(dgu, offsets, gate_up_proj, False, order, cfg["up_dgrad"])
                grad_x = kern.sum_rows(dx, x.shape[0], top_k) if order is not None else dx
        return grad_x, None, None, grad_weights, grad_w1, grad_w2, None


def _configs(x: torch.Tensor) -> dict[str, KernelConfig]:
    return {kind: kernel_config(kind, x.dtype, x.device) for kind in KINDS}


def _check_device(x: torch.Tensor) -> None:
    if x.device.type != "cuda" and not interpreting():
        raise RuntimeError(
            f"moe_experts 'triton' needs CUDA tensors (got {x.device}); use the 'eager' or 'torch' backend, or set "
            "TRITON_INTERPRET=1 before importing triton to run the kernels through its CPU interpreter"
        )


def moe_experts_routed_triton(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """`moe_experts_routed_eager`'s contract on the Triton grouped GEMMs (no host syncs).

    Args:
        hidden: ``[T, H]`` fp32/bf16/fp16 (T may be 0). top_k_index: ``[T, k]`` int64 ids in ``[0, E)``,
            duplicates allowed. top_k_weights: ``[T, k]`` float (used in fp32).
        gate_up_proj: ``[E, 2I, H]``. down_proj: ``[E, H, I]`` (hidden's dtype).
    Returns:
        ``[T, H]`` in hidden's dtype. Differentiable w.r.t. hidden, top_k_weights and both weights.
    """
    check_routed_inputs(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj)
    _check_device(hidden)
    order, offsets = expert_major_order(top_k_index, gate_up_proj.shape[0])
    out: torch.Tensor = _ExpertsFn.apply(
        hidden.contiguous(),
        order,
        offsets,
        top_k_weights.contiguous(),
        gate_up_proj.contiguous(),
        down_proj.contiguous(),
        top_k_index.shape[1],
    )
    return out


def moe_experts_grouped_triton(
    x: torch.Tensor, tokens_per_expert: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor
) -> torch.Tensor:
    """`moe_experts_grouped_eager`'s contract on the Triton grouped GEMMs (no host syncs).

    Args:
        x: ``[N, H]`` rows grouped by expert. tokens_per_expert: ``[E]`` int32/int64 on x's device.
        gate_up_proj: ``[E, 2I, H]``. down_proj: ``[E, H, I]`` (x's dtype).
    Returns:
        ``[N, H]`` in x's dtype. Differentiable w.r.t. x and both weights.
    """
    check_grouped_inputs(x, tokens_per_expert, gate_up_proj, down_proj)
    _check_device(x)
    offsets = group_offsets(tokens_per_expert)
    out: torch.Tensor = _ExpertsFn.apply(
        x.contiguous(), None, offsets, None, gate_up_proj.contiguous(), down_proj.contiguous(), 1
    )
    return out
