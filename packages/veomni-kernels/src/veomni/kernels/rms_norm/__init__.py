"""RMSNorm kernels as plain tensor functions, one module per implementation.

Every implementation module exposes the same four functions, one per semantic variant:

- ``rms_norm_standard(x, weight, eps)``: Llama/Qwen, ``weight * x̂.to(x.dtype)``;
- ``rms_norm_offset(x, weight, eps)``: Qwen3.5/Gemma, ``(x̂ · (1 + weight.float())).to(x.dtype)``;
- ``rms_norm_unweighted(x, eps)``: ``x̂.to(x.dtype)``;
- ``fused_add_rms_norm(x, residual, weight, eps) -> (y, x + residual)``: residual add, then ``standard``;

with ``x̂ = x.float() · rsqrt(mean(x.float()², -1) + eps)``. Implementations: ``eager`` (the oracles),
``torch_native`` (``torch.nn.functional.rms_norm``) and ``triton_impl`` (fused Triton kernels; imported on
demand so that importing this package does not import Triton).
"""

from __future__ import annotations

from veomni.kernels.rms_norm import eager, torch_native

__all__ = ["eager", "torch_native"]
