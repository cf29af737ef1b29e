"""Triton ``rope_vision/full`` and ``rope/mrope``: both reuse the rotate-half Triton kernel (`triton_impl`).

Vision: the packed ``[S, H, D]`` tokens are the strided view ``[1, H, S, D]`` of the same memory, which the kernel
takes as is (no copy); it rotates in fp32 and rounds once, which is exactly HF's vision formula, so this matches the
eager oracle to fp32 rounding in every dtype. M-RoPE: the per-frequency table selection (`mrope_select`) is a
gather over ``[B, S, D]`` -- ``H`` times less data than the rotation itself -- done in torch; the rotation is the
Triton kernel (fp32 math rounded once, so in bf16 it differs from HF's input-dtype formula by a few ulps).
cos/sin get no gradient (position tables are constants), as in the text kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from veomni.kernels.rope.multimodal import check_vision_inputs, mrope_select
from veomni.kernels.rope.triton_impl import apply_rope_triton

__all__ = ["apply_mrope_triton", "apply_rope_vision_triton"]


def apply_rope_vision_triton(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ViT 2-D rotary: ``q [S, Hq, D]``, ``k [S, Hk, D]``, ``cos/sin [S, D]``; returns rotated q, k (same layout)."""
    check_vision_inputs(q, k, cos, sin)
    q_out, k_out = apply_rope_triton(
        q.permute(1, 0, 2).unsqueeze(0), k.permute(1, 0, 2).unsqueeze(0), cos, sin
    )
    return q_out.squeeze(0).permute(1, 0, 2), k_out.squeeze(0).permute(1, 0, 2)


def apply_mrope_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    mrope_section: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE: ``q [B, Hq, S, D]``, ``k [B, Hkv, S, D]``, ``cos/sin [3, B, S, D]``, ``mrope_section [t, h, w]``."""
    cos3, sin3 = mrope_select(cos.detach(), sin.detach(), mrope_section)
    return apply_rope_triton(q, k, cos3, sin3)
