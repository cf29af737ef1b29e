"""The ``liger`` backend: liger-kernel's Triton kernels behind veomni's plain-function signatures.

Imported only when a config selects ``liger`` (liger-kernel is the optional ``veomni-kernels[liger]`` extra and
needs CUDA). Every wrapper asks liger for out-of-place results: its in-place default overwrites the upstream
gradient buffer, which autograd may still hand to another consumer.
"""

from __future__ import annotations

import torch
from liger_kernel.ops.rms_norm import LigerRMSNormFunction
from liger_kernel.ops.rope import LigerRopeFunction
from liger_kernel.ops.swiglu import LigerSiLUMulFunction


def rms_norm_standard(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama/Qwen RMSNorm (liger's ``llama`` casting: normalise in fp32, cast, then scale). ``x [..., H]``."""
    result: torch.Tensor = LigerRMSNormFunction.apply(x, weight, eps, 0.0, "llama", False)
    return result


def rms_norm_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(1 + weight)`` RMSNorm computed in fp32 (liger's ``gemma`` casting). ``x [..., H]``."""
    result: torch.Tensor = LigerRMSNormFunction.apply(x, weight, eps, 1.0, "gemma", False)
    return result


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, rotary_dim: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE; q ``[B, Hq, S, D]``, k ``[B, Hkv, S, D]``, cos/sin ``[B|1, S, R]`` or ``[S, R]``."""
    result: tuple[torch.Tensor, torch.Tensor] = LigerRopeFunction.apply(q, k, cos, sin, None, 1, rotary_dim)
    return result


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` over ``[..., I]``."""
    result: torch.Tensor = LigerSiLUMulFunction.apply(gate, up)
    return result
