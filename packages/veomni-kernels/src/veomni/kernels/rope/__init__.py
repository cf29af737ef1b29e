"""Rotary position embedding (HF rotate-half layout) for q ``[B, Hq, S, D]`` and k ``[B, Hkv, S, D]``.

``apply_rope_eager`` is HF's formula in plain PyTorch (the oracle); ``apply_rope_triton`` is the fused
kernel with a Triton backward. Both take ``(q, k, cos, sin, *, rotary_dim=None)`` and serve the ``full``
(``rotary_dim == D``) and ``partial`` (``rotary_dim < D``) variants.
"""

from __future__ import annotations

from veomni.kernels.rope.eager import apply_rope_eager, check_rope_inputs, rotate_half
from veomni.kernels.rope.triton_impl import apply_rope_triton

__all__ = ["apply_rope_eager", "apply_rope_triton", "check_rope_inputs", "rotate_half"]
