"""MoE load-balancing (Switch) loss: eager oracle, fused Triton kernels, and a global-batch mode.

Per-batch loss (HF ``load_balancing_loss_func`` semantics; notation in ``eager.py``)::

    loss = E * sum_e (count_e / W) * (P_e / W)

Global-batch mode. With gradient accumulation and data parallelism the statistics of one micro-batch on
one rank are noisy; the global-batch loss uses the routing frequencies of the whole optimizer step. Let
``m`` range over every (rank, micro-batch) pair of the step, ``C_e = sum_m count_e^m`` and
``W = sum_m W^m`` (the *global* counts and weight, obtained with one all-reduce), and
``f_e = C_e / W``. Then

    L_global = E * sum_e f_e * (sum_m P_e^m) / W = sum_m  E * sum_e f_e * P_e^m / W  =: sum_m l^m

``f_e`` is a constant (top-k counts have no gradient), so the loss is linear in the local probability sums
and splits into per-(rank, micro-batch) contributions ``l^m`` that need no further communication: the
all-reduce touches only detached counts, and autograd on each rank sees only its own ``P^m``. The gradient
of ``l^m`` w.r.t. that micro-batch's logits equals the gradient of ``L_global`` w.r.t. them::

    dl^m / dz_{n,j} = (E / W) * w_n * p_{n,j} * (f_j - sum_e f_e p_{n,e})

The sum of all ranks' returned values is ``L_global``. When the data-parallel wrapper *averages* gradients
over ``R`` ranks, scale the returned contribution by ``R`` (as ``veomni.core.loss.scale_loss_for_backward``
does for token losses) to get ``dL_global/dz`` exactly. With one micro-batch and one rank it reduces to
``load_balancing_loss``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist

from veomni.kernels.moe_loss.eager import (
    RouterStats,
    load_balancing_loss_eager,
    router_stats_eager,
    switch_loss,
)

Impl = Literal["eager", "triton"]

__all__ = [
    "RouterStats",
    "global_router_counts",
    "load_balancing_loss",
    "load_balancing_loss_eager",
    "load_balancing_loss_from_stats",
    "load_balancing_loss_global",
    "load_balancing_loss_triton",
    "router_stats",
    "router_stats_eager",
    "router_stats_triton",
]


def __getattr__(name: str) -> Any:
    # The Triton module is imported on first use so that importing this package never needs triton.
    if name in ("load_balancing_loss_triton", "router_stats_triton"):
        from veomni.kernels.moe_loss import triton_impl

        return getattr(triton_impl, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def router_stats(
    router_logits: Sequence[torch.Tensor],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
    *,
    impl: Impl = "triton",
) -> RouterStats:
    """Per-expert statistics ``(counts [E], prob_sums [E], weight [])`` (fp32) of one micro-batch.

    Args:
        router_logits: one raw ``[T, E]`` tensor per MoE layer.
        attention_mask: optional ``[B, S]``, ``B * S == T``.
        impl: ``"triton"`` (fused, deterministic; runs through the interpreter on CPU) or ``"eager"``.
    """
    if impl == "eager":
        return router_stats_eager(router_logits, num_experts, top_k, attention_mask)
    if impl == "triton":
        from veomni.kernels.moe_loss.triton_impl import router_stats_triton

        return router_stats_triton(router_logits, num_experts, top_k, attention_mask)
    raise ValueError(f"unknown load-balancing loss impl {impl!r}; choices: 'eager', 'triton'")


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
    *,
    impl: Impl = "triton",
) -> torch.Tensor:
    """Switch load-balancing loss of one batch over all layers (HF semantics, fp32 softmax).

    Args:
        router_logits: one raw (pre-softmax) ``[T, E]`` tensor per MoE layer.
        num_experts: E. top_k: experts per token.
        attention_mask: optional ``[B, S]`` (``B * S == T``), 0 = padding.
        impl: ``"triton"`` or ``"eager"``.
    Returns:
        0-d fp32 loss.
    """
    stats = router_stats(router_logits, num_experts, top_k, attention_mask, impl=impl)
    return switch_loss(stats.counts, stats.prob_sums, stats.weight, num_experts)


def global_router_counts(
    stats: Sequence[RouterStats], group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum counts and weights over this rank's micro-batches, then all-reduce them over ``group``.

    One collective on a detached fp64 ``[E + 1]`` buffer (exact for integer counts); autograd is untouched.

    Args:
        stats: this rank's micro-batch statistics (at least one; every rank must call this).
        group: the data-parallel (or dp x sp loss) group; None = no communication.
    Returns:
        ``(C [E] fp32, W 0-d fp32)``: global counts and global weight.
    """
    if len(stats) == 0:
        raise ValueError("global_router_counts needs at least one RouterStats")
    packed = torch.cat(
        [torch.stack([s.counts for s in stats]).sum(0), torch.stack([s.weight for s in stats]).sum()[None]]
    )
    packed = packed.detach().double()
    if group is not None:
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    return packed[:-1].float(), packed[-1].float()


def load_balancing_loss_from_stats(
    stats: Sequence[RouterStats], global_counts: torch.Tensor, global_weight: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """This rank's contribution ``E * sum_e f_e * (sum_m P_e^m) / W`` to the global-batch loss.

    Args:
        stats: this rank's micro-batch statistics (their ``prob_sums`` carry the gradient).
        global_counts: ``[E]`` fp32 ``C`` from `global_router_counts`; global_weight: 0-d fp32 ``W``.
    Returns:
        0-d fp32; summed over ranks it is the global-batch loss (see the module docstring).
    """
    local_probs = torch.stack([s.prob_sums for s in stats]).sum(0)
    return switch_loss(global_counts.detach(), local_probs, global_weight.detach(), num_experts)


def load_balancing_loss_global(
    router_logits: Sequence[torch.Tensor],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
    *,
    group: dist.ProcessGroup | None,
    impl: Impl = "triton",
) -> torch.Tensor:
    """Global-batch load-balancing loss for one micro-batch per rank: counts all-reduced over ``group``.

    For several micro-batches per step, call `router_stats` on each, then `global_router_counts` and
    `load_balancing_loss_from_stats` once. Every rank of ``group`` must call this (it runs a collective).

    Args:
        router_logits: this rank's raw ``[T, E]`` logits, one per layer.
        attention_mask: optional ``[B, S]`` for this rank's tokens.
        group: process group to reduce counts over; None = this process only.
    Returns:
        0-d fp32, this rank's contribution; the sum over ranks equals the loss of the concatenated batch.
    """
    stats = router_stats(router_logits, num_experts, top_k, attention_mask, impl=impl)
    counts, weight = global_router_counts([stats], group)
    return load_balancing_loss_from_stats([stats], counts, weight, num_experts)
