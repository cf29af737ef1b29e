"""The ``quack`` backend: quack-kernels (CuTe-DSL, SM90+) behind veomni's plain-function signatures.

Optional (``veomni-kernels[quack]``); imported only when a config selects ``quack``, which the registry allows
only on CUDA sm_90+ with the ``quack`` package installed. API read from quack-kernels 0.6.5:

- RMSNorm: ``quack.rmsnorm(x, weight, residual=, eps=, prenorm=, weight_offset=)`` computes ``x_hat * (w +
  offset)`` in fp32 and rounds once. That is exactly our ``offset`` variant (offset 1.0); for ``standard`` it
  differs from the Llama cast order (round ``x_hat`` first, then scale) by at most one ulp of the input dtype.
- Cross-entropy: ``quack.linear_cross_entropy.chunked_linear_cross_entropy(x, w, target, reduction="sum")``
  (fused LM head + CE, no ``[T, V]``); it has no soft-cap and no z-loss, so asking for either raises.
- MoE experts: ``quack.gemm_interface.gemm`` with ``cu_seqlens_m`` (grouped rows, forward and dgrad) and
  ``cu_seqlens_k`` (wgrad, jagged along the reduction dim), inside the routing of the ``torch`` backend.

Parity tests are ``cuda``-marked (tests/kernels/test_quack_backend.py); tools/bench compares it with ours.
"""

from __future__ import annotations

from typing import Any

import quack
import torch
import torch.nn.functional as F
from quack.gemm_interface import gemm
from quack.linear_cross_entropy import chunked_linear_cross_entropy

from veomni.kernels.cross_entropy.eager import IGNORE_INDEX, check_inputs
from veomni.kernels.moe_experts import torch_impl
from veomni.kernels.moe_experts.common import check_grouped_inputs, check_routed_inputs, group_offsets
from veomni.kernels.rms_norm.eager import check_inputs as check_norm_inputs


def rms_norm_standard(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm ``x [..., H]`` times ``weight [H]`` (one rounding; see the module doc). Returns x's dtype."""
    check_norm_inputs(x, weight, eps)
    result: torch.Tensor = quack.rmsnorm(x, weight, eps=eps)
    return result


def rms_norm_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(1 + weight)`` RMSNorm, all fp32, rounded once. ``x [..., H]``, ``weight [H]``."""
    check_norm_inputs(x, weight, eps)
    result: torch.Tensor = quack.rmsnorm(x, weight, eps=eps, weight_offset=1.0)
    return result


def rms_norm_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight. ``x [..., H]``."""
    check_norm_inputs(x, None, eps)
    result: torch.Tensor = quack.rmsnorm(x, None, eps=eps)
    return result


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``: quack's pre-norm residual mode. All ``[..., H]``."""
    check_norm_inputs(x, weight, eps, residual)
    y, new_residual = quack.rmsnorm(x, weight, residual=residual, eps=eps, prenorm=True)
    return y, new_residual


def _linear_ce(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    logit_softcap: float | None,
    z_loss_weight: float,
    variant: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_inputs(
        hidden, weight, labels, ignore_index=ignore_index, logit_softcap=logit_softcap,
        z_loss_weight=z_loss_weight, variant=variant,
    )  # fmt: skip
    if logit_softcap is not None or z_loss_weight:
        raise NotImplementedError(
            f"cross_entropy/{variant} on 'quack' has no logit soft-cap or z-loss (got logit_softcap="
            f"{logit_softcap}, z_loss_weight={z_loss_weight}); use 'triton' or 'chunk_loss'"
        )
    flat = labels.reshape(-1)
    x = hidden.reshape(-1, hidden.shape[-1])
    loss: torch.Tensor = chunked_linear_cross_entropy(
        x, weight, flat, ignore_index=ignore_index, reduction="sum"
    )
    return loss.float(), (flat != ignore_index).sum()


def causal_lm_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    logit_softcap: float | None = None,
    z_loss_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """quack's fused LM-head CE: ``hidden [..., H]``, ``weight [V, H]``, shifted ``labels [...]`` int64.

    Returns ``(loss_sum, valid_count)``, 0-d fp32 and 0-d int64.
    """
    return _linear_ce(hidden, weight, labels, ignore_index, logit_softcap, z_loss_weight, "causal")


def sequence_classification_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    logit_softcap: float | None = None,
    z_loss_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """quack's fused classifier-head CE: ``hidden [B, H]``, ``weight [C, H]``, ``labels [B]`` int64."""
    return _linear_ce(hidden, weight, labels, ignore_index, logit_softcap, z_loss_weight, "seq_cls")


class _QuackGroupedMM(torch.autograd.Function):
    """``x [N, K]`` (expert-major) times ``w[e]^T`` (``w [E, n_out, K]``) per group; ``ends [E]``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ends: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        cu = F.pad(ends, (1, 0)).to(torch.int32)
        ctx.save_for_backward(x, cu, w)
        out: torch.Tensor = gemm(x, w.transpose(-2, -1), cu_seqlens_m=cu)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, torch.Tensor | None]:
        x, cu, w = ctx.saved_tensors
        need_x, _, need_w = ctx.needs_input_grad
        grad = grad.contiguous()
        grad_x = gemm(grad, w, cu_seqlens_m=cu) if need_x else None
        # varlen-K: per expert e, grad_e^T [n_out, N_e] @ x_e [N_e, K] -> [E, n_out, K].
        grad_w = gemm(grad.t(), x, cu_seqlens_k=cu) if need_w else None
        return grad_x, None, grad_w


def moe_experts_grouped(
    x: torch.Tensor, tokens_per_expert: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor
) -> torch.Tensor:
    """`moe_experts_grouped_eager`'s contract on quack's varlen GEMM: x ``[N, H]`` expert-major,
    tokens_per_expert ``[E]``, gate_up_proj ``[E, 2I, H]``, down_proj ``[E, H, I]`` (bf16/fp16). Returns ``[N, H]``."""
    check_grouped_inputs(x, tokens_per_expert, gate_up_proj, down_proj)
    return torch_impl.run_experts(
        x, group_offsets(tokens_per_expert), gate_up_proj, down_proj, mm=_QuackGroupedMM.apply
    )


def moe_experts_routed(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """`moe_experts_routed_eager`'s contract on quack's varlen GEMM: hidden ``[T, H]``, top_k_index ``[T, k]``
    int64, top_k_weights ``[T, k]``, weights as in `moe_experts_grouped`. Returns ``[T, H]``."""
    check_routed_inputs(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj)
    return torch_impl.route_experts(
        hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, mm=_QuackGroupedMM.apply
    )
