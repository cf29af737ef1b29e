"""Reference MoE experts: a plain loop over experts (the oracle of every other backend; it syncs with the host).

Rounding points, which the fast backends reproduce: each GEMM's output is rounded to the activation dtype
(as ``F.linear`` does), ``silu(gate) * up`` is evaluated in that dtype, and the routed variant combines the
``k`` expert outputs of a token as ``sum_j w[t, j] * y[t, j]`` in fp32 (fp64 for fp64 inputs), rounding once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from veomni.kernels.moe_experts.common import check_grouped_inputs, check_routed_inputs


def _expert(rows: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(rows, w_gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w_down)


def moe_experts_grouped_eager(
    x: torch.Tensor, tokens_per_expert: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor
) -> torch.Tensor:
    """``down_e(silu(gate_e(x)) * up_e(x))`` for each expert ``e`` on its contiguous run of rows.

    Args:
        x: ``[N, H]`` rows grouped by expert: ``tokens_per_expert[0]`` rows of expert 0, then expert 1, ...
        tokens_per_expert: ``[E]`` int32/int64 on x's device, summing to ``N`` (read back to the host here).
        gate_up_proj: ``[E, 2I, H]`` fused gate (first ``I`` rows) and up projections, x's dtype.
        down_proj: ``[E, H, I]``, x's dtype.
    Returns:
        ``[N, H]`` in ``x.dtype``; differentiable w.r.t. ``x`` and both weights.
    """
    check_grouped_inputs(x, tokens_per_expert, gate_up_proj, down_proj)
    counts = tokens_per_expert.tolist()
    outputs = [
        _expert(rows, w_gate_up, w_down)
        for rows, w_gate_up, w_down in zip(torch.split(x, counts), gate_up_proj, down_proj, strict=True)
    ]
    return torch.cat(outputs)


def moe_experts_routed_eager(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """Each token through its ``k`` selected experts, summed with its routing weights.

    Args:
        hidden: ``[T, H]`` float (T may be 0).
        top_k_index: ``[T, k]`` int64 expert ids in ``[0, E)``; a token may pick one expert twice.
        top_k_weights: ``[T, k]`` float, any float dtype (used in fp32).
        gate_up_proj: ``[E, 2I, H]``, hidden's dtype. down_proj: ``[E, H, I]``, hidden's dtype.
    Returns:
        ``[T, H]`` in hidden's dtype: ``out[t] = sum_j top_k_weights[t, j] * expert_{top_k_index[t, j]}(hidden[t])``
        accumulated in fp32. Differentiable w.r.t. hidden, top_k_weights and both weights.
    """
    check_routed_inputs(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj)
    tokens, top_k = top_k_index.shape
    acc = torch.promote_types(hidden.dtype, torch.float32)
    flat_ids = top_k_index.reshape(-1)
    rows = hidden.new_zeros(tokens * top_k, hidden.shape[1], dtype=acc)
    for expert in range(gate_up_proj.shape[0]):
        pairs = (flat_ids == expert).nonzero().squeeze(1)  # flat (token, slot) indices, token order
        if pairs.numel() == 0:
            continue
        out = _expert(hidden[pairs // top_k], gate_up_proj[expert], down_proj[expert])
        rows = rows.index_put((pairs,), out.to(acc))
    combined = (rows.view(tokens, top_k, rows.shape[1]) * top_k_weights.to(acc).unsqueeze(-1)).sum(1)
    return combined.to(hidden.dtype)
