"""Attention on plain tensors, one calling convention for every backend.

    fn(q, k, v, *, causal=True, cu_seqlens=None, max_seqlen=None, scale=None,
       window=None, sinks=None, softcap=None) -> out

* ``q``, ``k``: ``[B, S, Hq, D]`` / ``[B, S, Hkv, D]``; ``v``: ``[B, S, Hkv, Dv]`` with ``Hq % Hkv == 0``. The
  value head size ``Dv`` may differ from ``D`` (DeepSeek's MLA: D = 192, Dv = 128); the output then has ``Dv``.
  Backends that need ``Dv == D`` (varlen, FlashAttention) zero-pad ``v`` and slice the output. Grouped-query attention
  shares each KV head among *consecutive* query heads (query head ``h`` uses KV head ``h // (Hq // Hkv)``),
  the layout of HF's ``repeat_kv``.
* Cross-attention: ``k``, ``v`` may have another length ``Sk`` (``[B, Sk, Hkv, D]``) when ``causal=False`` and
  nothing is packed; every query attends to every key. Causal or packed attention needs ``Sk == S`` (a
  bottom-right causal mask, as in KV-cache decoding, is not a training kernel's business).
* Packed sequences: ``B == 1`` and ``cu_seqlens`` int32 ``[n + 1]`` (``0 = c_0 < ... < c_n = S``); token ``i``
  attends only to tokens of its own segment (and, if causal, not to later ones). ``max_seqlen`` is the
  longest segment; kernels that need it compute it (one host sync) when it is None.
* ``scale`` defaults to ``1 / sqrt(D)``. ``out`` is ``[B, S, Hq, Dv]`` in ``q``'s dtype.
* ``window`` / ``sinks`` / ``softcap``: optional features, ``None`` = off (maths in ``features.py``). A backend
  given one it does not implement raises ``NotImplementedError``; ``eager`` implements all three.

These are the layouts `veomni.core.sp.ulysses_attention` hands over with ``seq_dim=1, head_dim=2``: full
sequence, local heads; packed inputs pass their full-sequence ``cu_seqlens`` unchanged.

This module holds the backends built on torch alone: ``eager`` (the oracle), ``sdpa`` and ``flex``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from veomni.kernels.attention.features import (
    check_features,
    sink_key_augment,
    sink_rescale,
    window_mask,
)
from veomni.kernels.attention.segments import runs_per_segment, sdpa_segments, segment_offsets

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask


def check_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    *,
    causal: bool = False,
) -> None:
    """Raise ``ValueError`` unless q/k/v/cu_seqlens follow the convention above (no host sync)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"attention expects [B, S, H, D] tensors, got q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"k and v must share B, S and heads, q and k batch and head size (v's head size may differ): "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape[1] != q.shape[1] and (causal or cu_seqlens is not None):
        raise ValueError(
            f"keys ({k.shape[1]}) and queries ({q.shape[1]}) differ in length: cross-attention must be "
            f"non-causal and unpacked, got causal={causal}, cu_seqlens {'given' if cu_seqlens is not None else None}"
        )
    if k.shape[2] < 1 or q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of KV heads ({k.shape[2]})")
    if cu_seqlens is not None:
        if q.shape[0] != 1:
            raise ValueError(f"packed sequences (cu_seqlens given) need batch size 1, got B={q.shape[0]}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype != torch.int32:
            raise ValueError(
                f"cu_seqlens must be a 1-D int32 tensor [n + 1] with n >= 1, got dtype {cu_seqlens.dtype} "
                f"shape {tuple(cu_seqlens.shape)}"
            )


def segment_ids(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``cu_seqlens`` int32 ``[n + 1]`` -> int64 ``[seq_len]`` segment index of every position."""
    positions = torch.arange(seq_len, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    # Every position p >= cu_seqlens[0] = 0, so counting the offsets <= p over the whole table and subtracting
    # one needs no sliced view: torch 2.11's inductor (CUDA) dropped the slice's storage offset in its
    # searchsorted, reading cu_seqlens[:-1] for cu_seqlens[1:].
    return torch.searchsorted(cu_seqlens, positions, right=True) - 1


def allowed_mask(
    seq_len: int,
    causal: bool,
    cu_seqlens: torch.Tensor | None,
    device: torch.device,
    window: int | None = None,
) -> torch.Tensor | None:
    """Bool ``[S, S]`` (True = query row may attend to key column), or None when everything is allowed.

    ``window`` (causal only) keeps the keys ``i - window < j <= i``.
    """
    mask = None
    if cu_seqlens is not None:
        seg = segment_ids(cu_seqlens.to(device), seq_len)
        mask = seg[:, None] == seg[None, :]
    if causal:
        tri = (
            window_mask(seq_len, window, device)
            if window is not None
            else torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
        )
        mask = tri if mask is None else mask & tri
    return mask


def eager_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Reference attention: scores, softmax and weighted sum in fp32, materialising ``[B, Hq, S, S]``.

    Implements every feature: soft-cap, then the causal / document / window mask, then the softmax with the
    sink column appended (and dropped after it).

    Args:
        q: ``[B, S, Hq, D]``; k: ``[B, S, Hkv, D]``, v: ``[B, S, Hkv, Dv]`` (or ``Sk`` keys, non-causal); any
            float dtype.
        cu_seqlens: optional int32 ``[n + 1]`` segment offsets (B == 1); validated against S.
        max_seqlen: ignored (accepted for the common signature).
        window, sinks ``[Hq]``, softcap: see ``features.py``.
    Returns:
        ``[B, S, Hq, Dv]`` in q's dtype.
    """
    check_qkv(q, k, v, cu_seqlens, causal=causal)
    check_features("eager", q, causal, window, sinks, softcap)
    if cu_seqlens is not None:
        # The oracle pays for a host read to reject segment tables that do not tile the sequence.
        segment_offsets(cu_seqlens, q.shape[1])
    groups = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(groups, dim=2)
    v = v.repeat_interleave(groups, dim=2)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    mask = allowed_mask(q.shape[1], causal, cu_seqlens, q.device, window)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.float()[None, :, None, None].expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", probs, v.float()).to(q.dtype)


def _gqa(q: torch.Tensor, k: torch.Tensor) -> dict[str, bool]:
    """``enable_gqa`` for SDPA / flex when q has more heads than k (they repeat each KV head for *consecutive* query
    heads, as ``repeat_kv`` does). A branch, not ``enable_gqa=Hq != Hkv``: under dynamic shapes (a process that traced
    SP 1 and then SP 2 has symbolic head counts) the comparison is a SymBool, which the argument parser refuses,
    while dynamo resolves a branch on it with a guard."""
    return {"enable_gqa": True} if q.shape[2] != k.shape[2] else {}


def _sdpa_kv_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, bool]]:
    """K, V and the GQA argument for one SDPA call. On CUDA, of SDPA's fused kernels only flash and cuDNN take
    ``enable_gqa``, and neither takes fp32; the memory-efficient kernel takes fp32 but not GQA. An fp32 GQA call
    would therefore run SDPA's math backend (an ``[S, S]`` score matrix per head, and no op that keep-attention
    checkpointing can keep): there the KV heads are repeated (``[B, S, Hq, D]``) so the efficient kernel runs.
    bf16/fp16 calls keep ``enable_gqa``: cuDNN takes it with a mask too (torch 2.11 on an H200: the same kernel and
    time as with repeated heads, notebook/benchmarks-log.md)."""
    if q.shape[2] == k.shape[2]:
        return k, v, {}
    if q.device.type == "cuda" and q.dtype not in (torch.float16, torch.bfloat16):
        repeats = q.shape[2] // k.shape[2]
        return k.repeat_interleave(repeats, dim=2), v.repeat_interleave(repeats, dim=2), {}
    return k, v, _gqa(q, k)


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention``; packed inputs (two or more segments) and sliding windows use a bool mask,
    except packed rows on the CPU, which run segment by segment (`segments.sdpa_segments`: same maths, a fraction
    of the FLOPs, eager and compiled alike).

    Sinks: SDPA has no denominator term and returns no log-sum-exp, so the sink becomes an extra key whose score
    is the sink logit (`sink_key_augment`): exact, gradients included, at the price of an explicit
    ``[S, S + 1]`` mask and a head dim padded by 8. No soft-cap (SDPA cannot transform scores).

    Args / Returns: the module convention; out is a ``[B, S, Hq, Dv]`` view in q's dtype. A mask rules out
    the flash and cuDNN backends on CUDA, so masked calls run on the memory-efficient or math backend.
    """
    check_qkv(q, k, v, cu_seqlens, causal=causal)
    check_features("sdpa", q, causal, window, sinks, softcap)
    # One segment tiles the whole row ([0, S] by the convention): plain (causal) attention, which keeps SDPA's
    # flash/cuDNN kernels -- the case of one long document per sequence (and per Ulysses group).
    packed = cu_seqlens is not None and cu_seqlens.numel() > 2
    if packed and cu_seqlens is not None and runs_per_segment(q, v, window, sinks):
        return sdpa_segments(q, k, v, cu_seqlens, causal, scale)
    needs_mask = packed or window is not None or sinks is not None
    cu = cu_seqlens if packed else None
    mask = allowed_mask(q.shape[1], causal, cu, q.device, window) if needs_mask else None
    if sinks is not None:
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        q, k, v = sink_key_augment(q, k, v, sinks, scale)
        full = torch.ones(q.shape[1], k.shape[1] - 1, dtype=torch.bool, device=q.device)
        sink_col = torch.ones(q.shape[1], 1, dtype=torch.bool, device=q.device)
        mask = torch.cat([sink_col, full if mask is None else mask], dim=1)
    k, v, gqa = _sdpa_kv_heads(q, k, v)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=causal and mask is None,
        scale=scale,
        **gqa,
    )
    return out.transpose(1, 2)


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    # Built once per process: without torch.compile flex materialises the full score matrix.
    return torch.compile(flex_attention)


def _flex_kernel(device: torch.device) -> Callable[..., torch.Tensor]:
    if device.type == "cuda":
        return _compiled_flex()
    from torch.nn.attention.flex_attention import flex_attention

    # Off CUDA flex runs its unfused eager path (forward only on CPU); compiling it buys nothing here.
    return flex_attention


def flex_block_mask(
    seq_len: int,
    causal: bool,
    cu_seqlens: torch.Tensor | None,
    device: torch.device,
    window: int | None = None,
) -> BlockMask | None:
    """A flex ``BlockMask`` for the causal / document / sliding-window mask, or None when nothing is masked."""
    if not causal and cu_seqlens is None:
        return None
    from torch.nn.attention.flex_attention import create_block_mask

    seg = segment_ids(cu_seqlens.to(device), seq_len) if cu_seqlens is not None else None

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        keep = q_idx >= kv_idx
        if window is not None:
            keep = keep & (q_idx - kv_idx < window)
        if seg is None:
            return keep
        same = seg[q_idx] == seg[kv_idx]
        return same & keep if causal else same

    # On CUDA a compiled mask builder avoids materialising an [S, S] bool tensor.
    return create_block_mask(
        mask_mod, None, None, seq_len, seq_len, device=device, _compile=device.type == "cuda"
    )


def flex_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``torch.nn.attention.flex_attention`` with a causal / document / window ``BlockMask`` built from cu_seqlens.

    Soft-cap is a ``score_mod``. Sinks add a term to the softmax denominator, which no ``score_mod`` can: flex
    returns the log-sum-exp (differentiable) and the output is rescaled by ``sigmoid(lse - sink)``
    (`sink_rescale`), which is exact.

    Compiled on CUDA; eager elsewhere. torch's flex attention has no CPU backward: with inputs that need
    grad on CPU this raises ``NotImplementedError`` rather than silently switching backends.

    Args / Returns: the module convention; out is a ``[B, S, Hq, Dv]`` view in q's dtype.
    """
    check_qkv(q, k, v, cu_seqlens, causal=causal)
    check_features("flex", q, causal, window, sinks, softcap)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks))
    if q.device.type == "cpu" and needs_grad:
        raise NotImplementedError(
            "attention 'flex' cannot run backward on CPU (torch's flex_attention has no CPU backward); "
            "use 'sdpa' or 'eager' on CPU, or run on CUDA"
        )
    if q.device.type == "cpu":
        # torch checks requires_grad, not grad mode: under no_grad, detached inputs keep the forward legal.
        q, k, v = q.detach(), k.detach(), v.detach()
        sinks = None if sinks is None else sinks.detach()
    block_mask = flex_block_mask(q.shape[1], causal, cu_seqlens, q.device, window)
    score_mod: Callable[..., torch.Tensor] | None = None
    if softcap is not None:
        # A captured tensor, not the Python float: compiled flex lifts a captured float to an unbacked scalar
        # that its fake-tensor pass cannot place (torch 2.11, PendingUnbackedSymbolNotFound).
        cap = torch.full((), softcap, dtype=torch.float32, device=q.device)  # a fill: no blocking copy

        def softcap_mod(
            score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            return cap * torch.tanh(score / cap)

        score_mod = softcap_mod

    kwargs: dict[str, Any] = {}
    if sinks is not None:
        from torch.nn.attention.flex_attention import AuxRequest

        kwargs["return_aux"] = AuxRequest(lse=True)
    result = _flex_kernel(q.device)(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        score_mod=score_mod,
        block_mask=block_mask,
        scale=scale,
        **_gqa(q, k),
        **kwargs,
    )
    if sinks is None:
        return result.transpose(1, 2)
    out, aux = result
    return sink_rescale(out.transpose(1, 2), aux.lse, sinks)
