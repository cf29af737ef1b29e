"""Fused linear log-probs and entropy: chunked cuBLAS GEMMs plus one Triton pass per chunk; no ``[T, V]`` tensor.

Named ``triton_impl`` rather than ``triton`` so that nothing mistakes this file for the ``triton`` package.

Forward, per chunk of ``C`` tokens:

1. ``Z = X_c @ W^T`` (cuBLAS, input dtype, fp32 accumulation) into one reused ``[C, V]`` buffer;
2. one Triton program per row: a single online pass over the row (soft-capped, divided by the temperature) keeps
   the running max ``m``, ``S = sum 2^(a - m)`` and ``D = sum 2^(a - m) (a - m)`` (``a`` the logits in base 2),
   which give the log-sum-exp, the target's log-prob and the entropy ``ln 2 (log2 S - D / S)``. The row's
   log-sum-exp and entropy (two fp32 numbers per token) are all that is kept for backward.

The upstream gradients are per token (each token's log-prob carries its own DPO / policy-gradient weight), so,
unlike the cross-entropy op, ``dW = sum_t g_t^T x_t`` cannot be formed in forward and scaled later. Backward
therefore recomputes, per chunk: ``Z = X_c @ W^T``; one Triton pass per row writes the logit gradient
``g_logp (onehot - p) - g_ent p (log p + H)`` (divided by the temperature, times the soft-cap derivative) over
``Z`` in place; ``dX_c = G @ W`` into the rows of dX; ``dW += G^T @ X_c`` in fp32 with the cross-entropy op's
half-buffer accumulator (`veomni.kernels.cross_entropy.triton_impl`), rounded once. Four GEMMs per chunk in all
(the CE op needs three); the extra one buys per-token gradients at ``8 T`` bytes of saved state.

Precision: as in HF's eager path, logits are the GEMM's output rounded to the input dtype, and everything after is
fp32; the logit gradient is rounded to the input dtype for the dX/dW GEMMs, which accumulate in fp32.

No host syncs. Targets outside ``[0, V)`` (other than ``ignore_index``) make that token's log-prob NaN instead of
raising, because checking them on the host would sync. Results are deterministic run to run.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from veomni.kernels.cross_entropy import triton_impl as ce_triton
from veomni.kernels.log_probs.eager import IGNORE_INDEX, check_inputs

__all__ = ["LaunchConfig", "default_config", "linear_log_probs"]

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


class LaunchConfig(NamedTuple):
    """How the work is cut: ``chunk_tokens`` rows per GEMM chunk (the logits buffer holds that many rows of V),
    ``block_v`` columns per step of the row kernels (a power of 2 >= 16) and their ``num_warps``."""

    chunk_tokens: int
    block_v: int
    num_warps: int


def default_config(n_tokens: int, vocab: int, itemsize: int) -> LaunchConfig:
    """The cross-entropy op's measured chunking (same logits buffer budget, same row-kernel shape)."""
    ce = ce_triton.default_config(n_tokens, vocab, itemsize)
    return LaunchConfig(chunk_tokens=ce.chunk_tokens, block_v=ce.block_v, num_warps=ce.num_warps)


@triton.jit
def _tanh(x):
    # tanh from exp2 (portable to the interpreter); the symmetric form never overflows.
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


# fmt: off
@triton.jit
def _fwd_rows_kernel(Z, TARGETS, LOGP, LSE2, ENT, z_stride, n_cols, ignore_index, softcap, scale2,
                     HAS_SOFTCAP: tl.constexpr, WANT_ENT: tl.constexpr, BLOCK: tl.constexpr):
    # fmt: on
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * z_stride
    label = tl.load(TARGETS + row)
    cols = tl.arange(0, BLOCK)
    if label != ignore_index:
        m = float("-inf")
        s = 0.0
        d = 0.0
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            inside = offs < n_cols
            x = tl.load(z_row + offs, mask=inside, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                x = softcap * _tanh(x / softcap)
            a = tl.where(inside, x * scale2, float("-inf"))  # base-2 scaled logits: s * log2(e)
            m_new = tl.maximum(m, tl.max(a, axis=0))
            r = tl.exp2(m - m_new)
            # No infinities past this point (masked columns and the first block's m = -inf), so no 0 * inf.
            rel = tl.where(inside, a - m_new, 0.0)
            e = tl.where(inside, tl.exp2(rel), 0.0)
            if WANT_ENT:
                # Rebase D to the new max: each earlier (a - m) term moves by (m - m_new), S times in all.
                d = r * (d + s * tl.where(s > 0.0, m - m_new, 0.0)) + tl.sum(e * rel, axis=0)
            s = s * r + tl.sum(e, axis=0)
            m = m_new
        log2_s = tl.log2(s)
        lse2 = m + log2_s
        in_range = (label >= 0) & (label < n_cols)
        z_label = tl.load(z_row + tl.minimum(tl.maximum(label, 0), n_cols - 1)).to(tl.float32)
        if HAS_SOFTCAP:
            z_label = softcap * _tanh(z_label / softcap)
        logp = (z_label * scale2 - lse2) * 0.6931471805599453
        tl.store(LOGP + row, tl.where(in_range, logp, float("nan")))
        tl.store(LSE2 + row, lse2)
        if WANT_ENT:
            tl.store(ENT + row, (log2_s - d / s) * 0.6931471805599453)
    else:
        tl.store(LOGP + row, 0.0)
        tl.store(LSE2 + row, 0.0)
        if WANT_ENT:
            tl.store(ENT + row, 0.0)


# fmt: off
@triton.jit
def _bwd_rows_kernel(Z, TARGETS, LSE2, ENT, G_LOGP, G_ENT, z_stride, n_cols, ignore_index, softcap, scale2,
                     inv_temp, HAS_SOFTCAP: tl.constexpr, HAS_G_LOGP: tl.constexpr, HAS_G_ENT: tl.constexpr,
                     BLOCK: tl.constexpr):
    # fmt: on
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * z_stride
    label = tl.load(TARGETS + row)
    cols = tl.arange(0, BLOCK)
    if label != ignore_index:
        lse2 = tl.load(LSE2 + row)
        g_logp = 0.0
        g_ent = 0.0
        h = 0.0
        if HAS_G_LOGP:
            g_logp = tl.load(G_LOGP + row)
        if HAS_G_ENT:
            g_ent = tl.load(G_ENT + row)
            h = tl.load(ENT + row)
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            inside = offs < n_cols
            x = tl.load(z_row + offs, mask=inside, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                t = _tanh(x / softcap)
                x = softcap * t
            a = x * scale2 - lse2  # log2 p
            p = tl.exp2(a)
            g = tl.zeros([BLOCK], dtype=tl.float32)
            if HAS_G_LOGP:
                # onehot - p in this order is exact (Sterbenz) at the target when p is near 1.
                g = g_logp * (tl.where(offs == label, 1.0, 0.0) - p)
            if HAS_G_ENT:
                g = g - g_ent * p * (a * 0.6931471805599453 + h)
            g = g * inv_temp
            if HAS_SOFTCAP:
                g = g * (1.0 - t * t)
            tl.store(z_row + offs, g.to(z_row.dtype.element_ty), mask=inside)
    else:
        zeros = tl.zeros([BLOCK], dtype=z_row.dtype.element_ty)
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            tl.store(z_row + offs, zeros, mask=offs < n_cols)


def _check_device(t: torch.Tensor) -> None:
    if t.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"log_probs (triton): tensors are on {t.device}; the Triton kernel needs CUDA tensors "
            "(or TRITON_INTERPRET=1 to run it on the CPU through Triton's interpreter)"
        )


def _chunks(n_tokens: int, cfg: LaunchConfig) -> range:
    return range(0, n_tokens, max(1, min(cfg.chunk_tokens, n_tokens)))


class _LinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        y: torch.Tensor,
        ignore_index: int,
        softcap: float | None,
        temperature: float,
        want_entropy: bool,
        cfg: LaunchConfig,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n_tokens, vocab = x.shape[0], weight.shape[0]
        logps = torch.empty(n_tokens, dtype=torch.float32, device=x.device)
        lse2 = torch.empty(n_tokens, dtype=torch.float32, device=x.device)
        ent = torch.empty(n_tokens if want_entropy else 0, dtype=torch.float32, device=x.device)
        chunk = max(1, min(cfg.chunk_tokens, n_tokens))
        buf = torch.empty((chunk, vocab), dtype=x.dtype, device=x.device) if n_tokens else None
        w_t = weight.t()
        for start in _chunks(n_tokens, cfg):
            stop = min(start + chunk, n_tokens)
            assert buf is not None  # allocated whenever there are tokens
            z = buf[: stop - start]
            torch.mm(x[start:stop], w_t, out=z)
            # fmt: off
            _fwd_rows_kernel[(stop - start,)](
                z, y[start:], logps[start:], lse2[start:], ent[start:] if want_entropy else logps[start:],
                z.stride(0), vocab, ignore_index, 1.0 if softcap is None else softcap, _LOG2E / temperature,
                HAS_SOFTCAP=softcap is not None, WANT_ENT=want_entropy, BLOCK=cfg.block_v,
                num_warps=cfg.num_warps,
            )
            # fmt: on
        ctx.save_for_backward(x, weight, y, lse2, ent)
        ctx.params = (ignore_index, softcap, temperature, want_entropy, cfg)
        ctx.set_materialize_grads(False)
        if not want_entropy:
            ctx.mark_non_differentiable(ent)  # the empty placeholder the wrapper turns into None
        return logps, ent

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, grad_logps: torch.Tensor | None, grad_ent: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None, None, None, None]:
        x, weight, y, lse2, ent = ctx.saved_tensors
        ignore_index, softcap, temperature, want_entropy, cfg = ctx.params
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not want_entropy:
            grad_ent = None  # the empty placeholder output
        if (grad_logps is None and grad_ent is None) or not (need_dx or need_dw):
            return None, None, None, None, None, None, None, None
        g_logp = None if grad_logps is None else grad_logps.detach().to(torch.float32).contiguous()
        g_ent = None if grad_ent is None else grad_ent.detach().to(torch.float32).contiguous()
        n_tokens, vocab = x.shape[0], weight.shape[0]
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_dx else None
        dw = ce_triton._WeightGrad(weight) if need_dw else None
        chunk = max(1, min(cfg.chunk_tokens, n_tokens))
        buf = torch.empty((chunk, vocab), dtype=x.dtype, device=x.device) if n_tokens else None
        w_t = weight.t()
        for start in _chunks(n_tokens, cfg):
            stop = min(start + chunk, n_tokens)
            assert buf is not None
            x_c, z = x[start:stop], buf[: stop - start]
            torch.mm(x_c, w_t, out=z)
            # fmt: off
            _bwd_rows_kernel[(stop - start,)](
                z, y[start:], lse2[start:], ent[start:] if g_ent is not None else lse2[start:],
                (g_logp if g_logp is not None else lse2)[start:], (g_ent if g_ent is not None else lse2)[start:],
                z.stride(0), vocab, ignore_index, 1.0 if softcap is None else softcap, _LOG2E / temperature,
                1.0 / temperature, HAS_SOFTCAP=softcap is not None, HAS_G_LOGP=g_logp is not None,
                HAS_G_ENT=g_ent is not None, BLOCK=cfg.block_v, num_warps=cfg.num_warps,
            )
            # fmt: on
            if dx is not None:
                torch.mm(z, weight, out=dx[start:stop])
            if dw is not None:
                dw.add(z, x_c)
        grad_w = dw.finish(torch.ones((), dtype=torch.float32, device=x.device)) if dw is not None else None
        return dx, grad_w, None, None, None, None, None, None


def linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    logit_softcap: float | None = None,
    temperature: float = 1.0,
    entropy: bool = False,
    config: LaunchConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fused per-token target log-probs (and entropy) from hidden states; contract of ``eager.linear_log_probs``.

    Args:
        hidden: ``[..., H]`` (``[T, H]`` for packed tokens) bf16/fp16/fp32; weight: ``[V, H]`` same dtype;
            targets: ``[...]`` int64, ``ignore_index`` where there is no target.
        logit_softcap: ``c * tanh(z / c)`` on the logits when set; temperature: divides the (capped) logits.
        entropy: also return the softmax entropy per token.
        config: chunking and launch shape; ``default_config(...)`` when None.
    Returns:
        ``(logps, entropy or None)``: fp32, shaped like ``targets``, 0 at ignored positions; differentiable
        w.r.t. hidden and weight through both (one backward per call: the graph is not double-differentiable).
    """
    check_inputs(
        hidden, weight, targets, ignore_index=ignore_index, logit_softcap=logit_softcap,
        temperature=temperature, entropy=entropy, backend="triton",
    )  # fmt: skip
    _check_device(hidden)
    cfg = config or default_config(targets.numel(), weight.shape[0], weight.element_size())
    if cfg.chunk_tokens < 1 or cfg.block_v < 16 or cfg.block_v & (cfg.block_v - 1) or cfg.num_warps < 1:
        raise ValueError(
            f"log_probs (triton): bad config {cfg}; need chunk_tokens >= 1, block_v a power of 2 >= 16, "
            "num_warps >= 1"
        )
    y = targets.reshape(-1)
    if y.stride(0) != 1:
        y = y.contiguous()
    softcap = None if logit_softcap is None else float(logit_softcap)
    logps, ent = _LinearLogProbs.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, y, ignore_index, softcap, float(temperature), entropy, cfg
    )
    return logps.view(targets.shape), ent.view(targets.shape) if entropy else None
