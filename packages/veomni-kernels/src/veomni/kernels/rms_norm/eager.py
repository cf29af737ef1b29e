"""Eager RMSNorm: the plain-PyTorch oracles every other implementation is tested against.

Each function is differentiable through autograd and spells out the casting order of its variant, because
the variants differ only in where the fp32 result is rounded back to the input dtype.
"""

from __future__ import annotations

import torch

__all__ = [
    "check_inputs",
    "fused_add_rms_norm",
    "rms_norm_offset",
    "rms_norm_standard",
    "rms_norm_unweighted",
]


def check_inputs(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
) -> None:
    """Raise ``ValueError`` unless the arguments form a valid RMSNorm call.

    ``x``: ``[..., H]`` floating point, ``H >= 1``; ``weight``: ``[H]`` floating point on ``x``'s device,
    or ``None`` for the unweighted variant; ``eps``: a finite float ``>= 0``; ``residual``: ``None`` or a
    tensor of ``x``'s shape, dtype and device. Shared by every implementation so that they fail alike.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"rms_norm: x must be a floating-point tensor, got {_describe(x)}")
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"rms_norm: x must have shape [..., H] with H >= 1, got {tuple(x.shape)}")
    hidden = x.shape[-1]
    if weight is not None:
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            raise ValueError(f"rms_norm: weight must be a floating-point tensor, got {_describe(weight)}")
        if tuple(weight.shape) != (hidden,):
            raise ValueError(
                f"rms_norm: weight must have shape [H] = ({hidden},) to match x {tuple(x.shape)}, "
                f"got {tuple(weight.shape)}"
            )
        if weight.device != x.device:
            raise ValueError(f"rms_norm: weight is on {weight.device} but x is on {x.device}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0 or eps == float("inf"):
        raise ValueError(f"rms_norm: eps must be a finite number >= 0, got {eps!r}")
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise ValueError(f"rms_norm: residual must be a tensor, got {_describe(residual)}")
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(
                "rms_norm: residual must match x in shape, dtype and device: "
                f"x {tuple(x.shape)} {x.dtype} {x.device}, "
                f"residual {tuple(residual.shape)} {residual.dtype} {residual.device}"
            )


def _describe(obj: object) -> str:
    if isinstance(obj, torch.Tensor):
        return f"a {obj.dtype} tensor of shape {tuple(obj.shape)}"
    return f"{type(obj).__name__}"


def _normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    # The reduction and the scaling stay in fp32 whatever x's dtype: bf16 sums of squares lose too much.
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm_standard(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama/Qwen RMSNorm: ``weight * (x̂.to(x.dtype))`` with ``x̂ = x·rsqrt(mean(x², -1) + eps)`` in fp32.

    ``x``: ``[..., H]`` any float dtype; ``weight``: ``[H]``. Returns ``[..., H]`` in
    ``torch.promote_types(x.dtype, weight.dtype)`` (bf16 for bf16 x and weight). The cast back to x's dtype
    happens *before* the weight multiply, exactly as HF ``LlamaRMSNorm``.
    """
    check_inputs(x, weight, eps)
    return weight * _normalize(x, eps).to(x.dtype)


def rms_norm_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5/Gemma RMSNorm: ``(x̂ · (1 + weight.float())).to(x.dtype)``, everything in fp32.

    ``x``: ``[..., H]`` any float dtype; ``weight``: ``[H]`` (zero-initialised in those models). Returns
    ``[..., H]`` in ``x.dtype``.
    """
    check_inputs(x, weight, eps)
    return (_normalize(x, eps) * (1.0 + weight.float())).to(x.dtype)


def rms_norm_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight: ``x̂.to(x.dtype)``.

    ``x``: ``[..., H]`` any float dtype. Returns ``[..., H]`` in ``x.dtype``.
    """
    check_inputs(x, None, eps)
    return _normalize(x, eps).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then standard RMSNorm: returns ``(rms_norm_standard(x + residual), x + residual)``.

    ``x``, ``residual``: ``[..., H]`` of one float dtype; ``weight``: ``[H]``. The sum is rounded to the input
    dtype (it is the next layer's residual stream) and that rounded sum is what gets normalised. Returns
    ``(y, new_residual)``: ``y`` in ``promote_types(x.dtype, weight.dtype)``, ``new_residual`` in ``x.dtype``.
    """
    check_inputs(x, weight, eps, residual)
    new_residual = x + residual
    return rms_norm_standard(new_residual, weight, eps), new_residual
