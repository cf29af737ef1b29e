"""Triton RoPE (HF rotate-half layout) with a Triton backward, for full and partial rotary dims.

One program handles one ``(batch, position)`` row and a block of heads, of q or of k: grid axis 1 enumerates
the q head blocks first, then the k head blocks, so GQA (``Hkv != Hq``) needs no extra launch and the
cos/sin row is shared by every head of that position (it stays in L1/L2).

Dtype behaviour: q/k and cos/sin are loaded, converted to fp32, rotated in fp32 and rounded once to the
input dtype on store. The eager oracle (HF's formula) rounds each product in the input dtype, so in bf16 the
two differ by a few ulps; in fp32 they agree to ~1e-6.

The output is a new tensor laid out like the input (``empty_like`` keeps the strides of a dense input, e.g.
HF's ``[B, S, H, D]`` buffer seen through ``transpose(1, 2)``), so the caller's later transposes stay free.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from veomni.kernels.rope.eager import check_rope_inputs


@triton.jit
def _rope_head_block(
    x_ptr, o_ptr, x_sb, x_sh, x_ss, x_sd, o_sb, o_sh, o_ss, o_sd,
    b, s, h0, n_heads, c1, c2, s1, s2, half, n_pass,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, BACKWARD: tl.constexpr,
):  # fmt: skip
    # int64 head offsets: x_sh is S*D for a contiguous [B, H, S, D] tensor, which times H can pass 2**31.
    heads = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    head_mask = heads < n_heads
    mask = head_mask[:, None] & (dims < half)[None, :]
    x_row = x_ptr + b * x_sb + s * x_ss + heads[:, None] * x_sh
    o_row = o_ptr + b * o_sb + s * o_ss + heads[:, None] * o_sh
    x1 = tl.load(x_row + dims[None, :] * x_sd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + (dims[None, :] + half) * x_sd, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        # Transpose of the forward map. With HF's duplicated halves (c1 == c2, s1 == s2) this is the
        # rotation by -sin; written out in full it is also exact for arbitrary cos/sin.
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    out_ty = o_ptr.dtype.element_ty
    tl.store(o_row + dims[None, :] * o_sd, y1.to(out_ty), mask=mask)
    tl.store(o_row + (dims[None, :] + half) * o_sd, y2.to(out_ty), mask=mask)
    if BLOCK_PASS > 0:
        # Partial rotary: dims [2*half, D) are copied unchanged (identity forward and backward).
        pdims = 2 * half + tl.arange(0, BLOCK_PASS)
        pmask = head_mask[:, None] & (pdims < 2 * half + n_pass)[None, :]
        v = tl.load(x_row + pdims[None, :] * x_sd, mask=pmask, other=0.0)
        tl.store(o_row + pdims[None, :] * o_sd, v.to(out_ty), mask=pmask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr,
    S, HQ, HK, n_q_blocks,
    q_sb, q_sh, q_ss, q_sd, k_sb, k_sh, k_ss, k_sd,
    qo_sb, qo_sh, qo_ss, qo_sd, ko_sb, ko_sh, ko_ss, ko_sd,
    c_sb, c_ss, c_sd, s_sb, s_ss, s_sd,
    half, n_pass,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, BACKWARD: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    b = row // S
    s = row % S
    dims = tl.arange(0, BLOCK_HALF)
    dmask = dims < half
    # Both halves of cos/sin are loaded rather than assuming HF's duplication, so any cos/sin is exact.
    cos_row = cos_ptr + b * c_sb + s * c_ss
    sin_row = sin_ptr + b * s_sb + s * s_ss
    c1 = tl.load(cos_row + dims * c_sd, mask=dmask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_row + (dims + half) * c_sd, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_row + dims * s_sd, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_row + (dims + half) * s_sd, mask=dmask, other=0.0).to(tl.float32)[None, :]
    if blk < n_q_blocks:
        _rope_head_block(
            q_ptr, qo_ptr, q_sb, q_sh, q_ss, q_sd, qo_sb, qo_sh, qo_ss, qo_sd,
            b, s, blk * BLOCK_H, HQ, c1, c2, s1, s2, half, n_pass,
            BLOCK_H, BLOCK_HALF, BLOCK_PASS, BACKWARD,
        )  # fmt: skip
    else:
        _rope_head_block(
            k_ptr, ko_ptr, k_sb, k_sh, k_ss, k_sd, ko_sb, ko_sh, ko_ss, ko_sd,
            b, s, (blk - n_q_blocks) * BLOCK_H, HK, c1, c2, s1, s2, half, n_pass,
            BLOCK_H, BLOCK_HALF, BLOCK_PASS, BACKWARD,
        )  # fmt: skip


def _launch(
    q: torch.Tensor | None,
    k: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    backward: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Rotate ``q`` and/or ``k`` (either may be None: nothing is launched for it); returns new tensors."""
    ref = q if q is not None else k
    assert ref is not None
    b, _, s, d = ref.shape
    r = cos.shape[-1]
    # [S, R] and [1, S, R] become stride-0 views over the batch, so no copy is made.
    cos = (cos if cos.dim() == 3 else cos.unsqueeze(0)).expand(b, s, r)
    sin = (sin if sin.dim() == 3 else sin.unsqueeze(0)).expand(b, s, r)
    q_out = torch.empty_like(q) if q is not None else None
    k_out = torch.empty_like(k) if k is not None else None
    hq = q.shape[1] if q is not None else 0
    hk = k.shape[1] if k is not None else 0
    if b * s == 0 or hq + hk == 0 or d == 0:
        return q_out, k_out
    block_half = triton.next_power_of_2(r // 2)
    block_pass = triton.next_power_of_2(d - r) if d > r else 0
    # Up to ~1k rotated pairs per program (16 heads at D=128); fewer, fuller programs also keep Triton's
    # CPU interpreter, whose cost is per program, fast.
    block_h = min(triton.next_power_of_2(max(hq, hk)), max(1, 1024 // block_half))
    n_q_blocks = triton.cdiv(hq, block_h)
    n_k_blocks = triton.cdiv(hk, block_h)
    # A missing operand is replaced by the present one; its block count is 0, so it is never touched.
    qx, qo = (q, q_out) if q is not None else (k, k_out)
    kx, ko = (k, k_out) if k is not None else (q, q_out)
    # ref is given, so both pairs are tensors.
    assert qx is not None and kx is not None and qo is not None and ko is not None
    _rope_kernel[(b * s, n_q_blocks + n_k_blocks)](
        qx, kx, qo, ko, cos, sin,
        s, hq, hk, n_q_blocks,
        *qx.stride(), *kx.stride(), *qo.stride(), *ko.stride(),
        *cos.stride(), *sin.stride(),
        r // 2, d - r,
        BLOCK_H=block_h, BLOCK_HALF=block_half, BLOCK_PASS=block_pass, BACKWARD=backward,
    )  # fmt: skip
    return q_out, k_out


class _RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q_out, k_out = _launch(q, k, cos, sin, backward=False)
        assert q_out is not None and k_out is not None  # _launch returns an output for each given input
        # Only cos/sin are needed: the backward is linear in the upstream gradient.
        ctx.save_for_backward(cos, sin)
        return q_out, k_out

    @staticmethod
    def backward(
        ctx: Any, grad_q: torch.Tensor | None, grad_k: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        cos, sin = ctx.saved_tensors
        need_q = ctx.needs_input_grad[0] and grad_q is not None
        need_k = ctx.needs_input_grad[1] and grad_k is not None
        if not (need_q or need_k):
            return None, None, None, None
        dq, dk = _launch(grad_q if need_q else None, grad_k if need_k else None, cos, sin, backward=True)
        return dq, dk, None, None


def apply_rope_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    rotary_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding (HF rotate-half layout) by a Triton kernel, forward and backward.

    Args:
        q: ``[B, Hq, S, D]`` queries (fp32/bf16/fp16), any strides (HF passes ``transpose(1, 2)`` views).
        k: ``[B, Hkv, S, D]`` keys, same dtype; ``Hkv`` may differ from ``Hq`` (GQA).
        cos, sin: ``[B, S, R]``, ``[1, S, R]`` or ``[S, R]``, any float dtype, already gathered at each
            token's position id (packed sequences with restarting positions need nothing else).
        rotary_dim: ``R`` (default ``cos.shape[-1]``). ``R == D`` is the ``full`` variant; ``R < D`` the
            ``partial`` one: the first ``R`` dims of each head are rotated, the other ``D - R`` pass through.
    Returns:
        ``(q_out, k_out)``, new tensors with the shapes, dtype and (for dense inputs) strides of q and k.
        Math is fp32, rounded once to the input dtype. Gradients flow to q and k only: cos/sin are treated
        as constants (they come from position ids and a frequency buffer) and receive no gradient.
    """
    check_rope_inputs(q, k, cos, sin, rotary_dim)
    devices = {t.device for t in (q, k, cos, sin)}
    if len(devices) != 1:
        raise ValueError(f"q, k, cos and sin must be on one device; got {sorted(map(str, devices))}")
    if torch.compiler.is_compiling():
        # Under dynamo: the custom op, which it traces without a graph break (same kernel, same numbers).
        result: tuple[torch.Tensor, torch.Tensor] = _ops.rope(q, k, cos, sin, False)
        return result
    result = _RoPEFunction.apply(q, k, cos, sin)
    return result


# Last: `ops` registers the custom op and reads `_launch` above.
from veomni.kernels.rope import ops as _ops  # noqa: E402
