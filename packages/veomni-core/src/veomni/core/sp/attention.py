"""Ulysses attention: run any attention function on the full sequence and this rank's share of the heads.

Before attention one or more all-to-alls turn sequence shards into head shards; after it one all-to-all turns
them back. The attention function itself is unaware of SP: it sees full-length Q/K/V with ``H/P`` heads, so
packed (varlen) inputs pass their *full-sequence* ``cu_seqlens`` through ``attn_kwargs`` unchanged.

GQA: query heads must split evenly (``H_q % P == 0``). Key/value heads either split evenly too
(``H_kv % P == 0``) or, when there are fewer KV heads than ranks, are repeated to ``P`` heads before the exchange
(``P % H_kv == 0``), so each rank receives exactly the KV head its query heads use; autograd sums the copies'
gradients back. Anything else cannot be laid out and raises.

Cross-attention (`sp_cross_attention`): the queries are this rank's sequence shard, the keys/values (a condition
encoder's output, e.g. a DiT's text tokens) are replicated on every rank. Each local query attends to all keys
on its own rank, so no exchange is needed at all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from veomni.core.sp.comm import heads_to_seq, seq_to_heads
from veomni.core.sp.padding import _norm_dim, pad_to_length

AttentionFn = Callable[..., torch.Tensor]


def kv_repeats_for_sp(num_q_heads: int, num_kv_heads: int, sp_size: int) -> int:
    """How many times each KV head must be repeated before a Ulysses exchange over ``sp_size`` ranks.

    Returns 1 when ``num_kv_heads % sp_size == 0``; ``sp_size // num_kv_heads`` when ``sp_size % num_kv_heads
    == 0``. Raises ``ValueError`` for head counts that cannot be split.
    """
    if num_q_heads % sp_size != 0:
        raise ValueError(
            f"Ulysses SP needs the query heads divisible by the SP size: H_q={num_q_heads}, P={sp_size}"
        )
    if num_kv_heads < 1 or num_q_heads % num_kv_heads != 0:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})")
    if num_kv_heads % sp_size == 0:
        return 1
    if sp_size % num_kv_heads == 0:
        return sp_size // num_kv_heads
    raise ValueError(
        f"Ulysses SP needs H_kv % P == 0 or P % H_kv == 0 for grouped-query attention: H_kv={num_kv_heads}, "
        f"P={sp_size}"
    )


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_fn: AttentionFn,
    group: dist.ProcessGroup,
    *,
    seq_dim: int,
    head_dim: int,
    unpadded_len: int | None = None,
    out_seq_dim: int | None = None,
    out_head_dim: int | None = None,
    **attn_kwargs: Any,
) -> torch.Tensor:
    """Attention over the full sequence with heads split across the SP group.

    Args:
        q: ``[..., S/P, ..., H_q, D]`` local sequence shard (e.g. ``[B, S/P, H, D]`` with seq_dim=1,
            head_dim=2, or HF's ``[B, H, S/P, D]`` with seq_dim=2, head_dim=1).
        k, v: same layout with ``H_kv`` heads (v may have another head size than k).
        attn_fn: ``attn_fn(q, k, v, **attn_kwargs)`` on ``[..., S, ..., H_q/P, D]`` inputs (K/V with
            ``max(H_kv, P)/P`` heads); returns an output whose sequence and head dims are ``out_seq_dim`` and
            ``out_head_dim`` (default: the input's).
        unpadded_len: true full length when the shards carry tail padding; attention never sees the padding.
    Returns:
        the attention output for the local shard, ``[..., S/P, ..., H_q, D_v]`` in the output layout.
    """
    seq_dim, head_dim = _norm_dim(q, seq_dim), _norm_dim(q, head_dim)
    if k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(f"q, k, v must have the same rank, got shapes {q.shape}, {k.shape}, {v.shape}")
    if k.shape[head_dim] != v.shape[head_dim] or k.shape[seq_dim] != q.shape[seq_dim]:
        raise ValueError(
            f"k and v must have equal heads and q, k, v equal local length; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    world = dist.get_world_size(group)
    padded_len = q.shape[seq_dim] * world  # what the output must cover again, padding rows included
    repeats = kv_repeats_for_sp(q.shape[head_dim], k.shape[head_dim], world)
    if repeats > 1:
        k = k.repeat_interleave(repeats, dim=head_dim)
        v = v.repeat_interleave(repeats, dim=head_dim)

    def exchange(t: torch.Tensor, stacked: bool) -> torch.Tensor:
        shift = 1 if stacked else 0
        return seq_to_heads(
            t, group, seq_dim=seq_dim + shift, head_dim=head_dim + shift, unpadded_len=unpadded_len
        )

    # Fewer, larger all-to-alls: tensors of equal shape travel together.
    if q.shape == k.shape == v.shape:
        q, k, v = exchange(torch.stack([q, k, v]), stacked=True).unbind(0)
    elif k.shape == v.shape:
        q = exchange(q, stacked=False)
        k, v = exchange(torch.stack([k, v]), stacked=True).unbind(0)
    else:
        q, k, v = (exchange(t, stacked=False) for t in (q, k, v))

    out = attn_fn(q, k, v, **attn_kwargs)
    out_seq = seq_dim if out_seq_dim is None else _norm_dim(out, out_seq_dim)
    out_head = head_dim if out_head_dim is None else _norm_dim(out, out_head_dim)
    if unpadded_len is not None:
        # Shards padded past the next multiple of P (vision merges pad to P x merge): every padding row back.
        out = pad_to_length(out, out_seq, padded_len)
    return heads_to_seq(out, group, seq_dim=out_seq, head_dim=out_head)


def sp_cross_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_fn: AttentionFn,
    *,
    seq_dim: int,
    head_dim: int,
    **attn_kwargs: Any,
) -> torch.Tensor:
    """Cross-attention of sequence-sharded queries to replicated keys/values under SP: no collective.

    Args:
        q: ``[..., S_q/P, ..., H_q, D]`` this rank's query shard (tail padding rows, if any, give rows the
            caller drops).
        k, v: ``[..., S_k, ..., H_kv, D]`` the *full* keys/values, identical on every SP rank (``S_k`` is
            unrelated to ``S_q``; ``H_q % H_kv == 0``; v may have another head size).
        attn_fn: ``attn_fn(q, k, v, **attn_kwargs)`` on these very tensors; it must be non-causal.
    Returns:
        ``attn_fn``'s output for the local queries.

    Gradients: each rank's k/v gradient holds only its own queries' share; the full gradient is their sum over
    the SP group (what data-parallel gradient reduction over the SP ranks computes for a trainable encoder).
    """
    seq_dim, head_dim = _norm_dim(q, seq_dim), _norm_dim(q, head_dim)
    if k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(f"q, k, v must have the same rank, got shapes {q.shape}, {k.shape}, {v.shape}")
    if attn_kwargs.get("causal") or attn_kwargs.get("is_causal"):
        raise ValueError(
            "cross-attention under SP must be non-causal: the keys are not the queries' sequence"
        )
    other = [d for d in range(q.dim()) if d not in (seq_dim, head_dim)]
    batch_like = [d for d in other if d != q.dim() - 1]  # the last dim is the head size, free for v
    for t, name in ((k, "k"), (v, "v")):
        if any(t.shape[d] != q.shape[d] for d in batch_like):
            raise ValueError(
                f"{name} {tuple(t.shape)} must match q {tuple(q.shape)} outside the sequence, head and "
                f"head-size dims (seq_dim={seq_dim}, head_dim={head_dim})"
            )
    if k.shape[seq_dim] != v.shape[seq_dim] or k.shape[head_dim] != v.shape[head_dim]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have equal lengths and heads")
    if k.shape[head_dim] < 1 or q.shape[head_dim] % k.shape[head_dim] != 0:
        raise ValueError(
            f"query heads ({q.shape[head_dim]}) must be a multiple of KV heads ({k.shape[head_dim]})"
        )
    return attn_fn(q, k, v, **attn_kwargs)
