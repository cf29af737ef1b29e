"""Load-balancing loss (Switch Transformer eqs. 4-6, HF-compatible) in plain PyTorch: the oracle.

Notation used across ``veomni.kernels.moe_loss``. All layers' router logits are pooled into ``N = L * T``
rows; row ``n`` has a weight ``w_n`` (its token's attention-mask value, or 1 without a mask) and router
probabilities ``p_n = softmax(z_n)`` computed in fp32. Per expert ``e``:

    count_e = sum_n w_n * [e in top_k(p_n)]      (no gradient: top-k selection is piecewise constant)
    P_e     = sum_n w_n * p_{n,e}                (differentiable)
    W       = sum_n w_n                          (L * sum(mask), or N)
    loss    = E * sum_e (count_e / W) * (P_e / W)

which is exactly ``transformers``' ``load_balancing_loss_func`` for fp32 logits (HF takes the softmax in the
logits' dtype; we always use fp32). Ties in top-k go to the lowest expert index.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class RouterStats(NamedTuple):
    """Per-expert sufficient statistics of the load-balancing loss for one batch of router logits.

    counts: ``[E]`` fp32, ``sum_n w_n [e in top_k(p_n)]``; carries no gradient.
    prob_sums: ``[E]`` fp32, ``sum_n w_n p_{n,e}``; differentiable w.r.t. the router logits.
    weight: 0-d fp32, ``W = sum_n w_n``; no gradient.
    """

    counts: torch.Tensor
    prob_sums: torch.Tensor
    weight: torch.Tensor


def flat_row_weights(
    attention_mask: torch.Tensor | None, tokens: int, device: torch.device
) -> torch.Tensor | None:
    """``attention_mask`` ``[B, S]`` (any dtype) -> fp32 ``[B*S]`` row weights, checked against ``tokens``.

    Returns None when there is no mask (every row weighs 1).
    """
    if attention_mask is None:
        return None
    flat = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    if flat.numel() != tokens:
        raise ValueError(
            f"attention_mask has {flat.numel()} positions (shape {tuple(attention_mask.shape)}) but each "
            f"layer's router logits have {tokens} rows; they must be the same tokens"
        )
    return flat


def check_router_logits(router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int) -> int:
    """Validate one ``[T, E]`` tensor per layer (same T, same device); return T."""
    if len(router_logits) == 0:
        raise ValueError("router_logits is empty: pass one [T, E] tensor per MoE layer")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"need 1 <= top_k <= num_experts, got top_k={top_k}, num_experts={num_experts}")
    first = router_logits[0]
    for i, layer in enumerate(router_logits):
        if layer.dim() != 2 or layer.shape[1] != num_experts or layer.shape[0] != first.shape[0]:
            raise ValueError(
                f"router_logits[{i}] has shape {tuple(layer.shape)}; expected [T, E] = "
                f"[{first.shape[0]}, {num_experts}] like layer 0"
            )
        if layer.device != first.device:
            raise ValueError(f"router_logits[{i}] is on {layer.device}, layer 0 on {first.device}")
        if not layer.is_floating_point():
            raise TypeError(f"router_logits[{i}] must be floating point, got {layer.dtype}")
    return first.shape[0]


def top_k_mask(probs: torch.Tensor, top_k: int) -> torch.Tensor:
    """``[N, E]`` probs -> ``[N, E]`` bool, True at each row's ``top_k`` largest (ties: lowest index)."""
    # A stable descending sort keeps equal values in index order, pinning the tie rule that the Triton
    # kernel implements; torch.topk gives no tie guarantee.
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]
    return torch.zeros_like(probs, dtype=torch.bool).scatter_(1, order, True)


def router_stats_eager(
    router_logits: Sequence[torch.Tensor],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
) -> RouterStats:
    """Statistics of the loss (see module docstring), one layer at a time so memory stays O(T * E).

    Args:
        router_logits: one raw (pre-softmax) ``[T, E]`` tensor per layer, any float dtype.
        attention_mask: optional ``[B, S]`` with ``B * S == T``; 0 marks padding.
    Returns:
        `RouterStats` of fp32 tensors on the logits' device.
    """
    tokens = check_router_logits(router_logits, num_experts, top_k)
    device = router_logits[0].device
    weights = flat_row_weights(attention_mask, tokens, device)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    prob_sums = torch.zeros(num_experts, dtype=torch.float32, device=device)
    for layer in router_logits:
        probs = torch.softmax(layer.float(), dim=-1)
        chosen = top_k_mask(probs, top_k).float()
        if weights is not None:
            chosen = chosen * weights[:, None]
            probs = probs * weights[:, None]
        counts = counts + chosen.sum(0)
        prob_sums = prob_sums + probs.sum(0)
    rows = weights.sum() if weights is not None else torch.full((), float(tokens), device=device)
    return RouterStats(counts.detach(), prob_sums, rows * len(router_logits))


def switch_loss(
    counts: torch.Tensor, prob_sums: torch.Tensor, weight: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """``E * sum_e (counts_e / W) * (prob_sums_e / W)`` in HF's operation order -> 0-d fp32."""
    return torch.sum((counts / weight) * (prob_sums / weight)) * num_experts


def load_balancing_loss_eager(
    router_logits: Sequence[torch.Tensor],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Switch load-balancing loss over all layers (HF ``load_balancing_loss_func`` semantics).

    Args:
        router_logits: one raw ``[T, E]`` tensor per MoE layer.
        num_experts: E.
        top_k: experts chosen per token.
        attention_mask: optional ``[B, S]`` (``B * S == T``), 0 = padding.
    Returns:
        0-d fp32 loss; gradients reach the logits only through the router-probability term.
    """
    stats = router_stats_eager(router_logits, num_experts, top_k, attention_mask)
    return switch_loss(stats.counts, stats.prob_sums, stats.weight, num_experts)
