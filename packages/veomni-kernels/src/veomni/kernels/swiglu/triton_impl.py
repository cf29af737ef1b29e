"""Triton SwiGLU, ``silu(gate) * up``, with a backward that recomputes ``silu`` instead of saving it.

Eager autograd keeps three ``[..., I]`` tensors for the backward (gate, up and silu(gate)) and builds one
more temporary in it; this one keeps only gate and up and writes both gradients from one kernel. All math
is fp32; results are rounded once to the input dtype (the eager oracle rounds silu(gate) first, so bf16
results differ by about one ulp).

Layout: the last dim must be unit-stride; the leading dims are flattened to rows, keeping their row stride
when that is possible without a copy (e.g. the two halves of a merged gate/up projection, ``chunk(2, -1)``).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from veomni.kernels.swiglu.eager import check_swiglu_inputs

# Columns per program: wide enough for full-bandwidth vector loads, small enough to keep registers low.
_MAX_BLOCK = 1024


@triton.jit
def _swiglu_fwd_kernel(
    g_ptr, u_ptr, o_ptr, g_row_stride, u_row_stride, o_row_stride, n_cols, BLOCK: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(g_ptr + row * g_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    out = g * tl.sigmoid(g) * u
    tl.store(o_ptr + row * o_row_stride + cols, out.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr,
    dy_row_stride, g_row_stride, u_row_stride, dg_row_stride, du_row_stride,
    n_cols, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dy = tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * g_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    # d silu/dg = sig * (1 + g * (1 - sig)) = sig + silu * (1 - sig)
    dg = dy * u * (sig + silu * (1.0 - sig))
    du = dy * silu
    tl.store(dg_ptr + row * dg_row_stride + cols, dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + row * du_row_stride + cols, du.to(du_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[..., I]`` -> ``[M, I]`` with a unit last stride, as a view when possible (a copy otherwise)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    x2 = x.reshape(-1, x.shape[-1])
    # A single row (or an empty tensor) may report any row stride; kernels only use it for rows < M.
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _grid(m: int, n: int) -> tuple[int, int, int]:
    block = min(_MAX_BLOCK, triton.next_power_of_2(n))
    return m, triton.cdiv(n, block), block


def forward_rows(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u`` for ``[M, I]`` rows with a unit last stride (`_rows`); returns a new contiguous ``[M, I]``."""
    m, n = g.shape
    out = torch.empty((m, n), dtype=g.dtype, device=g.device)
    if out.numel() > 0:
        rows, col_blocks, block = _grid(m, n)
        strides = (g.stride(0), u.stride(0), out.stride(0))
        _swiglu_fwd_kernel[(rows, col_blocks)](g, u, out, *strides, n, BLOCK=block)
    return out


def backward_rows(
    grad_out: torch.Tensor, g: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients for ``[M, I]`` rows ``g``, ``u`` (`_rows`) from ``grad_out [..., I]``: new contiguous ``[M, I]``."""
    m, n = g.shape
    dy = _rows(grad_out)
    dg = torch.empty_like(g, memory_format=torch.contiguous_format)
    du = torch.empty_like(u, memory_format=torch.contiguous_format)
    if dg.numel() > 0:
        rows, col_blocks, block = _grid(m, n)
        _swiglu_bwd_kernel[(rows, col_blocks)](
            dy, g, u, dg, du,
            dy.stride(0), g.stride(0), u.stride(0), dg.stride(0), du.stride(0),
            n, BLOCK=block,
        )  # fmt: skip
    return dg, du


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        g, u = _rows(gate), _rows(up)
        out = forward_rows(g, u)
        # The memory saving: only the two inputs are kept, silu(gate) is recomputed in backward.
        ctx.save_for_backward(g, u)
        ctx.shape = gate.shape
        return out.view(gate.shape)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g, u = ctx.saved_tensors
        dg, du = backward_rows(grad_out, g, u)
        return dg.view(ctx.shape), du.view(ctx.shape)


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` by a Triton kernel, with a memory-saving Triton backward.

    Args:
        gate, up: ``[..., I]``, one shape and one float dtype (fp32/bf16/fp16), on the kernel's device; the
            last dim should be unit-stride (other layouts are copied first).
    Returns:
        ``[..., I]`` contiguous, in the input dtype (fp32 math, one rounding). The backward saves only
        ``gate`` and ``up`` and returns contiguous ``d gate`` and ``d up`` in the input dtype.
    """
    check_swiglu_inputs(gate, up)
    if torch.compiler.is_compiling():
        # Under dynamo: the custom ops, which it traces without a graph break (same kernels, same numbers).
        result: torch.Tensor = _ops.swiglu_fwd(gate, up)
        return result
    result = _SwiGLUFunction.apply(gate, up)
    return result


# Last: `ops` registers the custom ops and reads the row functions above.
from veomni.kernels.swiglu import ops as _ops  # noqa: E402
