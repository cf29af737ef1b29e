"""Async Ulysses: each projection's sequence -> heads all-to-all runs while the next projection computes.

Synchronous Ulysses (`veomni.core.sp.ulysses_attention`) projects Q, K and V, then exchanges them: the GPU's
compute stream idles during the exchange. Here the exchange of Q is started (``async_op=True``) as soon as Q is
projected, K is projected while Q travels, and so on; attention waits for all three. The backward overlaps the
same way without any scheduling of ours: autograd runs the exchanges' backward in reverse creation order, so the
gradients of V, K and Q are all in flight before the projections' backward (weight and input gradients) runs,
and each projection's backward waits only for its own exchange.

Mechanics: one exchange is two autograd nodes, `_Launch` (starts the all-to-all into a receive buffer, returns
the buffer before the data has arrived) and `_Land` (waits, then lays the buffer out as ``[..., S, ..., H/P,
...]``). Their backward mirrors them: `_Land`'s backward starts the reverse all-to-all of the gradient, `_Launch`'s
backward waits for it. Both nodes share one `_Exchange` record holding the pending work handle. The maths is
exactly `seq_to_heads` (an all-to-all is a permutation; its adjoint is the inverse permutation).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from veomni.core.sp.attention import AttentionFn, kv_repeats_for_sp
from veomni.core.sp.comm import _check_heads, heads_to_seq
from veomni.core.sp.padding import _norm_dim, pad_to_length, unpad

__all__ = ["async_ulysses_attention"]


class _Exchange:
    """One all-to-all's layout and its pending work (set by whichever direction launched last)."""

    def __init__(self, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> None:
        self.group, self.scatter_dim, self.gather_dim = group, scatter_dim, gather_dim
        self.world = dist.get_world_size(group)
        self.work: Any = None

    def launch(self, x: torch.Tensor, scatter_dim: int) -> torch.Tensor:
        """Start sending chunk p of ``x`` along ``scatter_dim`` to rank p; returns the receive buffer
        ``[P, ...]`` (row p from rank p), valid only after `wait`."""
        send = torch.unflatten(x, scatter_dim, (self.world, x.shape[scatter_dim] // self.world))
        send = send.movedim(scatter_dim, 0).contiguous()
        recv = torch.empty_like(send)
        self.work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)
        return recv

    def wait(self) -> None:
        self.work.wait()
        self.work = None


class _Launch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, exchange: _Exchange) -> torch.Tensor:
        ctx.exchange = exchange
        return exchange.launch(x, exchange.scatter_dim)

    @staticmethod
    def backward(ctx: Any, grad_recv_rows: torch.Tensor) -> tuple[torch.Tensor, None]:
        # grad_recv_rows is the buffer _Land's backward started filling: wait for it, then undo the row layout.
        exchange: _Exchange = ctx.exchange
        exchange.wait()
        grad = grad_recv_rows.movedim(0, exchange.scatter_dim).flatten(
            exchange.scatter_dim, exchange.scatter_dim + 1
        )
        return grad, None


class _Land(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, recv_rows: torch.Tensor, exchange: _Exchange) -> torch.Tensor:
        ctx.exchange = exchange
        exchange.wait()
        return recv_rows.movedim(0, exchange.gather_dim).flatten(exchange.gather_dim, exchange.gather_dim + 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # The inverse permutation: scatter the gathered dim back; _Launch's backward waits for it.
        exchange: _Exchange = ctx.exchange
        return exchange.launch(grad.contiguous(), exchange.gather_dim), None


def _start_seq_to_heads(
    x: torch.Tensor, group: dist.ProcessGroup, seq_dim: int, head_dim: int
) -> tuple[torch.Tensor, _Exchange]:
    _check_heads(x.shape[head_dim], dist.get_world_size(group), "the number of heads")
    exchange = _Exchange(group, scatter_dim=head_dim, gather_dim=seq_dim)
    return _Launch.apply(x, exchange), exchange


def async_ulysses_attention(
    x: torch.Tensor,
    project: Callable[[torch.Tensor], Iterator[tuple[str, torch.Tensor]]],
    attn_fn: AttentionFn,
    group: dist.ProcessGroup,
    *,
    seq_dim: int,
    head_dim: int,
    query_heads: int,
    unpadded_len: int | None = None,
    **attn_kwargs: Any,
) -> torch.Tensor:
    """`ulysses_attention` with Q, K, V computed here: each is exchanged as soon as it exists, while the next
    one is being computed.

    Args:
        x: this rank's sequence shard of the layer input (``[B, S/P, hidden]``, whatever ``project`` takes).
        project: a generator function ``x -> (name, tensor)`` yielding ``"q"``, ``"k"`` and ``"v"`` once each,
            in the order they become ready (e.g. V first, then Q and K after their norms and a joint RoPE on
            local positions), in the attention layout ``[..., S/P, ..., H, D]`` (``seq_dim`` / ``head_dim``; k
            and v with ``H_kv`` heads, v may have another head size).
        query_heads: ``H_q`` (K and V may need repeating before Q exists: `kv_repeats_for_sp`).
        attn_fn, unpadded_len, attn_kwargs: as in `ulysses_attention` (``attn_fn(q, k, v, **attn_kwargs)`` sees
            the full sequence and ``H/P`` heads).
    Returns:
        the attention output for the local shard, ``[..., S/P, ..., H_q, D_v]`` (the input layout).
    Raises:
        ValueError: ``project`` not yielding q, k and v once each, k and v head counts that differ, or head
            counts Ulysses cannot split.
    """
    world = dist.get_world_size(group)
    if query_heads % world:
        raise ValueError(
            f"Ulysses SP needs the query heads divisible by the SP size: H_q={query_heads}, P={world}"
        )
    pending: dict[str, tuple[torch.Tensor, _Exchange | None]] = {}
    kv_heads: dict[str, int] = {}
    seq = head = -1
    for name, t in project(x):
        if name not in ("q", "k", "v") or name in pending:
            raise ValueError(
                f"project must yield 'q', 'k' and 'v' once each; got {name!r} (after {list(pending)})"
            )
        seq, head = _norm_dim(t, seq_dim), _norm_dim(t, head_dim)
        if name == "q":
            if t.shape[head] != query_heads:
                raise ValueError(f"q has {t.shape[head]} heads, query_heads says {query_heads}")
            padded_len = t.shape[seq] * world  # what the output must cover again, padding rows included
        if name != "q":
            kv_heads[name] = t.shape[head]
            repeats = kv_repeats_for_sp(query_heads, t.shape[head], world)
            if repeats > 1:
                t = t.repeat_interleave(repeats, dim=head)
        pending[name] = (t, None) if world == 1 else _start_seq_to_heads(t, group, seq, head)
    if sorted(pending) != ["k", "q", "v"]:
        raise ValueError(f"project must yield 'q', 'k' and 'v' once each; got {sorted(pending)}")
    if kv_heads["k"] != kv_heads["v"]:
        raise ValueError(f"k and v must have equal heads, got {kv_heads['k']} and {kv_heads['v']}")
    landed = [
        rows if exchange is None else _Land.apply(rows, exchange)
        for rows, exchange in (pending[n] for n in ("q", "k", "v"))
    ]
    if unpadded_len is not None:
        landed = [unpad(t, seq, unpadded_len) for t in landed]
    out = attn_fn(*landed, **attn_kwargs)
    if unpadded_len is not None:
        out = pad_to_length(out, seq, padded_len)
    if world == 1:
        return out
    return heads_to_seq(out, group, seq_dim=seq, head_dim=head)
