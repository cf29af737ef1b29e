"""The ``fla`` backend: flash-linear-attention's Triton kernels behind veomni's linear-attention signatures.

Imported only when a config selects ``fla`` (flash-linear-attention is the optional ``veomni-kernels[fla]``
extra; its kernels need CUDA). Inputs are validated with the eager oracle's checks so both backends fail alike.
"""

from __future__ import annotations

import torch
from fla.modules.causal_conv1d import causal_conv1d as _fla_causal_conv1d
from fla.modules.norm.fused_norm_gate import rms_norm_gated as _fla_rms_norm_gated
from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_chunk_gated_delta_rule

from veomni.kernels.linear_attention.eager import check_conv_inputs, check_cu_seqlens, check_delta_rule_inputs

__all__ = ["causal_conv1d_fla", "gated_delta_rule_fla", "rms_norm_gated_fla"]


def _offsets(cu_seqlens: torch.Tensor | None) -> torch.Tensor | None:
    # fla indexes its chunk tables with int64 offsets; our collator emits int32 (flash-attn's convention).
    return None if cu_seqlens is None else cu_seqlens.to(torch.long)


def gated_delta_rule_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> torch.Tensor:
    """`veomni.kernels.linear_attention.eager.gated_delta_rule_eager` on fla's chunked kernel.

    q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g, beta ``[B, T, HV]``; returns ``[B, T, HV, V]`` in q's dtype.
    ``chunk_size`` must be 64 (fla's fixed chunk); it exists so that both backends take the same arguments.
    """
    check_delta_rule_inputs(q, k, v, g, beta)
    check_cu_seqlens(cu_seqlens, q.shape[0], q.shape[1], "gated_delta_rule", check_values=False)
    if chunk_size != 64:
        raise ValueError(f"gated_delta_rule on 'fla' computes in chunks of 64, got chunk_size={chunk_size}")
    out: torch.Tensor
    out, _ = _fla_chunk_gated_delta_rule(
        q,
        k,
        v,
        g.float(),
        beta,
        scale=scale,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
        cu_seqlens=_offsets(cu_seqlens),
    )
    return out.to(q.dtype)


def causal_conv1d_fla(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = "silu",
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """`veomni.kernels.linear_attention.eager.causal_conv1d_eager` on fla's Triton kernel.

    x ``[B, T, C]``, weight ``[C, W]``, bias ``[C]`` or None; returns ``[B, T, C]`` in x's dtype.
    """
    check_conv_inputs(x, weight, bias, activation)
    check_cu_seqlens(cu_seqlens, x.shape[0], x.shape[1], "causal_conv1d", check_values=False)
    out: torch.Tensor
    out, _ = _fla_causal_conv1d(
        x, weight, bias, activation=activation, backend="triton", cu_seqlens=_offsets(cu_seqlens)
    )
    return out.to(x.dtype)


def rms_norm_gated_fla(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`veomni.kernels.linear_attention.eager.rms_norm_gated_eager` on fla's fused norm-gate kernel.

    x, gate ``[..., D]``, weight ``[D]``; returns ``[..., D]`` in x's dtype. fla keeps x̂ in fp32 through the
    weight multiply (the oracle rounds it to x's dtype first): equal within one rounding of the output.
    """
    if x.shape != gate.shape or tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(
            f"rms_norm_gated: x, gate must be [..., D] of one shape and weight [D]; got {tuple(x.shape)}, "
            f"{tuple(gate.shape)}, {tuple(weight.shape)}"
        )
    shape = x.shape
    out: torch.Tensor = _fla_rms_norm_gated(
        x.reshape(-1, shape[-1]),
        gate.reshape(-1, shape[-1]),
        weight,
        None,
        activation="swish",
        eps=float(eps),
    )
    return out.reshape(shape).to(x.dtype)
