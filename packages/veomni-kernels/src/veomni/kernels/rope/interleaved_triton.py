"""Interleaved-pair RoPE (``rope/interleaved``, see `interleaved`) as a Triton kernel wrapped in the torch custom op
``veomni::rope_interleaved``, so that ``torch.compile(fullgraph=True)`` traces through it and eager calls run
the same kernel (one code path, bitwise equal results).

One program rotates one ``(batch, position)`` row for a block of heads of one tensor; the row's ``D/2`` angles
are loaded once and shared by every head. The rotary tables may be float64 (Wan's): they are read as they are
and converted in registers, so no fp32 copy of the table is made per call. The backward is the same kernel with
the transposed rotation (rotation by ``-θ``): RoPE is linear in q and k, and cos/sin get no gradient.
"""

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from veomni.kernels.rope.interleaved import check_interleaved_inputs, table_rows

__all__ = ["apply_rope_interleaved_triton", "rope_interleaved"]


@triton.jit
def _rope_interleaved_kernel(
    x_ptr, o_ptr, cos_ptr, sin_ptr, S, H,
    x_sb, x_ss, x_sh, x_sd, o_sb, o_ss, o_sh, o_sd, c_sb, c_ss, c_sd, s_sb, s_ss, s_sd,
    half, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BACKWARD: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    b = row // S
    s = row % S
    pairs = tl.arange(0, BLOCK_HALF)
    pmask = pairs < half
    # diffusers reads cos at the even dim and sin at the odd dim of each pair.
    c = tl.load(cos_ptr + b * c_sb + s * c_ss + (2 * pairs) * c_sd, mask=pmask, other=0.0).to(tl.float32)
    sn = tl.load(sin_ptr + b * s_sb + s * s_ss + (2 * pairs + 1) * s_sd, mask=pmask, other=0.0).to(tl.float32)
    if BACKWARD:
        sn = -sn
    heads = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    mask = (heads < H)[:, None] & pmask[None, :]
    x_row = x_ptr + b * x_sb + s * x_ss + heads[:, None] * x_sh
    o_row = o_ptr + b * o_sb + s * o_ss + heads[:, None] * o_sh
    even = (2 * pairs)[None, :]
    x1 = tl.load(x_row + even * x_sd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + (even + 1) * x_sd, mask=mask, other=0.0).to(tl.float32)
    out_ty = o_ptr.dtype.element_ty
    tl.store(o_row + even * o_sd, (x1 * c[None, :] - x2 * sn[None, :]).to(out_ty), mask=mask)
    tl.store(o_row + (even + 1) * o_sd, (x1 * sn[None, :] + x2 * c[None, :]).to(out_ty), mask=mask)


def _launch(x: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> Tensor:
    b, s, h, d = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    cos, sin = table_rows(cos, b), table_rows(sin, b)
    block_half = triton.next_power_of_2(d // 2)
    # Up to ~1k pairs per program (16 heads at D=128): fuller programs, and fewer of them for the interpreter.
    block_h = min(triton.next_power_of_2(h), max(1, 1024 // block_half))
    _rope_interleaved_kernel[(b * s, triton.cdiv(h, block_h))](
        x, out, cos, sin, s, h, *x.stride(), *out.stride(), *cos.stride(), *sin.stride(), d // 2,
        BLOCK_H=block_h, BLOCK_HALF=block_half, BACKWARD=backward,
    )  # fmt: skip
    return out


@torch.library.custom_op("veomni::rope_interleaved", mutates_args=())
def rope_interleaved(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> tuple[Tensor, Tensor]:
    """Rotate ``q [B, S, Hq, D]`` and ``k [B, S, Hk, D]`` pairwise by ``cos``/``sin`` (`interleaved` layouts);
    ``backward=True`` applies the transposed rotation (the gradient map). Returns new contiguous tensors."""
    return _launch(q, cos, sin, backward), _launch(k, cos, sin, backward)


@rope_interleaved.register_fake
def _(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    _q, _k, cos, sin, backward = inputs
    ctx.save_for_backward(cos, sin)
    ctx.backward = backward


def _backward(
    ctx: Any, grad_q: Tensor, grad_k: Tensor
) -> tuple[Tensor | None, Tensor | None, None, None, None]:
    cos, sin = ctx.saved_tensors
    dq, dk = rope_interleaved(grad_q.contiguous(), grad_k.contiguous(), cos, sin, not ctx.backward)
    return (
        (dq if ctx.needs_input_grad[0] else None),
        (dk if ctx.needs_input_grad[1] else None),
        None,
        None,
        None,
    )


rope_interleaved.register_autograd(_backward, setup_context=_setup)


def apply_rope_interleaved_triton(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """`interleaved.apply_rope_interleaved_eager`'s maths in one Triton kernel per tensor, forward and backward.

    Args:
        q: ``[B, S, Hq, D]`` (fp32/bf16/fp16), any strides (diffusers passes ``unflatten`` views); ``D`` even.
        k: ``[B, S, Hk, D]``, q's dtype.
        cos, sin: ``[S, D]``, ``[1, S, 1, D]`` or ``[B, S, 1, D]``, any float dtype (float64 is read as is).
    Returns:
        ``(q_out, k_out)``, new contiguous tensors; fp32 math rounded once. Gradients flow to q and k only
        (cos/sin are position tables and get none).
    """
    check_interleaved_inputs(q, k, cos, sin)
    devices = {t.device for t in (q, k, cos, sin)}
    if len(devices) != 1:
        raise ValueError(
            f"interleaved rope: q, k, cos and sin must be on one device; got {sorted(map(str, devices))}"
        )
    result: tuple[Tensor, Tensor] = rope_interleaved(q, k, cos, sin, False)
    return result
