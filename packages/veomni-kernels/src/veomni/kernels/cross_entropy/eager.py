"""Reference linear cross-entropy: LM head (or classifier) plus cross-entropy, returning (sum, count).

Every backend of the ``cross_entropy`` op takes the hidden states and the head weight, not logits, so fused
backends never need a ``[T, V]`` tensor. This eager one is the oracle: it materialises the logits as HF does
(``F.linear`` in the input dtype, then fp32) and lets autograd do the rest. It never divides: callers normalise
by any token count they choose (`veomni.core.loss`), and an all-ignored batch gives ``(0., 0)`` with zero
gradients, never NaN.

Per valid position the loss is ``lse - z[label] + z_loss_weight * lse**2`` where ``z`` are the (optionally
soft-capped, ``c * tanh(z / c)``) logits and ``lse`` their fp32 log-sum-exp.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def check_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int,
    logit_softcap: float | None,
    z_loss_weight: float,
    variant: str,
) -> None:
    """Raise a ValueError/TypeError naming what was expected and what was found (shared by all backends)."""
    name = f"cross_entropy/{variant}"
    for arg, t in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
    if hidden.dtype not in _FLOATS:
        raise TypeError(f"{name}: hidden must be bf16, fp16 or fp32, got {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"{name}: weight dtype {weight.dtype} must equal hidden dtype {hidden.dtype}")
    if labels.dtype != torch.int64:
        raise TypeError(f"{name}: labels must be int64 class ids, got {labels.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"{name}: weight must be [V, H], got shape {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{name}: hidden [..., H] must end in weight's H = {weight.shape[1]}, got shape {tuple(hidden.shape)}"
        )
    if variant == "seq_cls" and hidden.dim() != 2:
        raise ValueError(
            f"{name}: hidden must be [B, H] (one row per sequence), got shape {tuple(hidden.shape)}"
        )
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"{name}: labels shape {tuple(labels.shape)} must equal hidden's leading shape {tuple(hidden.shape[:-1])}"
        )
    if weight.shape[0] < 1:
        raise ValueError(f"{name}: weight must have at least one class row, got shape {tuple(weight.shape)}")
    if hidden.device != weight.device or labels.device != hidden.device:
        raise ValueError(
            f"{name}: hidden, weight and labels must share a device, got {hidden.device}, {weight.device}, "
            f"{labels.device}"
        )
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{name}: ignore_index must be an int, got {ignore_index!r}")
    if logit_softcap is not None and not (
        isinstance(logit_softcap, int | float) and math.isfinite(logit_softcap) and logit_softcap > 0
    ):
        raise ValueError(f"{name}: logit_softcap must be None or a finite float > 0, got {logit_softcap!r}")
    if not (isinstance(z_loss_weight, int | float) and math.isfinite(z_loss_weight) and z_loss_weight >= 0):
        raise ValueError(f"{name}: z_loss_weight must be a finite float >= 0, got {z_loss_weight!r}")


def linear_ce_unchecked(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    logit_softcap: float | None,
    z_loss_weight: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager maths without `check_inputs` (any float dtype, fp64 included: tests use it as an fp64 oracle).

    ``hidden [..., H]``, ``weight [V, H]``, ``labels [...]`` int64. Returns ``(loss_sum fp32|fp64, count int64)``.
    """
    logits = F.linear(hidden.reshape(-1, hidden.shape[-1]), weight)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32, or fp64 for an fp64 oracle
    if logit_softcap is not None:
        logits = logit_softcap * torch.tanh(logits / logit_softcap)
    flat = labels.reshape(-1)
    valid = flat != ignore_index
    lse = torch.logsumexp(logits, dim=-1)
    # Ignored rows gather class 0 and are then zeroed by the mask: no data-dependent indexing, no host sync.
    picked = logits.gather(1, torch.where(valid, flat, 0).unsqueeze(1)).squeeze(1)
    per_row = lse - picked
    if z_loss_weight:
        per_row = per_row + z_loss_weight * lse.square()
    loss_sum = torch.where(valid, per_row, 0.0).sum()
    return loss_sum, valid.sum()


def causal_lm_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    logit_softcap: float | None = None,
    z_loss_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level LM-head cross-entropy, labels already shifted by the caller.

    Args:
        hidden: ``[..., H]`` bf16/fp16/fp32 final hidden states.
        weight: ``[V, H]`` LM-head weight, same dtype (may have requires_grad=False).
        labels: ``[...]`` int64, hidden's leading shape; ``ignore_index`` marks positions without a target.
        logit_softcap: if set, logits become ``c * tanh(logits / c)`` before the softmax.
        z_loss_weight: adds ``z_loss_weight * lse**2`` per valid position.
    Returns:
        ``(loss_sum, valid_count)``: 0-d fp32 sum over valid positions and 0-d int64 count.
    """
    check_inputs(
        hidden, weight, labels, ignore_index=ignore_index, logit_softcap=logit_softcap,
        z_loss_weight=z_loss_weight, variant="causal",
    )  # fmt: skip
    return linear_ce_unchecked(hidden, weight, labels, ignore_index, logit_softcap, z_loss_weight)


def sequence_classification_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    logit_softcap: float | None = None,
    z_loss_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Classifier-head cross-entropy with one label per sequence.

    Args:
        hidden: ``[B, H]`` pooled hidden states (bf16/fp16/fp32); weight: ``[C, H]`` classifier weight, same
            dtype; labels: ``[B]`` int64 class ids, ``ignore_index`` for unlabelled sequences.
    Returns:
        ``(loss_sum, valid_sequences)``: 0-d fp32 and 0-d int64.
    """
    check_inputs(
        hidden, weight, labels, ignore_index=ignore_index, logit_softcap=logit_softcap,
        z_loss_weight=z_loss_weight, variant="seq_cls",
    )  # fmt: skip
    return linear_ce_unchecked(hidden, weight, labels, ignore_index, logit_softcap, z_loss_weight)
