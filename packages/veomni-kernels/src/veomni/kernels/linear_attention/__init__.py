"""Linear-attention kernels for Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5): plain tensor functions.

Three ops, each with an ``eager`` oracle (``eager.py``, runs anywhere) and an ``fla`` backend on
flash-linear-attention's Triton kernels (``fla_impl.py``, CUDA; imported only when a config selects it):

- ``gated_delta_rule`` / ``chunk``: the gated delta rule over ``[B, T, H, D]`` with varlen ``cu_seqlens``
  (the recurrent state restarts at every document start);
- ``causal_conv1d`` / ``standard``: the depthwise causal short convolution over ``[B, T, C]``, varlen aware;
- ``rms_norm_gated`` / ``standard``: ``RMSNorm(x) * silu(gate)`` over the last dimension.
"""

from __future__ import annotations

from veomni.kernels.linear_attention import eager

__all__ = ["eager"]
