"""Vision and multimodal rotary embeddings: eager oracles (``rope_vision/full`` and ``rope/mrope``).

``rope_vision/full`` is the 2-D rotary of ViT towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): tokens in the packed
``[S, H, D]`` layout, one ``cos``/``sin`` row ``[S, D]`` per patch (the height and width frequencies are already
concatenated by the tower's rotary module), HF's rotate-half formula computed in fp32 and rounded once to the
input dtype (HF's ``apply_rotary_pos_emb_vision``).

``rope/mrope`` is the multimodal rotary (M-RoPE) of a VLM's language model: three position tables (temporal,
height, width) ``cos/sin [3, B, S, D]``; each half-dim frequency ``j`` takes its table from the section it falls
in (``mrope_section = [t, h, w]``, summing to ``D / 2``: the first ``t`` frequencies from table 0, the next
``h`` from table 1, ...), mirrored on the second half; then the text RoPE formula in the input dtype (HF's
``apply_multimodal_rotary_pos_emb``). Qwen3-VL's *interleaved* M-RoPE is folded into its rotary module and
reaches attention as plain ``[B, S, D]`` cos/sin, i.e. ``rope/full``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from veomni.kernels.rope.eager import apply_rope_eager, rotate_half

__all__ = ["apply_mrope_eager", "apply_rope_vision_eager", "check_vision_inputs", "mrope_select"]


def check_vision_inputs(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``q [S, Hq, D]``, ``k [S, Hk, D]``, ``cos/sin [S, D]`` (D even, float)."""
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(
            f"rope_vision: q and k must be [S, H, D]; got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    s, _, d = q.shape
    if k.shape[0] != s or k.shape[2] != d:
        raise ValueError(
            f"rope_vision: k must be [S, Hk, D] matching q {tuple(q.shape)}; got {tuple(k.shape)}"
        )
    if not q.is_floating_point() or q.dtype != k.dtype:
        raise ValueError(f"rope_vision: q and k must share one float dtype; got {q.dtype} and {k.dtype}")
    if cos.shape != (s, d) or sin.shape != (s, d):
        raise ValueError(
            f"rope_vision: cos and sin must be [S, D] = {(s, d)}; got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if d % 2:
        raise ValueError(f"rope_vision: head dim D must be even, got {d}")


def apply_rope_vision_eager(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ViT 2-D rotary on packed tokens, in fp32, rounded once.

    Args:
        q: ``[S, Hq, D]``; k: ``[S, Hk, D]`` (same dtype); cos, sin: ``[S, D]`` (any float dtype).
    Returns:
        ``(q_out, k_out)`` shaped and typed as q and k; differentiable w.r.t. q and k (and cos/sin).
    """
    check_vision_inputs(q, k, cos, sin)
    c, s = cos.float().unsqueeze(1), sin.float().unsqueeze(1)  # [S, 1, D]: broadcast over heads
    q32, k32 = q.float(), k.float()
    q_out = q32 * c + rotate_half(q32) * s
    k_out = k32 * c + rotate_half(k32) * s
    return q_out.to(q.dtype), k_out.to(k.dtype)


def mrope_select(
    cos: torch.Tensor, sin: torch.Tensor, mrope_section: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-frequency table selection of M-RoPE: ``cos/sin [3, B, S, D]`` -> ``[B, S, D]``.

    Raises ``ValueError`` unless ``mrope_section`` holds three non-negative ints summing to ``D / 2``.
    """
    if cos.dim() != 4 or cos.shape[0] != 3 or cos.shape != sin.shape:
        raise ValueError(
            f"rope/mrope: cos and sin must be [3, B, S, D] (temporal, height, width tables); got "
            f"{tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    half = cos.shape[-1] // 2
    sections = list(mrope_section)
    if len(sections) != 3 or any(not isinstance(x, int) or x < 0 for x in sections) or sum(sections) != half:
        raise ValueError(
            f"rope/mrope: mrope_section must be 3 ints >= 0 summing to D/2 = {half}; got {mrope_section!r}"
        )
    # Axis of each of the D columns: section i uses table i, and the second half mirrors the first.
    axis = torch.repeat_interleave(torch.arange(3), torch.tensor(sections)).repeat(2).to(cos.device)
    index = axis.view(1, 1, 1, -1).expand(1, *cos.shape[1:])
    return cos.gather(0, index).squeeze(0), sin.gather(0, index).squeeze(0)


def apply_mrope_eager(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    mrope_section: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multimodal rotary (M-RoPE) in HF's text formula (input-dtype arithmetic).

    Args:
        q: ``[B, Hq, S, D]``; k: ``[B, Hkv, S, D]``; cos, sin: ``[3, B, S, D]`` temporal/height/width tables;
        mrope_section: ``[t, h, w]`` summing to ``D / 2``.
    Returns:
        ``(q_out, k_out)`` shaped and typed as q and k.
    """
    cos3, sin3 = mrope_select(cos, sin, mrope_section)
    return apply_rope_eager(q, k, cos3, sin3)
