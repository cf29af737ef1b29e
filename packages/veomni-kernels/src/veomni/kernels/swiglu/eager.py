"""Eager SwiGLU activation, ``silu(gate) * up``, in plain PyTorch: the oracle for the Triton kernel.

Dtype behaviour: like HF's ``act_fn(gate_proj(x)) * up_proj(x)``, ``silu`` runs in the input dtype
(PyTorch computes it internally in fp32 and rounds once) and the product is rounded again, so in bf16 the
result can differ from an all-fp32 computation by about one ulp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_swiglu_inputs(gate: torch.Tensor, up: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``gate`` and ``up`` share one shape, one float dtype and one device."""
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have one shape; got {tuple(gate.shape)} and {tuple(up.shape)}")
    if gate.dtype != up.dtype or not gate.is_floating_point():
        raise ValueError(f"gate and up must share one float dtype; got {gate.dtype} and {up.dtype}")
    if gate.device != up.device:
        raise ValueError(f"gate and up must be on one device; got {gate.device} and {up.device}")
    if gate.dim() == 0:
        raise ValueError("gate and up must have at least one dimension ([..., I])")


def swiglu_eager(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``.

    Args:
        gate, up: ``[..., I]``, one shape and one float dtype (the gate and up projections' outputs).
    Returns:
        ``[..., I]`` in the input dtype. Autograd saves ``gate``, ``up`` and ``silu(gate)``.
    """
    check_swiglu_inputs(gate, up)
    return F.silu(gate) * up
