"""Triton kernels of the `moe_experts` triton backend: grouped GEMMs (forward, dgrad, wgrad) and a row sum.

Scheduling is done on the device. A row-GEMM launch has ``(cdiv(N, BLOCK_M) + min(E, N)) * cdiv(n_out,
BLOCK_N)`` programs, an upper bound on the row tiles of any split of ``N`` rows over ``E`` experts; each reads the
``E + 1`` group offsets, finds its expert and row tile with a prefix sum in registers, and exits when it has no
tile. No counts are read back to the host and no tile list is built by extra launches.

Row permutation is fused into loads and stores: kernels reading token rows gather them through the expert-major
``order`` (``hidden[order // k]``, ``grad_out[order // k]``); the down GEMM and the up dgrad scatter row ``m``
to (token, slot) position ``order[m]``, so each token's ``k`` rows are contiguous for the final sum.

Routing weights are folded into the SwiGLU output: the gate/up epilogue writes ``hw = w * silu(g) * u``, so
the down GEMM yields weighted rows and the combine is a plain sum. In the backward the down dgrad's product
``acc = grad_out[t] @ W2[e]`` is ``d hw``; from it and the saved pre-activations (``h = silu(g) * u``
recomputed) come ``d[g, u]`` (from ``w * acc``) and the routing-weight gradient ``<acc, h>``: either in the
GEMM's epilogue (one fp32 partial per column tile, summed afterwards), or, with the ``SPLIT`` config (the sm_90
default, see configs.py), in `_swiglu_bwd_kernel` after a plain GEMM writes ``dh [N, I]``.
``dW2 = grad_out[t]^T @ hw`` needs no weighted copy of anything.

Every GEMM accumulates in fp32 and rounds once to the activation dtype. fp32 inputs use IEEE fp32 dots (no
TF32), so fp32 results match the eager oracle to fp32 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from veomni.kernels.moe_experts.configs import KernelConfig, interpreting


@triton.jit
def _locate_tile(offsets_ptr, pid_m, num_experts, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr):
    """``(total_tiles, expert, row_start, row_end)`` for the ``pid_m``-th row tile over all experts' groups."""
    es = tl.arange(0, E_POW2)
    real = es < num_experts
    starts = tl.load(offsets_ptr + es, mask=real, other=0)
    ends = tl.load(offsets_ptr + es + 1, mask=real, other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    last = tl.cumsum(tiles, 0)  # inclusive: tiles of experts 0..e
    expert = tl.sum((last <= pid_m).to(tl.int32), 0)
    first = tl.sum(tl.where(es < expert, tiles, 0), 0)
    row_start = tl.sum(tl.where(es == expert, starts, 0), 0) + (pid_m - first) * BLOCK_M
    row_end = tl.sum(tl.where(es == expert, ends, 0), 0)
    return tl.sum(tiles, 0), expert, row_start, row_end


@triton.jit
def _swiglu_h(g, u, out_ty: tl.constexpr):
    """``silu(g) * u`` in fp32 with the eager oracle's rounding points (silu rounded, then the product)."""
    silu = (g * tl.sigmoid(g)).to(out_ty).to(tl.float32)
    return (silu * u).to(out_ty).to(tl.float32)


@triton.jit
def _gate_up_kernel(
    a_ptr, idx_ptr, w1_ptr, rw_ptr, gu_ptr, hw_ptr, offsets_ptr,
    num_experts, inter, k_dim, stride_am, stride_we,
    GATHER: tl.constexpr, TOP_K: tl.constexpr, HAS_RW: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """``gu[m] = a[src(m)] @ W1[e]^T`` (``[E, 2I, H]``), ``hw[m, j] = rw[m] * silu(gu[m, j]) * gu[m, I + j]``."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(inter, BLOCK_N)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    total_tiles, expert, row_start, row_end = _locate_tile(offsets_ptr, pid_m, num_experts, E_POW2, BLOCK_M)
    if pid_m >= total_tiles:
        return
    rows = row_start + tl.arange(0, BLOCK_M)
    # Rows and columns past the end compute values that are never stored: clamping keeps the hot loop's loads
    # in bounds without masks.
    safe_rows = tl.minimum(rows, row_end - 1)
    if GATHER:
        pair = tl.load(idx_ptr + safe_rows)  # flat (token, slot) index
        src = pair // TOP_K
    else:
        src = safe_rows
    # Columns are not clamped like rows: clamping would hide their contiguity from Triton and scalarise the
    # loads of operands laid out along them. Ragged edges are masked instead.
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + src.to(tl.int64)[:, None] * stride_am + ks[None, :]
    g_ptrs = w1_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * k_dim + ks[:, None]
    u_ptrs = g_ptrs + inter * k_dim
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        if EVEN_K and EVEN_N:
            a = tl.load(a_ptrs)
            wg = tl.load(g_ptrs)
            wu = tl.load(u_ptrs)
        else:
            k_ok = ks + k0 < k_dim
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            wg = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            wu = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        acc_g = tl.dot(a, wg, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, wu, acc_u, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    out_ty: tl.constexpr = gu_ptr.dtype.element_ty
    gate = acc_g.to(out_ty)
    up = acc_u.to(out_ty)
    h = _swiglu_h(gate.to(tl.float32), up.to(tl.float32), out_ty)
    if HAS_RW:
        h = h * tl.load(rw_ptr + pair).to(tl.float32)[:, None]
    out_rows = rows.to(tl.int64)[:, None]
    mask = (rows < row_end)[:, None] & col_ok[None, :]
    tl.store(gu_ptr + out_rows * (2 * inter) + cols[None, :], gate, mask=mask)
    tl.store(gu_ptr + out_rows * (2 * inter) + inter + cols[None, :], up, mask=mask)
    tl.store(hw_ptr + out_rows * inter + cols[None, :], h.to(out_ty), mask=mask)


@triton.jit
def _rows_gemm_kernel(
    a_ptr, idx_ptr, b_ptr, c_ptr, gu_ptr, rw_ptr, dw_ptr, offsets_ptr,
    num_experts, n_out, k_dim, stride_am, stride_be, stride_bk, stride_bn, stride_cm,
    GATHER_A: tl.constexpr, SCATTER_C: tl.constexpr, TOP_K: tl.constexpr,
    SWIGLU_BWD: tl.constexpr, HAS_RW: tl.constexpr, NEED_DW: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """``c[dst(m)] = a[src(m)] @ B[e]`` with ``B[e][k, n]`` at ``b + e*stride_be + k*stride_bk + n*stride_bn``.

    ``src(m) = idx[m] // TOP_K`` with GATHER_A, ``dst(m) = idx[m]`` with SCATTER_C (else ``m``). With SWIGLU_BWD
    the product is ``d hw`` and the epilogue writes ``d[g, u]`` (``[N, 2*n_out]``, expert-major) from the saved
    ``gu``, scaled by the routing weight ``rw[idx[m]]`` (HAS_RW), plus ``dw[idx[m], pid_n] = <acc, h>``.
    """
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(n_out, BLOCK_N)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    total_tiles, expert, row_start, row_end = _locate_tile(offsets_ptr, pid_m, num_experts, E_POW2, BLOCK_M)
    if pid_m >= total_tiles:
        return
    rows = row_start + tl.arange(0, BLOCK_M)
    safe_rows = tl.minimum(rows, row_end - 1)
    if GATHER_A or SCATTER_C or HAS_RW or NEED_DW:
        pair = tl.load(idx_ptr + safe_rows)
    src = pair // TOP_K if GATHER_A else safe_rows
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # not clamped: see _gate_up_kernel
    col_ok = cols < n_out
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + src.to(tl.int64)[:, None] * stride_am + ks[None, :]
    b_ptrs = b_ptr + expert.to(tl.int64) * stride_be + ks[:, None] * stride_bk + cols[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        if EVEN_K and EVEN_N:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = ks + k0 < k_dim
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    row_ok = rows < row_end
    mask = row_ok[:, None] & col_ok[None, :]
    out_ty: tl.constexpr = c_ptr.dtype.element_ty
    if SWIGLU_BWD:
        gu_row = gu_ptr + rows.to(tl.int64)[:, None] * (2 * n_out) + cols[None, :]
        g = tl.load(gu_row, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_row + n_out, mask=mask, other=0.0).to(tl.float32)
        if NEED_DW:
            # Masked columns load g = u = 0, so h = 0 there and they add nothing.
            part = tl.sum(acc * _swiglu_h(g, u, out_ty), 1)
            tl.store(dw_ptr + pair.to(tl.int64) * n_tiles + pid_n, part, mask=row_ok)
        if HAS_RW:
            acc = acc * tl.load(rw_ptr + pair).to(tl.float32)[:, None]
        sig = tl.sigmoid(g)
        silu = g * sig
        # d silu / dg = sig * (1 + g * (1 - sig)) = sig + silu * (1 - sig)
        d_gate = acc * u * (sig + silu * (1.0 - sig))
        d_up = acc * silu
        c_row = c_ptr + rows.to(tl.int64)[:, None] * (2 * n_out) + cols[None, :]
        tl.store(c_row, d_gate.to(out_ty), mask=mask)
        tl.store(c_row + n_out, d_up.to(out_ty), mask=mask)
    else:
        dst = pair.to(tl.int64) if SCATTER_C else rows.to(tl.int64)
        tl.store(c_ptr + dst[:, None] * stride_cm + cols[None, :], acc.to(out_ty), mask=mask)


@triton.jit
def _wgrad_kernel(
    g_ptr, g_idx_ptr, x_ptr, x_idx_ptr, dw_ptr, offsets_ptr,
    p_dim, q_dim, stride_gm, stride_xm,
    G_GATHER: tl.constexpr, X_GATHER: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_P: tl.constexpr,
    EVEN_Q: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """``dw[e] = g[rows_e]^T @ x[rows_e]`` (``[P, Q]``), gathered rows ``idx[m] // TOP_K``; no rows: zeros."""
    pid = tl.program_id(0)
    p_tiles = tl.cdiv(p_dim, BLOCK_P)
    q_tiles = tl.cdiv(q_dim, BLOCK_Q)
    expert = pid // (p_tiles * q_tiles)
    rest = pid % (p_tiles * q_tiles)
    ps = (rest // q_tiles) * BLOCK_P + tl.arange(0, BLOCK_P)
    qs = (rest % q_tiles) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    # The contiguous dims (P and Q) are masked, not clamped: see _gate_up_kernel.
    p_ok = ps < p_dim
    q_ok = qs < q_dim
    start = tl.load(offsets_ptr + expert)
    end = tl.load(offsets_ptr + expert + 1)
    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    for k0 in range(start, end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < end
        # Rows past the group are clamped for the index load and zeroed by the mask: they are reduced over.
        safe_ks = tl.minimum(ks, end - 1)
        g_rows = tl.load(g_idx_ptr + safe_ks) // TOP_K if G_GATHER else safe_ks
        x_rows = tl.load(x_idx_ptr + safe_ks) // TOP_K if X_GATHER else safe_ks
        g_mask = k_ok[:, None] if EVEN_P else k_ok[:, None] & p_ok[None, :]
        x_mask = k_ok[:, None] if EVEN_Q else k_ok[:, None] & q_ok[None, :]
        g = tl.load(g_ptr + g_rows.to(tl.int64)[:, None] * stride_gm + ps[None, :], mask=g_mask, other=0.0)
        x = tl.load(x_ptr + x_rows.to(tl.int64)[:, None] * stride_xm + qs[None, :], mask=x_mask, other=0.0)
        if UPCAST:
            g, x = g.to(tl.float32), x.to(tl.float32)
        acc = tl.dot(tl.trans(g), x, acc, input_precision=PRECISION)
    mask = p_ok[:, None] & q_ok[None, :]
    out = dw_ptr + expert.to(tl.int64) * p_dim * q_dim + ps[:, None] * q_dim + qs[None, :]
    tl.store(out, acc.to(dw_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    dh_ptr, gu_ptr, idx_ptr, rw_ptr, dgu_ptr, dw_ptr, n_rows, inter,
    HAS_RW: tl.constexpr, NEED_DW: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr,
):  # fmt: skip
    """The split down-dgrad's second half: ``d[g, u]`` from ``dh`` (= ``d hw``) and ``gu``, plus ``dw``.

    Same maths as the fused epilogue of `_rows_gemm_kernel`: ``dw[idx[m]] = <dh[m], silu(g) * u>``, then
    ``dh`` is scaled by ``rw[idx[m]]`` and pushed through the SwiGLU backward.
    """
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)[:, None]
    if HAS_RW or NEED_DW:
        pair = tl.load(idx_ptr + rows, mask=row_ok, other=0)
    if HAS_RW:
        w = tl.load(rw_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
    out_ty: tl.constexpr = dgu_ptr.dtype.element_ty
    dot = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c0 in range(0, inter, BLOCK_I):
        cols = c0 + tl.arange(0, BLOCK_I)
        mask = row_ok[:, None] & (cols < inter)[None, :]
        dh = tl.load(dh_ptr + rows64 * inter + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(gu_ptr + rows64 * (2 * inter) + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + rows64 * (2 * inter) + inter + cols[None, :], mask=mask, other=0.0).to(
            tl.float32
        )
        if NEED_DW:
            dot += tl.sum(dh * _swiglu_h(g, u, out_ty), 1)
        if HAS_RW:
            dh = dh * w[:, None]
        sig = tl.sigmoid(g)
        silu = g * sig
        d_gate = dh * u * (sig + silu * (1.0 - sig))
        tl.store(dgu_ptr + rows64 * (2 * inter) + cols[None, :], d_gate.to(out_ty), mask=mask)
        tl.store(dgu_ptr + rows64 * (2 * inter) + inter + cols[None, :], (dh * silu).to(out_ty), mask=mask)
    if NEED_DW:
        tl.store(dw_ptr + pair, dot, mask=row_ok)


@triton.jit
def _sum_rows_kernel(y_ptr, out_ptr, h_dim, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """``out[t] = sum_j y[t*k + j]`` in fp32, rounded once."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < h_dim
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (token * TOP_K + j) * h_dim + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * h_dim + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


# ---- launchers: plain tensor functions on contiguous inputs; outputs are allocated here ----


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _upcast(dtype: torch.dtype) -> bool:
    # Triton's CPU interpreter multiplies bf16 operands as their raw uint16 bit patterns (triton 3.9's
    # create_dot); upcasting to fp32 first gives the exact products that the GPU's fp32 accumulation sees.
    return dtype == torch.bfloat16 and interpreting()


def _e_pow2(experts: int) -> int:
    pow2: int = triton.next_power_of_2(experts)
    return max(16, pow2)


def _row_programs(rows: int, experts: int, block_m: int, n_out: int, block_n: int) -> int:
    # sum_e cdiv(rows_e, BM) <= cdiv(N, BM) + (experts with rows) <= cdiv(N, BM) + min(E, N).
    programs: int = (triton.cdiv(rows, block_m) + min(experts, rows)) * triton.cdiv(n_out, block_n)
    return programs


def _common(dtype: torch.dtype, cfg: KernelConfig, k_dim: int, n_out: int) -> dict[str, int | str]:
    return {
        "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"],
        "EVEN_K": k_dim % cfg["BLOCK_K"] == 0, "EVEN_N": n_out % cfg["BLOCK_N"] == 0,
        "PRECISION": _precision(dtype), "UPCAST": _upcast(dtype),
        "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"],
    }  # fmt: skip


def gate_up(
    a: torch.Tensor,
    order: torch.Tensor | None,
    top_k: int,
    offsets: torch.Tensor,
    w1: torch.Tensor,
    routing_weights: torch.Tensor | None,
    cfg: KernelConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gu [N, 2I], hw [N, I])``, expert-major, for rows ``a[order // top_k]`` (or ``a``).

    ``hw = w * silu(gate) * up`` with ``w = routing_weights.flatten()[order]`` (or 1).
    """
    if routing_weights is not None and order is None:
        raise ValueError("gate_up: routing weights are indexed through order; pass both or neither")
    experts, two_i, k_dim = w1.shape
    rows = order.shape[0] if order is not None else a.shape[0]
    gu = a.new_empty(rows, two_i)
    hw = a.new_empty(rows, two_i // 2)
    if rows == 0:
        return gu, hw
    grid = (_row_programs(rows, experts, cfg["BLOCK_M"], two_i // 2, cfg["BLOCK_N"]),)
    _gate_up_kernel[grid](
        a, order if order is not None else offsets, w1, routing_weights if routing_weights is not None else a,
        gu, hw, offsets, experts, two_i // 2, k_dim, a.stride(0), w1.stride(0),
        GATHER=order is not None, TOP_K=top_k, HAS_RW=routing_weights is not None, E_POW2=_e_pow2(experts),
        **_common(a.dtype, cfg, k_dim, two_i // 2),
    )  # fmt: skip
    return gu, hw


def rows_gemm(
    a: torch.Tensor,
    offsets: torch.Tensor,
    b: torch.Tensor,
    transpose_b: bool,
    scatter: torch.Tensor | None,
    cfg: KernelConfig,
) -> torch.Tensor:
    """Expert-major rows ``a [N, K]`` times each expert's matrix; row ``m`` lands at ``scatter[m]`` (or ``m``).

    ``b`` is ``[E, X, Y]``: ``transpose_b`` multiplies by ``b[e]^T`` (``K = Y``, out ``X``), else by ``b[e]``
    (``K = X``, out ``Y``).
    """
    experts, dim_x, dim_y = b.shape
    if transpose_b:
        k_dim, n_out, stride_bk, stride_bn = dim_y, dim_x, b.stride(2), b.stride(1)
    else:
        k_dim, n_out, stride_bk, stride_bn = dim_x, dim_y, b.stride(1), b.stride(2)
    rows = a.shape[0]
    out = a.new_empty(rows, n_out)
    if rows == 0:
        return out
    grid = (_row_programs(rows, experts, cfg["BLOCK_M"], n_out, cfg["BLOCK_N"]),)
    _rows_gemm_kernel[grid](
        a, scatter if scatter is not None else offsets, b, out, a, a, a, offsets,
        experts, n_out, k_dim, a.stride(0), b.stride(0), stride_bk, stride_bn, out.stride(0),
        GATHER_A=False, SCATTER_C=scatter is not None, TOP_K=1, SWIGLU_BWD=False, HAS_RW=False, NEED_DW=False,
        E_POW2=_e_pow2(experts), **_common(a.dtype, cfg, k_dim, n_out),
    )  # fmt: skip
    return out


def down_dgrad(
    grad_out: torch.Tensor,
    order: torch.Tensor | None,
    top_k: int,
    offsets: torch.Tensor,
    w2: torch.Tensor,
    gu: torch.Tensor,
    routing_weights: torch.Tensor | None,
    need_dw: bool,
    cfg: KernelConfig,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(d[gate, up] [N, 2I] expert-major, dw [T, k] fp32 or None)`` from ``grad_out`` rows and saved ``gu``.

    Rows are ``grad_out[order // top_k]`` (routed) or ``grad_out`` (grouped); with routing weights, ``d hw`` is
    scaled by them and ``dw[t, j] = <grad_out[t] @ W2[e], silu(g) * u>``.
    """
    if (routing_weights is not None or need_dw) and order is None:
        raise ValueError("down_dgrad: routing weights and their gradient need order")
    experts, hidden, inter = w2.shape
    rows = gu.shape[0]
    if cfg.get("SPLIT"):
        return _down_dgrad_split(grad_out, order, top_k, offsets, w2, gu, routing_weights, need_dw, cfg)
    dgu = gu.new_empty(rows, 2 * inter)
    n_tiles = triton.cdiv(inter, cfg["BLOCK_N"])
    partial = torch.empty(rows, n_tiles, dtype=torch.float32, device=gu.device) if need_dw else None
    if rows > 0:
        grid = (_row_programs(rows, experts, cfg["BLOCK_M"], inter, cfg["BLOCK_N"]),)
        _rows_gemm_kernel[grid](
            grad_out, order if order is not None else offsets, w2, dgu, gu,
            routing_weights if routing_weights is not None else gu, partial if need_dw else gu, offsets,
            experts, inter, hidden, grad_out.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), dgu.stride(0),
            GATHER_A=order is not None, SCATTER_C=False, TOP_K=top_k, SWIGLU_BWD=True,
            HAS_RW=routing_weights is not None, NEED_DW=need_dw, E_POW2=_e_pow2(experts),
            **_common(gu.dtype, cfg, hidden, inter),
        )  # fmt: skip
    dw = partial.sum(1).view(-1, top_k) if partial is not None else None
    return dgu, dw


def _down_dgrad_split(
    grad_out: torch.Tensor,
    order: torch.Tensor | None,
    top_k: int,
    offsets: torch.Tensor,
    w2: torch.Tensor,
    gu: torch.Tensor,
    routing_weights: torch.Tensor | None,
    need_dw: bool,
    cfg: KernelConfig,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`down_dgrad` as a plain grouped GEMM writing ``dh [N, I]`` plus one elementwise pass (see configs)."""
    experts, hidden, inter = w2.shape
    rows = gu.shape[0]
    dh = gu.new_empty(rows, inter)
    dgu = gu.new_empty(rows, 2 * inter)
    dw = torch.empty(rows, dtype=torch.float32, device=gu.device) if need_dw else None
    if rows > 0:
        grid = (_row_programs(rows, experts, cfg["BLOCK_M"], inter, cfg["BLOCK_N"]),)
        idx = order if order is not None else offsets
        _rows_gemm_kernel[grid](
            grad_out, idx, w2, dh, dh, dh, dh, offsets,
            experts, inter, hidden, grad_out.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), dh.stride(0),
            GATHER_A=order is not None, SCATTER_C=False, TOP_K=top_k, SWIGLU_BWD=False, HAS_RW=False,
            NEED_DW=False, E_POW2=_e_pow2(experts), **_common(gu.dtype, cfg, hidden, inter),
        )  # fmt: skip
        block_i = min(1024, triton.next_power_of_2(inter))
        block_r = max(1, 4096 // block_i)
        _swiglu_bwd_kernel[(triton.cdiv(rows, block_r),)](
            dh, gu, idx, routing_weights if routing_weights is not None else dh, dgu, dw if need_dw else dh,
            rows, inter, HAS_RW=routing_weights is not None, NEED_DW=need_dw, BLOCK_R=block_r, BLOCK_I=block_i,
            num_warps=4,
        )  # fmt: skip
    return dgu, (dw.view(-1, top_k) if dw is not None else None)


def wgrad(
    g: torch.Tensor,
    g_idx: torch.Tensor | None,
    x: torch.Tensor,
    x_idx: torch.Tensor | None,
    top_k: int,
    offsets: torch.Tensor,
    experts: int,
    cfg: KernelConfig,
) -> torch.Tensor:
    """``dw [E, P, Q]``, ``dw[e] = g[rows_e]^T @ x[rows_e]``; gathered rows are ``idx[m] // top_k``."""
    p_dim, q_dim = g.shape[1], x.shape[1]
    rows = g_idx.shape[0] if g_idx is not None else g.shape[0]
    if rows == 0:
        return g.new_zeros(experts, p_dim, q_dim)
    dw = g.new_empty(experts, p_dim, q_dim)
    bp, bq = cfg["BLOCK_M"], cfg["BLOCK_N"]
    grid = (experts * triton.cdiv(p_dim, bp) * triton.cdiv(q_dim, bq),)
    _wgrad_kernel[grid](
        g, g_idx if g_idx is not None else offsets, x, x_idx if x_idx is not None else offsets, dw, offsets,
        p_dim, q_dim, g.stride(0), x.stride(0),
        G_GATHER=g_idx is not None, X_GATHER=x_idx is not None, TOP_K=top_k,
        BLOCK_P=bp, BLOCK_Q=bq, BLOCK_K=cfg["BLOCK_K"], EVEN_P=p_dim % bp == 0, EVEN_Q=q_dim % bq == 0,
        PRECISION=_precision(g.dtype), UPCAST=_upcast(g.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return dw


def sum_rows(y: torch.Tensor, tokens: int, top_k: int) -> torch.Tensor:
    """``[T*k, H]`` (token, slot)-ordered rows -> ``[T, H]``, each token's ``k`` rows summed in fp32."""
    h_dim = y.shape[1]
    out = y.new_empty(tokens, h_dim)
    if tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(h_dim))
    _sum_rows_kernel[(tokens, triton.cdiv(h_dim, block))](
        y, out, h_dim, TOP_K=top_k, BLOCK_H=block, num_warps=4
    )
    return out
