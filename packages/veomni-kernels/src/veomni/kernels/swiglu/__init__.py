"""SwiGLU activation ``silu(gate) * up`` on ``[..., I]``: eager oracle and a Triton kernel."""

from __future__ import annotations

from veomni.kernels.swiglu.eager import check_swiglu_inputs, swiglu_eager
from veomni.kernels.swiglu.triton_impl import swiglu_triton

__all__ = ["check_swiglu_inputs", "swiglu_eager", "swiglu_triton"]
