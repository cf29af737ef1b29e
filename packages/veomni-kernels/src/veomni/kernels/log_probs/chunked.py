"""The ``chunked`` backend: token-chunked linear log-probs and entropy in plain PyTorch; never a ``[T, V]`` tensor.

Portable (CPU, CUDA, Ascend NPU: only ``F.linear``/``matmul`` and elementwise torch ops), so it is the NPU default
and the fallback wherever the Triton kernel cannot run. Unlike the cross-entropy op, the upstream gradients here
are per token (a DPO or policy-gradient loss weighs each token's log-prob differently), so ``dW`` cannot be formed
in forward and scaled later. Forward keeps two fp32 numbers per token, the log-sum-exp and the entropy; backward
recomputes each chunk's logits from them, forms the logit gradient analytically and runs the ``dX`` and ``dW``
GEMMs. Peak extra memory is a few ``[C, V]`` fp32 buffers plus ``dX`` and an fp32 ``dW``.

With ``s`` the scaled logits of a row, ``p = softmax(s)``, ``lse`` its log-sum-exp and ``H`` its entropy:
``d logp / ds = onehot(y) - p`` and ``d H / ds = -p * (log p + H)``; through ``s = z / temperature`` the chain rule
divides by the temperature, and through a soft-cap ``z = c * tanh(u / c)`` multiplies by ``1 - (z / c)**2``.
Precision matches the eager oracle: logits are the GEMM output rounded to the input dtype, then fp32; the logit
gradient is rounded to the input dtype for the ``dX`` GEMM as autograd would round it, ``dW`` is summed in fp32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from veomni.kernels.cross_entropy.chunked import _accumulate_dw
from veomni.kernels.log_probs.eager import IGNORE_INDEX, check_inputs

__all__ = ["DEFAULT_CHUNK_TOKENS", "linear_log_probs"]

DEFAULT_CHUNK_TOKENS = 1024
"""Rows per chunk: at V = 151,936 a chunk's fp32 logits and gradient take 2 x 594 MiB."""


def _scaled_logits(
    x: torch.Tensor, weight: torch.Tensor, softcap: float | None, temperature: float
) -> torch.Tensor:
    """``[C, V]`` fp32 ``s = softcap(x @ W^T) / temperature`` (the GEMM rounded to x's dtype first, as eager)."""
    s = F.linear(x, weight).float()
    if softcap is not None:
        s = torch.tanh(s / softcap).mul_(softcap)
    if temperature != 1.0:
        s.div_(temperature)
    return s


class _ChunkedLinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        ignore_index: int,
        softcap: float | None,
        temperature: float,
        want_entropy: bool,
        chunk_tokens: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        logps = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        lse = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        ent = torch.zeros(n if want_entropy else 0, dtype=torch.float32, device=hidden.device)
        valid = targets != ignore_index
        target = torch.where(valid, targets, 0)
        for start in range(0, n, chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            s = _scaled_logits(hidden[rows], weight, softcap, temperature)
            lse_c = torch.logsumexp(s, dim=-1)
            picked = s.gather(1, target[rows].unsqueeze(1)).squeeze(1)
            logps[rows] = torch.where(valid[rows], picked - lse_c, 0.0)
            lse[rows] = lse_c
            if want_entropy:
                logp_all = s.sub_(lse_c.unsqueeze(1))  # in place: `s` is gone from here on
                h = -(logp_all.exp() * logp_all).sum(dim=-1)
                ent[rows] = torch.where(valid[rows], h, 0.0)
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.params = (ignore_index, softcap, temperature, want_entropy, chunk_tokens)
        ctx.set_materialize_grads(False)
        if not want_entropy:
            ctx.mark_non_differentiable(ent)  # the empty placeholder the wrapper turns into None
        return logps, ent

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, grad_logps: torch.Tensor | None, grad_ent: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None, None, None, None]:
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        ignore_index, softcap, temperature, want_entropy, chunk_tokens = ctx.params
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not want_entropy:
            grad_ent = None  # the empty placeholder output
        if (grad_logps is None and grad_ent is None) or not (need_dx or need_dw):
            return None, None, None, None, None, None, None, None
        n, h = hidden.shape
        dx = torch.empty((n, h), dtype=hidden.dtype, device=hidden.device) if need_dx else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_dw else None
        valid = targets != ignore_index
        target = torch.where(valid, targets, 0)
        for start in range(0, n, chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            x_c = hidden[rows]
            grad = _logit_grad(
                _scaled_logits(x_c, weight, softcap, temperature), lse[rows], target[rows], valid[rows],
                None if grad_logps is None else grad_logps[rows].float(),
                None if grad_ent is None else (grad_ent[rows].float(), ent[rows]),
            )  # fmt: skip
            if temperature != 1.0:
                grad.div_(temperature)
            if softcap is not None:
                # d(c tanh(u/c))/du = 1 - tanh(u/c)^2; recompute rather than keep a second [C, V] in forward.
                capped = torch.tanh(F.linear(x_c, weight).float() / softcap)
                grad.mul_(1.0 - capped.square_())
            grad_h = grad.to(hidden.dtype)
            if dx is not None:
                torch.matmul(grad_h, weight, out=dx[rows])
            if dw is not None:
                _accumulate_dw(dw, grad_h, x_c)
        grad_w = dw.to(weight.dtype) if dw is not None else None
        return dx, grad_w, None, None, None, None, None, None


def _logit_grad(
    s: torch.Tensor,
    lse: torch.Tensor,
    target: torch.Tensor,
    valid: torch.Tensor,
    g_logp: torch.Tensor | None,
    g_ent: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """``[C, V]`` fp32 gradient w.r.t. the scaled logits ``s`` (consumed, overwritten in place) of
    ``sum g_logp * logp + sum g_ent * H`` over the chunk's valid rows."""
    logp_all = s.sub_(lse.unsqueeze(1))
    p = logp_all.exp()
    if g_ent is not None:
        g_e, h = g_ent
        # -g_e * p * (log p + H), then the log-prob term's -g_logp * p, in the buffer of log p.
        coef = logp_all.add_(h.unsqueeze(1)).mul_(g_e.unsqueeze(1))
        if g_logp is not None:
            coef.add_(g_logp.unsqueeze(1))
        grad = coef.mul_(p).neg_()
    else:
        assert g_logp is not None
        grad = p.mul_(g_logp.unsqueeze(1)).neg_()
    if g_logp is not None:
        grad.scatter_add_(1, target.unsqueeze(1), g_logp.unsqueeze(1))
    return grad.mul_(valid.unsqueeze(1))


def linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    logit_softcap: float | None = None,
    temperature: float = 1.0,
    entropy: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token target log-probs (and entropy) over token chunks of ``chunk_tokens`` rows (no ``[T, V]`` logits).

    Args:
        hidden: ``[..., H]`` bf16/fp16/fp32; weight: ``[V, H]`` same dtype; targets: ``[...]`` int64 (already
            shifted), ``ignore_index`` where there is no target.
        logit_softcap: ``c * tanh(z / c)`` on the logits when set; temperature: divides the (capped) logits.
        entropy: also return the softmax entropy per token.
        chunk_tokens: rows per chunk (> 0); the result does not depend on it.
    Returns:
        ``(logps, entropy or None)``: fp32, shaped like ``targets``, 0 at ignored positions; differentiable
        w.r.t. hidden and weight through both.
    """
    check_inputs(
        hidden, weight, targets, ignore_index=ignore_index, logit_softcap=logit_softcap,
        temperature=temperature, entropy=entropy, backend="chunked",
    )  # fmt: skip
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"log_probs (chunked): chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
    softcap = None if logit_softcap is None else float(logit_softcap)
    logps, ent = _ChunkedLinearLogProbs.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), ignore_index, softcap,
        float(temperature), entropy, chunk_tokens,
    )  # fmt: skip
    return logps.view(targets.shape), ent.view(targets.shape) if entropy else None
