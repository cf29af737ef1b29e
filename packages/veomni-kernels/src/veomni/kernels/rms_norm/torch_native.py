"""RMSNorm through ``torch.nn.functional.rms_norm`` (PyTorch's own fused kernel where it applies).

``F.rms_norm(x, (H,), w, eps)`` computes ``(x̂ · w).to(x.dtype)`` with ``x̂`` and the product in fp32 (the
"all fp32, cast at the end" order). Each variant below is built so that this order reproduces the eager
oracle exactly:

- ``unweighted``: ``F.rms_norm`` without a weight.
- ``standard``: Llama rounds ``x̂`` to x's dtype *before* the weight multiply, which ``F.rms_norm`` cannot do
  with a weight inside it, so the weight is applied outside: ``weight * F.rms_norm(x, (H,), None, eps)``.
  Exact, at the price of one extra elementwise kernel.
- ``offset``: ``(1 + weight.float())`` is passed as an fp32 weight. Exact; when x is not fp32 PyTorch cannot
  use its fused kernel for mixed dtypes, warns once, and runs its composite (multi-kernel) path instead.
- ``fused_add``: ``x + residual`` in the input dtype, then ``standard``.

Anything the oracles reject (bad shapes, dtypes, eps) is rejected here with the same message.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from veomni.kernels.rms_norm.eager import check_inputs

__all__ = ["fused_add_rms_norm", "rms_norm_offset", "rms_norm_standard", "rms_norm_unweighted"]


def rms_norm_standard(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama/Qwen RMSNorm ``weight * x̂.to(x.dtype)`` via ``F.rms_norm``.

    ``x``: ``[..., H]`` any float dtype; ``weight``: ``[H]``. Returns ``[..., H]`` in
    ``promote_types(x.dtype, weight.dtype)``.
    """
    check_inputs(x, weight, eps)
    return weight * F.rms_norm(x, (x.shape[-1],), None, float(eps))


def rms_norm_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5/Gemma RMSNorm ``(x̂ · (1 + weight.float())).to(x.dtype)`` via ``F.rms_norm``.

    ``x``: ``[..., H]`` any float dtype; ``weight``: ``[H]``. Returns ``[..., H]`` in ``x.dtype``.
    """
    check_inputs(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), 1.0 + weight.float(), float(eps))


def rms_norm_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight, ``x̂.to(x.dtype)``, via ``F.rms_norm``.

    ``x``: ``[..., H]`` any float dtype. Returns ``[..., H]`` in ``x.dtype``.
    """
    check_inputs(x, None, eps)
    return F.rms_norm(x, (x.shape[-1],), None, float(eps))


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm_standard(x + residual), x + residual)`` with the norm via ``F.rms_norm``.

    ``x``, ``residual``: ``[..., H]`` of one float dtype; ``weight``: ``[H]``. Not fused: an add kernel, the
    norm kernel and the weight multiply. Returns ``(y, new_residual)`` as in the eager oracle.
    """
    check_inputs(x, weight, eps, residual)
    new_residual = x + residual
    return rms_norm_standard(new_residual, weight, eps), new_residual
