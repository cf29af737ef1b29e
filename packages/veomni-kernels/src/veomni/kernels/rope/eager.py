"""Eager RoPE: HuggingFace's rotate-half formula in plain PyTorch, the oracle for the Triton kernel.

Dtype behaviour: ``cos``/``sin`` are cast to the query dtype first and every product and sum is then
computed *in that dtype*, exactly like HF's ``apply_rotary_pos_emb`` (HF's rotary-embedding module already
returns cos/sin in the activations' dtype, so the cast is a no-op there). In bf16 each of ``q*cos``,
``rotate_half(q)*sin`` and their sum is rounded separately, so the result can differ from an fp32
computation by a few bf16 ulps.
"""

from __future__ import annotations

import torch


def check_rope_inputs(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int | None
) -> int:
    """Validate RoPE operands (layouts as in :func:`apply_rope_eager`) and return the rotary dim ``R``.

    Raises ``ValueError`` naming what was expected and what was found.
    """
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be [B, H, S, D]; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    b, _, s, d = q.shape
    if k.shape[0] != b or k.shape[2] != s or k.shape[3] != d:
        raise ValueError(f"k must be [B, Hkv, S, D] matching q {tuple(q.shape)}; got {tuple(k.shape)}")
    if q.dtype != k.dtype or not q.is_floating_point():
        raise ValueError(f"q and k must share one float dtype; got {q.dtype} and {k.dtype}")
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have one shape; got {tuple(cos.shape)} and {tuple(sin.shape)}")
    r = cos.shape[-1] if rotary_dim is None else rotary_dim
    if cos.shape[-1] != r:
        raise ValueError(f"rotary_dim={rotary_dim} but cos/sin carry {cos.shape[-1]} rotary dims")
    ok_lead = (cos.dim() == 2 and cos.shape[0] == s) or (
        cos.dim() == 3 and cos.shape[0] in (1, b) and cos.shape[1] == s
    )
    if not ok_lead:
        raise ValueError(
            f"cos/sin must be [B, S, R], [1, S, R] or [S, R] with B={b}, S={s}; got {tuple(cos.shape)}"
        )
    if r % 2 != 0 or not 0 < r <= d:
        raise ValueError(f"rotary_dim must be even and in (0, D={d}]; got {r}")
    return r


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[..., R]`` -> ``[..., R]``: ``cat(-x2, x1)`` where x1, x2 are the two halves of the last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    if rotary_dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


def apply_rope_eager(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    rotary_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding in HF's rotate-half layout (``q*cos + rotate_half(q)*sin``).

    Args:
        q: ``[B, Hq, S, D]`` queries, any float dtype, any strides.
        k: ``[B, Hkv, S, D]`` keys (``Hkv`` may differ from ``Hq``: GQA), same dtype as ``q``.
        cos, sin: ``[B, S, R]``, ``[1, S, R]`` or ``[S, R]``, already gathered at each token's position id
            (so packed sequences whose positions restart are handled by the caller's gather).
        rotary_dim: ``R``; defaults to ``cos.shape[-1]``. ``R < D`` rotates the first ``R`` dims of each head
            and passes the remaining ``D - R`` through unchanged (HF ``partial_rotary_factor``).
    Returns:
        ``(q_out, k_out)`` with the shapes and dtype of ``q`` and ``k``. Differentiable by autograd with
        respect to all four inputs.
    """
    rotary_dim = check_rope_inputs(q, k, cos, sin, rotary_dim)
    # [S, R] and [B, S, R] both broadcast against [B, H, S, R] once a head axis is inserted.
    cos = cos.to(q.dtype).unsqueeze(-3)
    sin = sin.to(q.dtype).unsqueeze(-3)
    return _rotate(q, cos, sin, rotary_dim), _rotate(k, cos, sin, rotary_dim)
