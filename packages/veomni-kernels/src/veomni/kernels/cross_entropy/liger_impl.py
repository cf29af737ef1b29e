"""The ``liger`` backend: liger-kernel's fused linear cross-entropy behind veomni's (sum, count) contract.

Kept for comparison (the T3 benchmark) and as a fallback. It runs with ``reduction="sum"``, so nothing is divided
and no mean is converted back. Known differences from veomni's own kernel, all Liger's behaviour:

- it syncs the host (``.item()`` on the valid count, ``torch.equal`` on the incoming gradient);
- with its default ``accum_dtype=None`` it accumulates dW across token chunks in the weight's dtype (bf16);
- when ``hidden`` does not require grad it computes no gradient at all, not even for ``weight``.
"""

from __future__ import annotations

import torch
from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

from veomni.kernels.cross_entropy import eager
from veomni.kernels.cross_entropy.eager import IGNORE_INDEX, check_inputs


def _liger(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    logit_softcap: float | None,
    z_loss_weight: float,
    variant: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_inputs(
        hidden, weight, labels, ignore_index=ignore_index, logit_softcap=logit_softcap,
        z_loss_weight=z_loss_weight, variant=variant,
    )  # fmt: skip
    if labels.numel() == 0:
        # Liger divides by its chunk count, which is zero here; the empty sum is the same whoever computes it.
        return eager.linear_ce_unchecked(hidden, weight, labels, ignore_index, logit_softcap, z_loss_weight)
    flat_labels = labels.reshape(-1)
    # Positional: input, weight, target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing,
    # reduction, softcap.
    loss = LigerFusedLinearCrossEntropyFunction.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, flat_labels, None, None, ignore_index,
        float(z_loss_weight), 0.0, "sum", None if logit_softcap is None else float(logit_softcap),
    )[0]  # fmt: skip
    return loss.float(), (flat_labels != ignore_index).sum()


def causal_lm_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    logit_softcap: float | None = None,
    z_loss_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Liger fused LM-head cross-entropy: ``hidden [..., H]``, ``weight [V, H]``, ``labels [...]`` int64.

    Returns ``(loss_sum, valid_count)``, 0-d fp32 and 0-d int64.
    """
    return _liger(hidden, weight, labels, ignore_index, logit_softcap, z_loss_weight, "causal")


def sequence_classification_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    logit_softcap: float | None = None,
    z_loss_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Liger fused classifier-head cross-entropy: ``hidden [B, H]``, ``weight [C, H]``, ``labels [B]`` int64.

    Returns ``(loss_sum, valid_sequences)``, 0-d fp32 and 0-d int64.
    """
    return _liger(hidden, weight, labels, ignore_index, logit_softcap, z_loss_weight, "seq_cls")
