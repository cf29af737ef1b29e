"""What veomni's HF attention functions read from HF's call before a kernel runs, and the kernel call itself.

Shared by the synchronous functions (`veomni.models.hf.attention`) and the async Ulysses path
(`veomni.models.hf.async_sp`), and by the LM heads that must know whether Ulysses SP is on (`current_sp_state`):

* packing: ``cu_seq_lens_q`` (no host sync) or segments found in ``position_ids`` (one host sync), all-gathered
  over the SP group when the positions are a shard (`packing_metadata`, `packed_kwargs` for collators);
* the 2-D right-padding mask check, on device (`check_padding_mask`);
* the optional kernel features HF passes (sliding window, sinks, soft-cap: `attention_features`) and what a
  Ulysses call needs besides q/k/v (`sp_kernel_kwargs`);
* the kernel call on ``[B, S, H, D]`` tensors (`run_kernel`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from veomni.core.parallel_state import ParallelState, current_parallel_state
from veomni.core.sp import gather_sequence

__all__ = [
    "attention_features",
    "check_padding_mask",
    "cu_from_positions",
    "current_sp_state",
    "packed_kwargs",
    "packing_metadata",
    "run_kernel",
    "sp_kernel_kwargs",
]


def current_sp_state() -> ParallelState | None:
    """The current parallel state when it runs Ulysses SP (``dims.sp > 1``), else None (also without a state)."""
    # No current state is the ordinary single-process case, not an error: core raises; we read it as "no SP".
    try:
        state = current_parallel_state()
    except RuntimeError:
        return None
    return state if state.dims.sp > 1 else None


def attention_features(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The optional attention features HF passes: ``sliding_window`` (int), ``s_aux`` (sinks ``[Hq]``),
    ``softcap`` (float), as the kernels' ``window`` / ``sinks`` / ``softcap`` (None when off)."""
    return {
        "window": kwargs.get("sliding_window"),
        "sinks": kwargs.get("s_aux"),
        "softcap": kwargs.get("softcap"),
    }


def check_padding_mask(mask: torch.Tensor, causal: bool, name: str) -> None:
    """Accept only a bool ``[B, S]`` right-padding mask on causal attention (``name``: the implementation, for errors).

    The right-padding check runs on device (``torch._assert_async``), so it costs no host sync.
    """
    if mask.dim() != 2 or mask.dtype != torch.bool:
        raise NotImplementedError(
            f"{name} takes no pre-built attention masks, only a 2-D padding mask; got {mask.dtype} "
            f"{tuple(mask.shape)}. Causality comes from module.is_causal and packing from cu_seq_lens_q / "
            "position_ids"
        )
    if not causal:
        raise NotImplementedError(
            f"{name}: padding masks with bidirectional attention are not supported; pack the sequences "
            "instead (position_ids / cu_seq_lens_q, no attention_mask)"
        )
    # Right padding only: a kept token after a padded one would attend to the padding. On device: no sync.
    left_padded = (mask[:, 1:] & ~mask[:, :-1]).any()
    torch._assert_async(
        ~left_padded,
        f"{name} supports right padding only (a real token follows a padding token in attention_mask); "
        "pad on the right or pack the sequences",
    )


def packing_metadata(
    kwargs: dict[str, Any],
    batch: int,
    seq_len: int,
    *,
    group: dist.ProcessGroup | None,
    full_len: int | None,
) -> tuple[torch.Tensor | None, int | None]:
    """``(cu_seqlens int32 | None, max_seqlen | None)`` over the full sequence, from HF's attention kwargs."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        cu_k = kwargs.get("cu_seq_lens_k")
        if cu_k is not None and cu_k.shape != cu.shape:
            raise NotImplementedError(
                f"cu_seq_lens_k {tuple(cu_k.shape)} differs from cu_seq_lens_q {tuple(cu.shape)}: "
                "veomni attention is self-attention over one packing"
            )
        max_len = kwargs.get("max_length_q")
        # A tensor max_length (HF computes one that way) costs a sync to read; kernels that need it compute
        # it themselves, so pass it on only when it is a python int.
        return cu.to(torch.int32), max_len if isinstance(max_len, int) else None
    positions = kwargs.get("position_ids")
    if positions is None:
        return None, None
    positions = positions.reshape(-1, positions.shape[-1]).expand(batch, -1)
    if positions.shape[1] != seq_len:
        raise ValueError(f"position_ids {tuple(positions.shape)} do not match {seq_len} query tokens")
    if group is not None:
        # Under SP each rank holds a shard of the positions; segments are a property of the whole sequence.
        positions = gather_sequence(positions.contiguous(), group, dim=1, equal_sizes=True)[:, :full_len]
    cu = cu_from_positions(positions)
    if cu.numel() - 1 == batch:
        return None, None  # one sequence per row: an ordinary batch, which every kernel runs fastest unpacked
    return cu, None


def sp_kernel_kwargs(
    state: ParallelState,
    kwargs: dict[str, Any],
    features: dict[str, Any],
    *,
    batch: int,
    local_len: int,
    query_heads: int,
) -> dict[str, Any]:
    """What a Ulysses call needs besides q/k/v (shared with `veomni.models.hf.async_sp`): ``unpadded_len``, the
    full-sequence ``cu_seqlens`` / ``max_seqlen`` and the features, sinks cut to this rank's heads."""
    group = state.sp_group
    padded_len = local_len * dist.get_world_size(group)
    unpadded_len = kwargs.get("sp_unpadded_len")
    if unpadded_len is not None and not 0 < unpadded_len <= padded_len:
        raise ValueError(
            f"sp_unpadded_len={unpadded_len} does not fit shards of {local_len} tokens on "
            f"{dist.get_world_size(group)} ranks (expected 1 to {padded_len})"
        )
    full_len = padded_len if unpadded_len is None else unpadded_len
    cu_seqlens, max_seqlen = packing_metadata(kwargs, batch, local_len, group=group, full_len=full_len)
    features = dict(features)
    if features["sinks"] is not None:
        # The exchange hands rank r the r-th block of H / P query heads; the kernel sees only their sinks.
        local_heads = query_heads // dist.get_world_size(group)
        features["sinks"] = features["sinks"].narrow(0, dist.get_rank(group) * local_heads, local_heads)
    # The window needs no care: the kernel sees the full sequence, so it applies to global positions.
    return {"unpadded_len": unpadded_len, "cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen, **features}


def packed_kwargs(position_ids: torch.Tensor) -> dict[str, Any]:
    """Packing kwargs for an HF forward, from the full sequence's ``position_ids`` (for collators and tests).

    Args:
        position_ids: ``[S]`` or ``[1, S]`` int positions of one packed row; a document starts wherever the
            position is not its predecessor + 1.
    Returns:
        ``{"cu_seq_lens_q", "cu_seq_lens_k": int32 [n + 1], "max_length_q", "max_length_k": int}`` on the
        positions' device (computing them syncs with the host once; do it in the data pipeline).
    """
    flat = position_ids.reshape(1, -1)
    cu = cu_from_positions(flat)
    max_len = int((cu[1:] - cu[:-1]).max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_len, "max_length_k": max_len}


def cu_from_positions(positions: torch.Tensor) -> torch.Tensor:
    """int32 ``[n + 1]`` segment offsets of the flattened ``[B, S]`` positions (one host sync: nonzero)."""
    batch, seq = positions.shape
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    offsets = starts.reshape(-1).nonzero().reshape(-1)
    end = offsets.new_full((1,), batch * seq)  # a fill: no blocking host -> device copy
    return torch.cat([offsets, end]).to(torch.int32)


def run_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    kernel: Callable[..., torch.Tensor],
    causal: bool,
    cu_seqlens: torch.Tensor | None,
    max_seqlen: int | None,
    scale: float | None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``[B, S, H, D]`` in and out; with ``cu_seqlens`` the batch runs as one packed row of B * S tokens.

    The optional features are passed on only when set, so kernels of the older signature keep working."""
    batch, seq = q.shape[:2]
    if cu_seqlens is not None and batch > 1:
        q, k, v = (t.reshape(1, batch * seq, *t.shape[2:]) for t in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    features = {
        key: value
        for key, value in (("window", window), ("sinks", sinks), ("softcap", softcap))
        if value is not None
    }
    out = kernel(
        q, k, v, causal=causal, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, scale=scale, **features
    )
    return out.reshape(batch, seq, *out.shape[2:])
