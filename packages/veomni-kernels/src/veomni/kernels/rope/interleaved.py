"""Interleaved-pair RoPE (the ``rope/interleaved`` variant): the layout of Wan and other video DiTs.

Head dims ``(2i, 2i+1)`` form one pair rotated by angle ``θ_i`` (HF's rotate-half pairs ``i`` with ``i + D/2``
instead, so the two layouts are different maths and different variants). Tensors stay in the DiT's natural
``[B, S, H, D]`` layout; ``cos``/``sin`` carry one value per head dim, each angle repeated for both dims of its pair
(diffusers' ``get_1d_rotary_pos_embed(..., repeat_interleave_real=True)``), and, exactly as diffusers'
``WanAttnProcessor`` does, the even entries of ``cos`` and the odd entries of ``sin`` are the ones read.

Dtype behaviour: inputs are converted to fp32, rotated in fp32 and rounded once to q's dtype. diffusers computes
in the dtype of its rotary tables (float64 for Wan), so in fp32 the two agree to about one fp32 ulp, and in bf16
they round the same up to rare double-rounding ties.
"""

from __future__ import annotations

import torch


def check_interleaved_inputs(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Raise ``ValueError`` unless the operands follow :func:`apply_rope_interleaved_eager`'s layouts."""
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(
            f"interleaved rope: q and k must be [B, S, H, D]; got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    b, s, _, d = q.shape
    if k.shape[0] != b or k.shape[1] != s or k.shape[3] != d:
        raise ValueError(
            f"interleaved rope: k must be [B, S, Hk, D] matching q {tuple(q.shape)}; got {tuple(k.shape)}"
        )
    if q.dtype != k.dtype or not q.is_floating_point():
        raise ValueError(f"interleaved rope: q and k must share one float dtype; got {q.dtype} and {k.dtype}")
    if d % 2:
        raise ValueError(f"interleaved rope: the head size D must be even (pairs of dims); got D={d}")
    if cos.shape != sin.shape or not (cos.is_floating_point() and sin.is_floating_point()):
        raise ValueError(
            f"interleaved rope: cos and sin must be float tensors of one shape; got {tuple(cos.shape)} "
            f"{cos.dtype} and {tuple(sin.shape)} {sin.dtype}"
        )
    lead_ok = (cos.dim() == 2 and cos.shape[0] == s) or (
        cos.dim() == 4 and cos.shape[0] in (1, b) and cos.shape[1] == s and cos.shape[2] == 1
    )
    if not lead_ok or cos.shape[-1] != d:
        raise ValueError(
            f"interleaved rope: cos/sin must be [S, D], [1, S, 1, D] or [B, S, 1, D] with B={b}, S={s}, D={d}; "
            f"got {tuple(cos.shape)}"
        )


def table_rows(t: torch.Tensor, batch: int) -> torch.Tensor:
    """``cos``/``sin`` as ``[B, S, D]`` (a view: ``[S, D]`` and ``[1, S, 1, D]`` are expanded, not copied)."""
    if t.dim() == 2:
        return t.unsqueeze(0).expand(batch, -1, -1)
    return t.squeeze(2).expand(batch, -1, -1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, S, H, D]; cos, sin: [B, S, 1, D/2] fp32 (one angle per pair).
    x1, x2 = torch.unflatten(x.float(), -1, (-1, 2)).unbind(-1)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


def apply_rope_interleaved_eager(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k pairwise: ``out[2i] = x[2i]·cos[2i] - x[2i+1]·sin[2i+1]``,
    ``out[2i+1] = x[2i]·sin[2i+1] + x[2i+1]·cos[2i]`` (diffusers' ``WanAttnProcessor`` formula).

    Args:
        q: ``[B, S, Hq, D]`` queries, any float dtype, any strides; ``D`` even.
        k: ``[B, S, Hk, D]`` keys, q's dtype.
        cos, sin: ``[S, D]``, ``[1, S, 1, D]`` or ``[B, S, 1, D]`` (Wan's rotary module returns
            ``[1, S, 1, D]`` float64), any float dtype.
    Returns:
        ``(q_out, k_out)``, contiguous, shapes and dtype of q and k; fp32 math rounded once. Differentiable by
        autograd (cos and sin included).
    """
    check_interleaved_inputs(q, k, cos, sin)
    b = q.shape[0]
    c = table_rows(cos, b)[..., 0::2].float().unsqueeze(2)
    s = table_rows(sin, b)[..., 1::2].float().unsqueeze(2)
    return _rotate(q, c, s), _rotate(k, c, s)
