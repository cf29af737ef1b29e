"""The ``chunk_loss`` backend: token-chunked linear cross-entropy in plain PyTorch; never a ``[T, V]`` tensor.

Portable (CPU, CUDA, Ascend NPU: only ``F.linear``/``matmul`` and elementwise torch ops), so it is the NPU default
and the fallback wherever the Triton kernel cannot run. Per chunk of ``C`` tokens the forward computes the fp32
logits ``[C, V]``, the chunk's loss and, analytically, the logit gradient; it then turns that into the chunk's
rows of ``dX = G @ W`` and accumulates ``dW += G^T @ X_c`` in fp32. Backward only scales the stored gradients by
``grad_output``. Peak extra memory is a few ``[C, V]`` fp32 buffers plus ``dX`` and an fp32 ``dW``.

Precision matches the eager oracle (`veomni.kernels.cross_entropy.eager`): logits are the GEMM output rounded to
the input dtype, then fp32; LSE, softmax and the loss are fp32; the logit gradient is rounded to the input dtype
for the ``dX`` GEMM as autograd would round it, ``dW`` is summed in fp32 and rounded once.

Per valid row with ``z`` the (soft-capped) logits, ``p = softmax(z)`` and ``lse`` their log-sum-exp:
``loss = lse - z[y] + w_z * lse**2`` and ``dloss/dz = p - onehot(y) + 2 w_z lse p``; with a soft-cap
``c * tanh(u / c)`` of the raw logits ``u`` the chain rule multiplies by ``1 - (z / c)**2``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from veomni.kernels.cross_entropy.eager import IGNORE_INDEX, check_inputs

__all__ = ["DEFAULT_CHUNK_TOKENS", "causal_lm_cross_entropy", "chunked_linear_cross_entropy",
           "sequence_classification_cross_entropy"]  # fmt: skip

DEFAULT_CHUNK_TOKENS = 1024
"""Rows per chunk: at V = 151,936 a chunk's fp32 logits and gradient take 2 x 594 MiB."""


@functools.cache
def mixed_addmm_supported(device: torch.device) -> bool:
    """Whether this torch accumulates half-precision products into an fp32 ``self`` in one cuBLAS call
    (``addmm(fp32, half, half, out_dtype=float32)``; older releases required ``self`` in the half dtype)."""
    acc = torch.zeros(16, 16, device=device)
    half = torch.ones(16, 16, device=device, dtype=torch.bfloat16)
    try:
        torch.addmm(acc, half, half, torch.float32, out=acc)
    except RuntimeError:
        return False
    return True


def _accumulate_dw(dw: torch.Tensor, grad: torch.Tensor, x: torch.Tensor) -> None:
    """``dw += grad^T @ x`` into the fp32 ``dw``: on CUDA a half-precision GEMM with fp32 output where torch has
    it (tensor cores; fp32 inputs would run ~10x slower), else fp32 copies (exact: products of half values fit)."""
    if grad.dtype != dw.dtype and dw.device.type == "cuda" and mixed_addmm_supported(dw.device):
        torch.addmm(dw, grad.t(), x, torch.float32, out=dw)
    else:
        dw.addmm_(grad.t().float(), x.float())


def _chunk_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    softcap: float | None,
    z_weight: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: ``x [C, H]``, ``labels [C]`` -> (loss sum 0-d fp32, logit gradient ``[C, V]`` in x's dtype)."""
    logits = F.linear(x, weight).float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap).mul_(softcap)
    valid = labels != ignore_index
    target = torch.where(valid, labels, 0)
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, target.unsqueeze(1)).squeeze(1)
    per_row = lse - picked
    if z_weight:
        per_row = per_row + z_weight * lse.square()
    loss = torch.where(valid, per_row, 0.0).sum()
    # Gradient of the summed loss w.r.t. the (capped) logits, computed in place over the softmax buffer.
    grad = logits.sub_(lse.unsqueeze(1)).exp_()  # softmax; `logits` is gone from here on
    if z_weight:
        grad.mul_((1.0 + 2.0 * z_weight * lse).unsqueeze(1))
    grad.scatter_add_(1, target.unsqueeze(1), torch.full_like(lse, -1.0).unsqueeze(1))
    grad.mul_(valid.unsqueeze(1))
    if softcap is not None:
        # d(c tanh(u/c))/du = 1 - tanh(u/c)^2; recompute the capped logits rather than keep a second [C, V].
        capped = torch.tanh(F.linear(x, weight).float() / softcap)
        grad.mul_(1.0 - capped.square_())
    return loss, grad.to(x.dtype)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        ignore_index: int,
        softcap: float | None,
        z_weight: float,
        chunk_tokens: int,
        grad_enabled: bool,
    ) -> torch.Tensor:
        n, h = hidden.shape
        # Under no_grad (evaluation) no gradient GEMMs run: the loss alone costs one GEMM per chunk.
        need_dx, need_dw = hidden.requires_grad and grad_enabled, weight.requires_grad and grad_enabled
        dx = torch.empty((n, h), dtype=hidden.dtype, device=hidden.device) if need_dx else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_dw else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.no_grad():
            for start in range(0, n, chunk_tokens):
                x_c = hidden[start : start + chunk_tokens]
                loss, grad = _chunk_forward(x_c, weight, labels[start : start + chunk_tokens], ignore_index,
                                            softcap, z_weight)  # fmt: skip
                total += loss
                if dx is not None:  # need_dx
                    torch.matmul(grad, weight, out=dx[start : start + chunk_tokens])
                if dw is not None:  # need_dw
                    _accumulate_dw(dw, grad, x_c)
        # dW stays fp32 until backward has scaled it, so each element is rounded to the weight dtype once.
        ctx.save_for_backward(dx if need_dx else torch.empty(0), dw if need_dw else torch.empty(0))
        ctx.need = (need_dx, need_dw)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(
        ctx: Any, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None, None, None, None]:
        dx, dw = ctx.saved_tensors
        need_dx, need_dw = ctx.need
        g = grad_output.float()
        grad_x = (dx * g).to(dx.dtype) if need_dx else None
        grad_w = (dw * g).to(ctx.weight_dtype) if need_dw else None
        return grad_x, grad_w, None, None, None, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    logit_softcap: float | None = None,
    z_loss_weight: float = 0.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    variant: str = "causal",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Linear cross-entropy over token chunks of ``chunk_tokens`` rows (no ``[T, V]`` logits).

    Args:
        hidden: ``[..., H]`` bf16/fp16/fp32; weight: ``[V, H]`` same dtype; labels: ``[...]`` int64 (already
            shifted for a causal LM), ``ignore_index`` where there is no target.
        logit_softcap: ``c * tanh(z / c)`` on the logits when set; z_loss_weight: adds ``w * lse**2``.
        chunk_tokens: rows per chunk (> 0); the result does not depend on it beyond fp32 summation order.
        variant: ``"causal"`` or ``"seq_cls"`` (input checks only; the maths is the same).
    Returns:
        ``(loss_sum, valid_count)``: 0-d fp32 (differentiable w.r.t. hidden and weight) and 0-d int64.
    """
    check_inputs(
        hidden, weight, labels, ignore_index=ignore_index, logit_softcap=logit_softcap,
        z_loss_weight=z_loss_weight, variant=variant,
    )  # fmt: skip
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"cross_entropy/{variant}: chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1)
    softcap = None if logit_softcap is None else float(logit_softcap)
    loss = _ChunkedLinearCrossEntropy.apply(
        flat_hidden,
        weight,
        flat_labels,
        ignore_index,
        softcap,
        float(z_loss_weight),
        chunk_tokens,
        torch.is_grad_enabled(),
    )
    return loss, (flat_labels != ignore_index).sum()


def causal_lm_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    logit_softcap: float | None = None,
    z_loss_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked LM-head cross-entropy: ``hidden [..., H]``, ``weight [V, H]``, shifted ``labels [...]`` int64.

    Returns ``(loss_sum, valid_count)``, 0-d fp32 and 0-d int64.
    """
    return chunked_linear_cross_entropy(
        hidden, weight, labels, ignore_index=ignore_index, logit_softcap=logit_softcap,
        z_loss_weight=z_loss_weight, variant="causal",
    )  # fmt: skip


def sequence_classification_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    logit_softcap: float | None = None,
    z_loss_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked classifier-head cross-entropy: ``hidden [B, H]``, ``weight [C, H]``, ``labels [B]`` int64.

    Returns ``(loss_sum, valid_sequences)``, 0-d fp32 and 0-d int64.
    """
    return chunked_linear_cross_entropy(
        hidden, weight, labels, ignore_index=ignore_index, logit_softcap=logit_softcap,
        z_loss_weight=z_loss_weight, variant="seq_cls",
    )  # fmt: skip
