"""gpt-oss experts: biased, transposed weights and a clamped, alpha-gated SwiGLU with interleaved gate/up columns.

Layout and maths (transformers' ``GptOssExperts``, read from its source), for the rows ``x [n, H]`` of expert ``e``:

    gu   = x @ gate_up_proj[e] + gate_up_bias[e]        gate_up_proj [E, H, 2I], gate_up_bias [E, 2I]
    gate = min(gu[:, 0::2], limit)                      interleaved: gate in even columns, up in odd ones
    up   = clamp(gu[:, 1::2], -limit, limit)
    h    = (up + 1) * gate * sigmoid(alpha * gate)      gpt-oss: limit 7.0, alpha 1.702
    y    = h @ down_proj[e] + down_bias[e]              down_proj [E, I, H], down_bias [E, H]

The routed variant combines ``out[t] = sum_j w[t, j] * y[t, j]`` in fp32 (the bias is inside the weighted term,
as upstream adds it before scaling), rounding once. Clamps pass no gradient where they clip (``torch.clamp``).

Registry variants of ``moe_experts`` (distinct maths from ``routed``/``grouped``, so no generic kernel can be
swapped in): ``clamped_routed`` ``fn(hidden [T, H], top_k_index [T, k], top_k_weights [T, k], gate_up_proj,
gate_up_bias, down_proj, down_bias, *, limit, alpha) -> [T, H]`` and ``clamped_grouped`` ``fn(x [N, H],
tokens_per_expert [E], gate_up_proj, gate_up_bias, down_proj, down_bias, *, limit, alpha) -> [N, H]`` (rows
grouped by expert, as expert-parallel dispatch returns them; the routing weight is applied by the combine).

Backends: ``eager`` (a loop over experts, the oracle), ``torch`` (``torch._grouped_mm``), ``triton`` (our Triton
grouped GEMMs from ``triton_kernels``: forward, dgrad and wgrad). The fast ones run the same composition: gather
rows expert-major, grouped GEMM, per-row bias, activation, grouped GEMM, bias, weighted combine; autograd
differentiates the elementwise parts. A bias is gathered per row, and its gradient is each expert's sum of rows,
taken by a grouped GEMM with a ones operand (fp32 accumulation, fixed order), not by ``index_select``'s backward
(an atomic ``index_add_`` of N rows onto E). Weight gradients come back in the parameters' own layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from veomni.kernels.moe_experts.common import (
    check_grouped_inputs,
    check_routed_inputs,
    expert_major_order,
    group_offsets,
    inverse_permutation,
)
from veomni.kernels.moe_experts.torch_impl import expert_bias_function

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (bias [E, C], row_expert [N], offsets [E + 1] int32) -> [N, C]: the bias of each expert-major row's expert.
BiasRows = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (gate_up_proj [E, H, 2I], gate_up_bias [E, 2I], down_proj [E, I, H], down_bias [E, H]).
Params = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def clamped_swiglu(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """``[..., 2I]`` interleaved (gate, up) pre-activations -> ``[..., I]``, in gate_up's dtype (as upstream)."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _as_standard(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    gate_up_bias: torch.Tensor,
    down_proj: torch.Tensor,
    down_bias: torch.Tensor,
    limit: float,
    alpha: float,
) -> None:
    """Validate the clamped layout; the generic checks then run on transposed views of the same weights."""
    if gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        raise ValueError(
            f"moe_experts clamped: gate_up_proj must be [E, H, 2I] and down_proj [E, I, H]; got "
            f"{tuple(gate_up_proj.shape)} and {tuple(down_proj.shape)}"
        )
    experts, _, two_i = gate_up_proj.shape
    hidden = down_proj.shape[2]
    if tuple(gate_up_bias.shape) != (experts, two_i) or tuple(down_bias.shape) != (experts, hidden):
        raise ValueError(
            f"moe_experts clamped: biases must be gate_up_bias [E, 2I] = {[experts, two_i]} and down_bias "
            f"[E, H] = {[experts, hidden]}; got {tuple(gate_up_bias.shape)} and {tuple(down_bias.shape)}"
        )
    if gate_up_bias.dtype != x.dtype or down_bias.dtype != x.dtype:
        raise TypeError(
            f"moe_experts clamped: biases must have the activations' dtype {x.dtype}; got {gate_up_bias.dtype} "
            f"and {down_bias.dtype}"
        )
    for name, value in (("limit", limit), ("alpha", alpha)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ValueError(f"moe_experts clamped: {name} must be a positive number, got {value!r}")


def _views(gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # [E, 2I, H] / [E, H, I] views for the shared shape, dtype and device checks of common.py.
    return gate_up_proj.transpose(1, 2), down_proj.transpose(1, 2)


# ---- eager: the oracle -------------------------------------------------------------------------------------


def _expert(
    rows: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    limit: float,
    alpha: float,
) -> torch.Tensor:
    return clamped_swiglu(rows @ w1 + b1, limit, alpha) @ w2 + b2


def moe_experts_clamped_grouped_eager(
    x: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    gate_up_proj: torch.Tensor,
    gate_up_bias: torch.Tensor,
    down_proj: torch.Tensor,
    down_bias: torch.Tensor,
    *,
    limit: float,
    alpha: float,
) -> torch.Tensor:
    """Each expert on its contiguous run of rows (see the module doc); syncs to read the counts. ``[N, H]``."""
    _as_standard(x, gate_up_proj, gate_up_bias, down_proj, down_bias, limit, alpha)
    check_grouped_inputs(x, tokens_per_expert, *_views(gate_up_proj, down_proj))
    counts = tokens_per_expert.tolist()
    params = zip(gate_up_proj, gate_up_bias, down_proj, down_bias, strict=True)
    outs = [_expert(rows, *p, limit, alpha) for rows, p in zip(torch.split(x, counts), params, strict=True)]
    return torch.cat(outs)


def moe_experts_clamped_routed_eager(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    gate_up_bias: torch.Tensor,
    down_proj: torch.Tensor,
    down_bias: torch.Tensor,
    *,
    limit: float,
    alpha: float,
) -> torch.Tensor:
    """Each token through its ``k`` experts, ``sum_j w[t, j] * y[t, j]`` in fp32. ``[T, H]`` in hidden's dtype."""
    _as_standard(hidden, gate_up_proj, gate_up_bias, down_proj, down_bias, limit, alpha)
    check_routed_inputs(hidden, top_k_index, top_k_weights, *_views(gate_up_proj, down_proj))
    tokens, top_k = top_k_index.shape
    acc = torch.promote_types(hidden.dtype, torch.float32)
    flat_ids = top_k_index.reshape(-1)
    rows = hidden.new_zeros(tokens * top_k, hidden.shape[1], dtype=acc)
    for expert in range(gate_up_proj.shape[0]):
        pairs = (flat_ids == expert).nonzero().squeeze(1)
        if pairs.numel() == 0:
            continue
        params = (gate_up_proj[expert], gate_up_bias[expert], down_proj[expert], down_bias[expert])
        rows = rows.index_put((pairs,), _expert(hidden[pairs // top_k], *params, limit, alpha).to(acc))
    combined = (rows.view(tokens, top_k, rows.shape[1]) * top_k_weights.to(acc).unsqueeze(-1)).sum(1)
    return combined.to(hidden.dtype)


# ---- the fast backends' shared composition -----------------------------------------------------------------


def _rows(
    x: torch.Tensor,
    offsets: torch.Tensor,
    row_expert: torch.Tensor,
    params: Params,
    limit: float,
    alpha: float,
    linear: Linear,
    bias: BiasRows,
) -> torch.Tensor:
    """``[N, H]`` expert-major rows -> ``y [N, H]`` (biases included, no routing weight)."""
    gate_up_proj, gate_up_bias, down_proj, down_bias = params
    gu = linear(x, offsets, gate_up_proj) + bias(gate_up_bias, row_expert, offsets)
    h = clamped_swiglu(gu, limit, alpha)
    return linear(h, offsets, down_proj) + bias(down_bias, row_expert, offsets)


def _routed(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    params: Params,
    limit: float,
    alpha: float,
    linear: Linear,
    bias: BiasRows,
) -> torch.Tensor:
    from veomni.kernels.moe_experts.torch_impl import gather_rows

    tokens, top_k = top_k_index.shape
    order, offsets = expert_major_order(top_k_index, params[0].shape[0])
    unsort = inverse_permutation(order)
    x = gather_rows(hidden, order // top_k, unsort, top_k)
    y = _rows(x, offsets, top_k_index.reshape(-1)[order], params, limit, alpha, linear, bias)
    # The routing weights are permuted like the rows, with a gather for a backward too (indexing's backward is a
    # scatter-add). bf16 rows times fp32 weights: the product is taken in fp32 (type promotion) without an fp32
    # copy of y in eager; inductor fuses it with the gather and the sum either way.
    acc = torch.promote_types(y.dtype, torch.float32)
    row_weights = gather_rows(top_k_weights.reshape(-1), order, unsort, 1)
    weighted = y * row_weights.to(acc).unsqueeze(-1)
    rows = gather_rows(weighted, unsort, order, 1).view(tokens, top_k, y.shape[1])
    return rows.sum(1).to(hidden.dtype)


def _grouped(
    x: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    params: Params,
    limit: float,
    alpha: float,
    linear: Linear,
    bias: BiasRows,
) -> torch.Tensor:
    experts = params[0].shape[0]
    offsets = group_offsets(tokens_per_expert)
    ids = torch.arange(experts, device=x.device)
    # output_size makes repeat_interleave sync-free; the counts are checked to sum to N on the device.
    row_expert = torch.repeat_interleave(ids, tokens_per_expert, output_size=x.shape[0])
    return _rows(x, offsets, row_expert, params, limit, alpha, linear, bias)


# ---- torch._grouped_mm -------------------------------------------------------------------------------------


def _torch_linear(x: torch.Tensor, offsets: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from veomni.kernels.moe_experts.torch_impl import _GroupedMM

    # _GroupedMM multiplies by w[e]^T for w [E, out, in]; the transposed view of [E, in, out] is exactly that.
    out: torch.Tensor = _GroupedMM.apply(x, offsets[1:], w.transpose(-2, -1))
    return out


def _torch_bias(bias: torch.Tensor, row_expert: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    from veomni.kernels.moe_experts.torch_impl import expert_bias_rows

    return expert_bias_rows(bias, row_expert, offsets[1:])


def _check_torch(x: torch.Tensor, gate_up_proj: torch.Tensor) -> None:
    from veomni.kernels.moe_experts.torch_impl import _check_layout

    _check_layout(x, gate_up_proj.transpose(1, 2))


def moe_experts_clamped_routed_torch(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    gate_up_bias: torch.Tensor,
    down_proj: torch.Tensor,
    down_bias: torch.Tensor,
    *,
    limit: float,
    alpha: float,
) -> torch.Tensor:
    """`moe_experts_clamped_routed_eager` on ``torch._grouped_mm`` (16-byte row strides: see torch_impl)."""
    params = (gate_up_proj, gate_up_bias, down_proj, down_bias)
    _as_standard(hidden, *params, limit, alpha)
    check_routed_inputs(hidden, top_k_index, top_k_weights, *_views(gate_up_proj, down_proj))
    _check_torch(hidden, gate_up_proj)
    return _routed(hidden, top_k_index, top_k_weights, params, limit, alpha, _torch_linear, _torch_bias)


def moe_experts_clamped_grouped_torch(
    x: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    gate_up_proj: torch.Tensor,
    gate_up_bias: torch.Tensor,
    down_proj: torch.Tensor,
    down_bias: torch.Tensor,
    *,
    limit: float,
    alpha: float,
) -> torch.Tensor:
    """`moe_experts_clamped_grouped_eager` on ``torch._grouped_mm``."""
    params = (gate_up_proj, gate_up_bias, down_proj, down_bias)
    _as_standard(x, *params, limit, alpha)
    check_grouped_inputs(x, tokens_per_expert, *_views(gate_up_proj, down_proj))
    _check_torch(x, gate_up_proj)
    return _grouped(x, tokens_per_expert, params, limit, alpha, _torch_linear, _torch_bias)


# ---- Triton grouped GEMMs ----------------------------------------------------------------------------------


class _TritonGroupedLinear(torch.autograd.Function):
    """``y = x_e @ w[e]`` per expert-major group: ``x [N, K]``, ``w [E, K, n_out]``, ``offsets [E + 1]`` int32."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, offsets: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        from veomni.kernels.moe_experts import triton_kernels as kern
        from veomni.kernels.moe_experts.configs import kernel_config

        x, w = x.contiguous(), w.contiguous()
        ctx.save_for_backward(x, offsets, w)
        return kern.rows_gemm(x, offsets, w, False, None, kernel_config("down", x.dtype, x.device))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, torch.Tensor | None]:
        from veomni.kernels.moe_experts import triton_kernels as kern
        from veomni.kernels.moe_experts.configs import kernel_config

        x, offsets, w = ctx.saved_tensors
        need_x, _, need_w = ctx.needs_input_grad
        grad = grad.contiguous()
        grad_x = grad_w = None
        if need_x:
            grad_x = kern.rows_gemm(
                grad, offsets, w, True, None, kernel_config("up_dgrad", x.dtype, x.device)
            )
        if need_w:
            cfg = kernel_config("wgrad_down", x.dtype, x.device)
            grad_w = kern.wgrad(x, None, grad, None, 1, offsets, w.shape[0], cfg)
        return grad_x, None, grad_w


def _triton_linear(x: torch.Tensor, offsets: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = _TritonGroupedLinear.apply(x, offsets, w)
    return out


def _triton_row_sums(grad: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``grad [N, C]`` expert-major with ``offsets [E + 1]`` int32 -> ``[E, C]`` per-expert row sums, by our Triton
    wgrad kernel (``ones^T @ g`` per expert), so the triton backend never calls ``torch._grouped_mm`` (a host sync
    in fp32 on CUDA)."""
    from veomni.kernels.moe_experts import triton_kernels as kern
    from veomni.kernels.moe_experts.configs import kernel_config

    grad = grad.contiguous()
    # 16 rows of ones: the smallest operand tl.dot takes; every row of the [E, 16, C] product is the sum.
    ones = grad.new_ones(grad.shape[0], 16)
    cfg = kernel_config("wgrad_down", grad.dtype, grad.device)
    return kern.wgrad(ones, None, grad, None, 1, offsets, offsets.shape[0] - 1, cfg)[:, 0].contiguous()


_TritonExpertBias = expert_bias_function("_TritonExpertBias", _triton_row_sums)


def _triton_bias(bias: torch.Tensor, row_expert: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = _TritonExpertBias.apply(bias, row_expert, offsets)
    return out


def _check_triton(x: torch.Tensor) -> None:
    from veomni.kernels.moe_experts.triton_impl import _check_device

    _check_device(x)


def moe_experts_clamped_routed_triton(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    gate_up_bias: torch.Tensor,
    down_proj: torch.Tensor,
    down_bias: torch.Tensor,
    *,
    limit: float,
    alpha: float,
) -> torch.Tensor:
    """`moe_experts_clamped_routed_eager` on our Triton grouped GEMMs (no host syncs; any H, I)."""
    params = (gate_up_proj, gate_up_bias, down_proj, down_bias)
    _as_standard(hidden, *params, limit, alpha)
    check_routed_inputs(hidden, top_k_index, top_k_weights, *_views(gate_up_proj, down_proj))
    _check_triton(hidden)
    return _routed(hidden, top_k_index, top_k_weights, params, limit, alpha, _triton_linear, _triton_bias)


def moe_experts_clamped_grouped_triton(
    x: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    gate_up_proj: torch.Tensor,
    gate_up_bias: torch.Tensor,
    down_proj: torch.Tensor,
    down_bias: torch.Tensor,
    *,
    limit: float,
    alpha: float,
) -> torch.Tensor:
    """`moe_experts_clamped_grouped_eager` on our Triton grouped GEMMs."""
    params = (gate_up_proj, gate_up_bias, down_proj, down_bias)
    _as_standard(x, *params, limit, alpha)
    check_grouped_inputs(x, tokens_per_expert, *_views(gate_up_proj, down_proj))
    _check_triton(x)
    return _grouped(x, tokens_per_expert, params, limit, alpha, _triton_linear, _triton_bias)


__all__ = [
    "clamped_swiglu",
    "moe_experts_clamped_grouped_eager",
    "moe_experts_clamped_grouped_torch",
    "moe_experts_clamped_grouped_triton",
    "moe_experts_clamped_routed_eager",
    "moe_experts_clamped_routed_torch",
    "moe_experts_clamped_routed_triton",
]
