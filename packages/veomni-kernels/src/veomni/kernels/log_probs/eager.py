"""Reference linear log-probs and entropy: the LM head, then ``log_softmax`` and ``-sum p log p`` on fp32 logits.

Every backend of the ``log_probs`` op takes the hidden states and the head weight, not logits, so fused backends
never need a ``[T, V]`` tensor. This eager one is the oracle: it builds the logits as HF does (``F.linear`` in the
input dtype, then fp32) and lets autograd differentiate both outputs.

Per valid token with raw logits ``u``: ``z = c * tanh(u / c)`` when a soft-cap ``c`` is set (else ``z = u``),
``s = z / temperature``, ``logp = s[target] - logsumexp(s)`` and ``entropy = -sum softmax(s) * log_softmax(s)``.
Ignored tokens (``target == ignore_index``) give 0 for both, with zero gradient.
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
    targets: torch.Tensor,
    *,
    ignore_index: int,
    logit_softcap: float | None,
    temperature: float,
    entropy: bool,
    backend: str,
) -> None:
    """Raise a ValueError/TypeError naming what was expected and what was found (shared by all backends)."""
    name = f"log_probs ({backend})"
    for arg, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
    if hidden.dtype not in _FLOATS:
        raise TypeError(f"{name}: hidden must be bf16, fp16 or fp32, got {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"{name}: weight dtype {weight.dtype} must equal hidden dtype {hidden.dtype}")
    if targets.dtype != torch.int64:
        raise TypeError(f"{name}: targets must be int64 token ids, got {targets.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"{name}: weight must be [V, H], got shape {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{name}: hidden [..., H] must end in weight's H = {weight.shape[1]}, got shape {tuple(hidden.shape)}"
        )
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"{name}: targets shape {tuple(targets.shape)} must equal hidden's leading shape "
            f"{tuple(hidden.shape[:-1])}"
        )
    if weight.shape[0] < 1:
        raise ValueError(
            f"{name}: weight must have at least one vocabulary row, got shape {tuple(weight.shape)}"
        )
    if hidden.device != weight.device or targets.device != hidden.device:
        raise ValueError(
            f"{name}: hidden, weight and targets must share a device, got {hidden.device}, {weight.device}, "
            f"{targets.device}"
        )
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{name}: ignore_index must be an int, got {ignore_index!r}")
    if logit_softcap is not None and not (
        isinstance(logit_softcap, int | float) and math.isfinite(logit_softcap) and logit_softcap > 0
    ):
        raise ValueError(f"{name}: logit_softcap must be None or a finite float > 0, got {logit_softcap!r}")
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, int | float)
        or not (math.isfinite(temperature) and temperature > 0)
    ):
        raise ValueError(f"{name}: temperature must be a finite float > 0, got {temperature!r}")
    if not isinstance(entropy, bool):
        raise TypeError(f"{name}: entropy must be a bool, got {entropy!r}")


def log_probs_unchecked(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    logit_softcap: float | None,
    temperature: float,
    entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The eager maths without `check_inputs` (any float dtype, fp64 included: tests use it as an fp64 oracle).

    ``hidden [..., H]``, ``weight [V, H]``, ``targets [...]`` int64. Returns ``(logps, entropy or None)``, each
    shaped like ``targets``, fp32 (fp64 for fp64 inputs).
    """
    logits = F.linear(hidden.reshape(-1, hidden.shape[-1]), weight)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if logit_softcap is not None:
        logits = logit_softcap * torch.tanh(logits / logit_softcap)
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    flat = targets.reshape(-1)
    valid = flat != ignore_index
    # Ignored rows gather class 0 and are then zeroed by the mask: no data-dependent indexing, no host sync.
    picked = logp_all.gather(1, torch.where(valid, flat, 0).unsqueeze(1)).squeeze(1)
    logps = torch.where(valid, picked, 0.0).view(targets.shape)
    if not entropy:
        return logps, None
    ent = -(logp_all.exp() * logp_all).sum(dim=-1)
    return logps, torch.where(valid, ent, 0.0).view(targets.shape)


def linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    logit_softcap: float | None = None,
    temperature: float = 1.0,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probability of ``targets`` (and optionally the entropy) under ``softmax(hidden @ weight.T)``.

    Args:
        hidden: ``[..., H]`` (``[T, H]`` for packed tokens) bf16/fp16/fp32 final hidden states.
        weight: ``[V, H]`` LM-head weight, same dtype (may have requires_grad=False).
        targets: ``[...]`` int64, hidden's leading shape (already shifted by the caller); ``ignore_index`` marks
            positions without a target.
        logit_softcap: if set, logits become ``c * tanh(logits / c)`` before the temperature.
        temperature: logits are divided by it (> 0) before the softmax.
        entropy: also return ``-sum p log p`` of the same distribution.
    Returns:
        ``(logps, entropy)``: fp32 tensors shaped like ``targets``, 0 at ignored positions; ``entropy`` is None
        unless asked for. Both are differentiable w.r.t. hidden and weight.
    """
    check_inputs(
        hidden, weight, targets, ignore_index=ignore_index, logit_softcap=logit_softcap,
        temperature=temperature, entropy=entropy, backend="eager",
    )  # fmt: skip
    softcap = None if logit_softcap is None else float(logit_softcap)
    return log_probs_unchecked(hidden, weight, targets, ignore_index, softcap, float(temperature), entropy)
