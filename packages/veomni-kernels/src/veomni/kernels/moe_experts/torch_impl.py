"""MoE experts on ``torch._grouped_mm`` (one grouped GEMM per projection, offsets on the device).

Where this torch runs it (checked on torch 2.11 and 2.15):
- CUDA, bf16 on sm_90 / sm_100: CUTLASS grouped GEMMs, no host sync. This is the training path.
- CUDA, fp32 / fp16 (or other GPUs): torch's fallback, which copies the offsets to the host and loops over
  experts: correct, but ONE HOST SYNC PER GEMM. Use the ``triton`` backend there.
- CPU (fp32 / bf16 / fp16): torch's loop kernel.
In every case the row strides must be multiples of 16 bytes (``H`` and ``I`` multiples of 8 in bf16, of 4 in
fp32); other shapes are refused with an error. fp64 is not supported by ``_grouped_mm``.

Each grouped GEMM has our autograd (`_GroupedMM`): dgrad and wgrad are grouped GEMMs too (the wgrad in the 2-D x
2-D form, jagged along the reduction dim), and a frozen weight skips its wgrad. SwiGLU is plain torch. The routed
variant permutes with gathers whose backward gathers through the inverse permutation and sums each token's ``k``
rows (deterministic, no atomics), and scales ``silu(gate) * up`` by the routing weight before the down GEMM, so
the combine is a sum over each token's ``k`` rows with an fp32 accumulator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from veomni.kernels.moe_experts.common import (
    check_grouped_inputs,
    check_routed_inputs,
    expert_major_order,
    group_offsets,
    inverse_permutation,
)

_SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)

# A differentiable grouped GEMM ``mm(x [N, K], ends [E] int32, w [E, n_out, K]) -> [N, n_out]``
# (see `_GroupedMM`).
GroupedMM = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _check_layout(x: torch.Tensor, gate_up_proj: torch.Tensor) -> None:
    if x.dtype not in _SUPPORTED:
        raise TypeError(f"moe_experts 'torch' (torch._grouped_mm) supports {list(_SUPPORTED)}, got {x.dtype}")
    hidden, inter = gate_up_proj.shape[2], gate_up_proj.shape[1] // 2
    per_16_bytes = 16 // x.element_size()
    if hidden % per_16_bytes or inter % per_16_bytes:
        raise ValueError(
            f"moe_experts 'torch': torch._grouped_mm needs 16-byte row strides, i.e. H and I multiples of "
            f"{per_16_bytes} for {x.dtype}; got H={hidden}, I={inter}. Use the 'triton' or 'eager' backend"
        )


class _GroupedMM(torch.autograd.Function):
    """``x [N, K]`` (expert-major) times ``w[e]^T`` (``w [E, n_out, K]``) per group; ``ends [E]`` int32."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ends: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, ends, w)
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, torch.Tensor | None]:
        x, ends, w = ctx.saved_tensors
        need_x, _, need_w = ctx.needs_input_grad
        grad = grad.contiguous()
        grad_x = torch._grouped_mm(grad, w, offs=ends) if need_x else None
        grad_w = _weight_grad(x, grad, ends, w) if need_w else None
        return grad_x, None, grad_w


def _weight_grad(x: torch.Tensor, grad: torch.Tensor, ends: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``dw [E, n_out, K]`` for ``w [E, n_out, K]``, in w's memory layout: 2-D x 2-D grouped GEMMs, jagged along
    the reduction (row) dim. A gradient laid out unlike its parameter is copied whole by autograd's gradient
    accumulation (``param.grad``), so the GEMM writes the layout the parameter has: ``[n_out, N] x [N, K]`` for a
    contiguous ``w``, or ``[K, N] x [N, n_out]`` seen transposed for a transposed view of a ``[E, K, n_out]``
    parameter (gpt-oss's experts)."""
    if w.stride(-2) == 1 and w.stride(-1) != 1:
        return torch._grouped_mm(x.t(), grad, offs=ends).transpose(-2, -1)
    return torch._grouped_mm(grad.t(), x, offs=ends)


def expert_row_sums(rows: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``[N, C]`` expert-major rows -> ``[E, C]``, the sum of each expert's run of rows (zeros for an expert with
    no rows): a grouped GEMM ``rows_e^T x ones [N_e, W]`` per expert, so each sum accumulates in fp32 and rounds
    once, in a fixed order (no atomics, no host sync on the CUTLASS path).

    Args:
        rows: ``[N, C]`` float (``C`` with 16-byte row strides, as every ``torch._grouped_mm`` operand).
        ends: ``[E]`` int32, where each expert's rows end (``offsets[1:]``).
    Returns:
        ``[E, C]`` contiguous, in rows' dtype.
    """
    # rows^T [C, N] x ones [N, W] per expert, jagged along N: the operands of the wgrad in `_GroupedMM`'s backward,
    # laid out the same way (the jagged dim never the contiguous one, which CUTLASS would need 16-byte aligned per
    # expert). W = 16 bytes / element keeps the ones' rows 16-byte strided; every column of the [E, C, W] product
    # is the same sum, and the first is kept. (ones^T x rows, the other way round, left inductor free to lay the
    # ones out [W, N] contiguous: a device-side alignment assert on an H200.)
    width = 16 // rows.element_size()
    ones = rows.new_ones(rows.shape[0], width)
    return torch._grouped_mm(rows.contiguous().t(), ones, offs=ends)[:, :, 0].contiguous()


def expert_bias_function(
    name: str, row_sums: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> type[torch.autograd.Function]:
    """An autograd Function ``(bias [E, C], row_expert [N], table) -> [N, C]``: ``bias[e]`` on each row of expert
    ``e``, rows expert-major, ``table`` the expert boundaries that ``row_sums(grad [N, C], table) -> [E, C]`` reads.

    The forward is the gather ``index_select`` does (fused into the bias add under ``torch.compile``); the
    backward sums each expert's rows with ``row_sums`` instead of ``index_select``'s scatter-add, which on CUDA
    is an ``index_add_`` of ``N`` rows onto ``E`` with atomics (run-to-run different bits, and, in bf16 before
    torch's BF16 ``index_add`` lowering on sm_90, an unfused ATen kernel under inductor). Backends differ only in
    the kernel behind ``row_sums`` (``torch._grouped_mm`` here, our Triton wgrad for the clamped experts). The
    class is called ``name`` (its autograd node ``name + "Backward"``), so each backend's node reads as its own.
    """

    def forward(ctx: Any, bias: torch.Tensor, row_expert: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(table)
        return bias.index_select(0, row_expert)

    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        (table,) = ctx.saved_tensors
        grad_bias = row_sums(grad, table) if ctx.needs_input_grad[0] else None
        return grad_bias, None, None

    # type(): autograd names the node class after the Function's name when the class is created.
    body = {"forward": staticmethod(forward), "backward": staticmethod(backward), "__module__": __name__}
    return type(name, (torch.autograd.Function,), body)


_ExpertBias = expert_bias_function("_ExpertBias", expert_row_sums)


def expert_bias_rows(bias: torch.Tensor, row_expert: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``bias [E, C]`` gathered to ``[N, C]`` by ``row_expert [N]`` (expert-major, runs ending at ``ends [E]``
    int32); its gradient is the per-expert row sum (`expert_row_sums`), deterministic."""
    out: torch.Tensor = _ExpertBias.apply(bias, row_expert, ends)
    return out


class _GatherRows(torch.autograd.Function):
    """``x[index]``; backward gathers through ``inverse`` and sums each run of ``fold`` rows (no atomics)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, fold: int
    ) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.fold, ctx.rows = fold, x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (inverse,) = ctx.saved_tensors
        grad_x = grad.index_select(0, inverse)
        if ctx.fold > 1:
            grad_x = grad_x.view(ctx.rows, ctx.fold, grad_x.shape[1]).sum(1)
        return grad_x, None, None, None


def gather_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, fold: int) -> torch.Tensor:
    """``x[index]`` (``index`` 1-D int64) with `_GatherRows`'s deterministic backward."""
    out: torch.Tensor = _GatherRows.apply(x, index, inverse, fold)
    return out


def run_experts(
    x: torch.Tensor,
    offsets: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    row_weights: torch.Tensor | None = None,
    mm: GroupedMM = _GroupedMM.apply,
) -> torch.Tensor:
    """SwiGLU experts over expert-major rows ``x [N, H]`` with group ``offsets [E + 1]``; ``mm(x, ends, w)`` is the
    differentiable grouped GEMM (``torch._grouped_mm`` here, ``npu_grouped_matmul`` in the npu backend).
    ``row_weights [N]`` (optional) scale each row before the down GEMM. Returns ``[N, H]``."""
    ends = offsets[1:]
    gate, up = mm(x, ends, gate_up_proj).chunk(2, dim=-1)
    h = F.silu(gate) * up
    if row_weights is not None:
        # The routing weight scales h before the down GEMM (as in the triton backend), so the combine is a plain
        # sum and no fp32 copy of the [N, H] rows is made.
        h = h * row_weights.to(h.dtype).unsqueeze(-1)
    return mm(h, ends, down_proj)


def moe_experts_grouped_torch(
    x: torch.Tensor, tokens_per_expert: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor
) -> torch.Tensor:
    """`moe_experts_grouped_eager`'s contract on ``torch._grouped_mm`` (see the module doc for devices).

    Args:
        x: ``[N, H]`` expert-major rows. tokens_per_expert: ``[E]`` int32/int64 on x's device.
        gate_up_proj: ``[E, 2I, H]``. down_proj: ``[E, H, I]`` (x's dtype; 16-byte row strides).
    Returns:
        ``[N, H]`` in x's dtype; differentiable w.r.t. x and the weights (frozen weights skip their wgrad).
    """
    check_grouped_inputs(x, tokens_per_expert, gate_up_proj, down_proj)
    _check_layout(x, gate_up_proj)
    return run_experts(x, group_offsets(tokens_per_expert), gate_up_proj, down_proj)


def moe_experts_routed_torch(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """`moe_experts_routed_eager`'s contract on ``torch._grouped_mm``.

    Args:
        hidden: ``[T, H]``. top_k_index: ``[T, k]`` int64. top_k_weights: ``[T, k]`` float.
        gate_up_proj: ``[E, 2I, H]``. down_proj: ``[E, H, I]`` (hidden's dtype; 16-byte row strides).
    Returns:
        ``[T, H]`` in hidden's dtype, the ``k`` outputs of a token combined in fp32.
    """
    check_routed_inputs(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj)
    _check_layout(hidden, gate_up_proj)
    return route_experts(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj)


def route_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    mm: GroupedMM = _GroupedMM.apply,
) -> torch.Tensor:
    """The routed variant around `run_experts` (inputs already checked): permute ``hidden [T, H]`` expert-major,
    run the experts with grouped GEMM ``mm``, un-permute and sum each token's ``k`` rows. Returns ``[T, H]``."""
    tokens, top_k = top_k_index.shape
    order, offsets = expert_major_order(top_k_index, gate_up_proj.shape[0])
    unsort = inverse_permutation(order)
    x = gather_rows(hidden, order // top_k, unsort, top_k)
    y = run_experts(x, offsets, gate_up_proj, down_proj, top_k_weights.reshape(-1)[order], mm=mm)
    # Back to (token, slot) order; torch sums low-precision rows with an fp32 accumulator and rounds once.
    rows = gather_rows(y, unsort, order, 1).view(tokens, top_k, y.shape[1])
    return rows.sum(1)
