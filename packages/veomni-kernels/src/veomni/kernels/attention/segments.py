"""Packed rows on the CPU: SDPA one segment at a time, as torch custom ops (``veomni::sdpa_segments_fwd`` /
``veomni::sdpa_segments_bwd``).

Why: a block-diagonal ``[S, S]`` mask makes every query score all ``S`` keys of its row, while CPU training rows
hold many short documents (the VLM quickstart's: ~56 tokens in a 1,024-token row), so the masked call spends
``S^2 / sum(n_i^2)`` times the FLOPs (~18x there). Running each segment unmasked costs only its own ``n_i^2``.

Why custom ops: the offsets are read on the host, which dynamo refuses under ``fullgraph``. Behind an op the host
read happens at run time, so eager and compiled blocks (aot_eager or inductor) run the same calls and stay
bitwise equal, and a change in the number of documents changes no traced shape. The ops call ATen's CPU flash
attention and its backward directly (the kernels ``F.scaled_dot_product_attention`` picks on the CPU without a
mask): the forward keeps the log-sum-exp for the backward, so nothing is recomputed. That kernel needs one head
size for q, k and v, so ``Dv != D`` stays on the mask path (`runs_per_segment`).

No Python annotations module import here: ``torch.library`` reads the type hints at registration.
"""

import itertools
from typing import Any

import torch
from torch import Tensor

__all__ = ["runs_per_segment", "sdpa_segments", "segment_offsets"]

_ATEN = torch.ops.aten


def segment_offsets(cu_seqlens: Tensor, seq_len: int) -> list[int]:
    """``cu_seqlens`` as a list, after checking it tiles ``[0, seq_len]`` (a host read: eager / CPU paths only)."""
    offsets = cu_seqlens.tolist()
    # Empty segments are allowed: shape-stable packing (CUDA graphs) pads the table with them.
    if offsets[0] != 0 or offsets[-1] != seq_len or any(b < a for a, b in itertools.pairwise(offsets)):
        raise ValueError(
            f"cu_seqlens must run from 0 to S={seq_len} without decreasing (empty segments allowed), got {offsets}"
        )
    return offsets


def runs_per_segment(q: Tensor, v: Tensor, window: int | None, sinks: Tensor | None) -> bool:
    """Whether `sdpa_segments` serves a packed SDPA call: CPU tensors, one head size, no window and no sinks."""
    return q.device.type == "cpu" and v.shape[-1] == q.shape[-1] and window is None and sinks is None


def _lse_dtype(q: Tensor) -> torch.dtype:
    # The kernel keeps the log-sum-exp in fp32, or in fp64 for fp64 inputs.
    return torch.promote_types(q.dtype, torch.float32)


def _heads_first(x: Tensor, groups: int) -> Tensor:
    """``[1, S, H, D]`` -> ``[1, H * groups, S, D]`` (a view when ``groups == 1``): the kernel's layout, each head
    repeated ``groups`` times for GQA (consecutive query heads share one). Done once per call, then sliced."""
    x = x.repeat_interleave(groups, dim=2) if groups > 1 else x
    return x.transpose(1, 2)


def _spans(cu_seqlens: Tensor, seq_len: int) -> list[tuple[int, int]]:
    """The non-empty segments ``(start, end)`` of a validated offset table."""
    return [(a, b) for a, b in itertools.pairwise(segment_offsets(cu_seqlens, seq_len)) if b > a]


@torch.library.custom_op("veomni::sdpa_segments_fwd", mutates_args=())
def sdpa_segments_fwd(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, causal: bool, scale: float | None
) -> tuple[Tensor, Tensor]:
    """``q [1, S, Hq, D]``, ``k``/``v [1, S, Hkv, D]``, ``cu_seqlens`` int32 ``[n + 1]`` on the CPU.

    Returns ``(out [1, S, Hq, D] in q.dtype, lse [1, Hq, S])``; lse in fp32 (fp64 for fp64 inputs).
    """
    groups = q.shape[2] // k.shape[2]
    qh, kh, vh = q.transpose(1, 2), _heads_first(k, groups), _heads_first(v, groups)
    out = q.new_empty(q.shape)
    lse = q.new_empty((1, q.shape[2], q.shape[1]), dtype=_lse_dtype(q))
    for a, b in _spans(cu_seqlens, q.shape[1]):
        seg_out, seg_lse = _ATEN._scaled_dot_product_flash_attention_for_cpu(
            qh[:, :, a:b], kh[:, :, a:b], vh[:, :, a:b], 0.0, causal, scale=scale
        )
        out[:, a:b] = seg_out.transpose(1, 2)
        lse[:, :, a:b] = seg_lse
    return out, lse


@sdpa_segments_fwd.register_fake
def _(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, causal: bool, scale: float | None
) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.shape), q.new_empty((1, q.shape[2], q.shape[1]), dtype=_lse_dtype(q))


@torch.library.custom_op("veomni::sdpa_segments_bwd", mutates_args=())
def sdpa_segments_bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens: Tensor,
    causal: bool,
    scale: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` in the shapes and dtypes of ``(q, k, v)``; ``out``/``lse`` from the forward."""
    hkv, groups = k.shape[2], q.shape[2] // k.shape[2]
    qh, kh, vh = q.transpose(1, 2), _heads_first(k, groups), _heads_first(v, groups)
    douth, outh = dout.transpose(1, 2), out.transpose(1, 2)
    # Every row is written: the offsets tile [0, S] (checked), and empty segments own no rows. Contiguous, as the
    # fake kernel says: empty_like would copy the strides of an HF-layout view, which inductor then rejects.
    dq = q.new_empty(q.shape)
    dk_rep, dv_rep = q.new_empty(q.shape), q.new_empty((*q.shape[:3], v.shape[-1]))  # per query head
    for a, b in _spans(cu_seqlens, q.shape[1]):
        seg_dq, seg_dk, seg_dv = _ATEN._scaled_dot_product_flash_attention_for_cpu_backward(
            douth[:, :, a:b],
            qh[:, :, a:b],
            kh[:, :, a:b],
            vh[:, :, a:b],
            outh[:, :, a:b],
            lse[:, :, a:b],
            0.0,
            causal,
            scale=scale,
        )
        dq[:, a:b] = seg_dq.transpose(1, 2)
        dk_rep[:, a:b] = seg_dk.transpose(1, 2)
        dv_rep[:, a:b] = seg_dv.transpose(1, 2)
    # A KV head's gradient is the sum over the query heads that shared it.
    dk = torch.unflatten(dk_rep, 2, (hkv, groups)).sum(3).to(k.dtype)
    dv = torch.unflatten(dv_rep, 2, (hkv, groups)).sum(3).to(v.dtype)
    return dq, dk, dv


@sdpa_segments_bwd.register_fake
def _(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens: Tensor,
    causal: bool,
    scale: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, cu_seqlens, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.causal, ctx.scale = causal, scale
    ctx.mark_non_differentiable(lse)


def _backward(
    ctx: Any, dout: Tensor, _dlse: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, None, None, None]:
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = sdpa_segments_bwd(dout.contiguous(), q, k, v, out, lse, cu_seqlens, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None, None


sdpa_segments_fwd.register_autograd(_backward, setup_context=_setup)


def sdpa_segments(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, causal: bool, scale: float | None
) -> Tensor:
    """Packed attention of ``q [1, S, Hq, D]`` over ``k``/``v [1, S, Hkv, D]`` (CPU), segment by segment.

    The same result as SDPA under the block-diagonal (causal) mask of ``cu_seqlens`` (int32 ``[n + 1]``, validated
    against S; empty segments allowed). Returns ``[1, S, Hq, D]`` in q's dtype.
    """
    out_lse: tuple[Tensor, Tensor] = sdpa_segments_fwd(q, k, v, cu_seqlens, causal, scale)
    return out_lse[0]
