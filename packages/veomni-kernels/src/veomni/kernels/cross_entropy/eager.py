"""Reference cross-entropy losses returning (sum, count), so callers normalise by any token count they choose.

Both variants compute in fp32 whatever the logits' dtype, and never divide: a batch whose labels are all ignored
gives a zero sum and a zero count, never NaN. `veomni.core.loss` turns sums and counts into exact global means.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def causal_lm_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level cross-entropy for next-token prediction with labels already shifted (by the collator).

    Args:
        logits: ``[..., V]`` any float dtype.
        labels: ``[...]`` int64 (same leading shape), ``ignore_index`` marks positions without a target.
    Returns:
        ``(loss_sum, valid_tokens)``: 0-d fp32 sum over valid positions and 0-d int64 count.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} must be labels {tuple(labels.shape)} plus a vocabulary dim"
        )
    flat_logits, flat_labels = logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1)
    loss_sum = F.cross_entropy(flat_logits, flat_labels, ignore_index=ignore_index, reduction="sum")
    return loss_sum, (flat_labels != ignore_index).sum()


def sequence_classification_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of one label per sequence (no shift, no per-token targets).

    Args:
        logits: ``[B, C]`` any float dtype.
        labels: ``[B]`` int64 class ids, ``ignore_index`` for unlabelled sequences.
    Returns:
        ``(loss_sum, valid_sequences)``: 0-d fp32 and 0-d int64.
    """
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(f"expected logits [B, C] and labels [B], got {tuple(logits.shape)} and {tuple(labels.shape)}")
    return causal_lm_cross_entropy(logits, labels, ignore_index)
