"""Loss normalisation that makes the gradient exactly ∇(Σ token loss / N_global) for any DP × SP × grad-accum.

The bookkeeping, once per optimizer step:

1. ``N_global = global_token_count(counts_of_every_micro_batch, state.loss_group, state.device)``: valid label tokens of the
   whole step, summed over micro-batches and over every rank of the loss group (dp × sp, i.e. the world). With SP
   each rank counts only its slice, so every token is counted once.
2. Per micro-batch, each rank computes a mean over its tokens (``loss``, ``tokens``) or, under SP, the
   token-weighted mean of its SP group (`sp_token_mean`), and calls backward on
   ``scale_loss_for_backward(loss, tokens, N_global, world, replicas)``.

Why it is exact: FSDP (and DDP) average gradients over the world, W ranks. The objective autograd sees is the sum
over ranks of what each rank backprops (veomni's collective convention, see `veomni.core.sp.comm`). Scaling a
rank's token sum by ``W / N_global`` makes that sum ``W * Σ loss / N_global``; FSDP's average divides the W back
out. An SP-group mean is replicated on its P ranks, hence ``replicas = P`` for it.

Empty groups: a mean over zero tokens is 0/0 in most loss functions. Both functions here treat a zero count as a
zero loss with zero gradient, never NaN.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from veomni.core.sp.comm import all_reduce_sum

IGNORE_INDEX = -100


def count_valid_tokens(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Number of label positions that are not ``ignore_index``.

    Args:
        labels: integer tensor of any shape.
    Returns:
        0-d int64 tensor on ``labels.device`` (no host sync).
    """
    if labels.is_floating_point():
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    return (labels != ignore_index).sum(dtype=torch.int64)


def global_token_count(
    local_counts: Sequence[torch.Tensor | int], group: dist.ProcessGroup, device: torch.device
) -> torch.Tensor:
    """Σ over this rank's micro-batches and over every rank of ``group`` of the valid-token counts.

    Args:
        local_counts: one count per micro-batch of this step (0-d int tensors or ints). May be empty.
        group: the loss group (``ParallelState.loss_group``: dp × sp).
        device: where the reduction runs (``ParallelState.device``; CUDA for NCCL groups).
    Returns:
        0-d int64 tensor on ``device``, identical on every rank. One all-reduce per step, no host sync.
    """
    total = torch.zeros((), dtype=torch.int64, device=device)
    for count in local_counts:
        total += count.to(device=device, dtype=torch.int64) if isinstance(count, torch.Tensor) else int(count)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total


def _as_count(tokens: torch.Tensor | int, like: torch.Tensor) -> torch.Tensor:
    if isinstance(tokens, torch.Tensor):
        return tokens.to(device=like.device)
    return torch.full((), int(tokens), device=like.device)  # a fill: no blocking host -> device copy


def sp_token_mean(
    local_mean: torch.Tensor, local_tokens: torch.Tensor | int, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-weighted mean of per-rank mean losses over an SP group: the exact mean over the full sequence.

    Args:
        local_mean: 0-d float tensor, this rank's mean loss over ``local_tokens`` tokens (NaN allowed when the
            count is 0: it is replaced by 0).
        local_tokens: this rank's valid-token count (0-d int tensor or int).
        group: the SP group.
    Returns:
        ``(mean, tokens)``: the group's mean loss (``local_mean.dtype``; 0 when the group has no valid token) and
        its token count (0-d int64), both identical on every rank. Backward follows the sum-over-ranks
        convention: each rank's ``local_mean`` receives ``n_r / N`` times the sum of the ranks' upstream grads.
    """
    count = _as_count(local_tokens, local_mean)
    safe_mean = torch.where(count > 0, local_mean, torch.zeros_like(local_mean))
    # One collective: weighted sum and count together, in float64 so large counts stay exact.
    packed = torch.stack([safe_mean.double() * count.double(), count.double().detach()])
    total = all_reduce_sum(packed, group)
    mean = (total[0] / total[1].clamp(min=1)).to(local_mean.dtype)
    return mean, total[1].detach().round().to(torch.int64)


def scale_loss_for_backward(
    loss: torch.Tensor,
    tokens: torch.Tensor | int,
    global_tokens: torch.Tensor | int,
    reduce_size: int,
    replicas: int = 1,
) -> torch.Tensor:
    """The scalar to call backward on so that gradients averaged over ``reduce_size`` ranks equal
    ∇(Σ token loss / N_global).

    Args:
        loss: 0-d float tensor, a mean over ``tokens`` tokens (NaN allowed when ``tokens`` is 0).
        tokens: valid tokens behind ``loss`` (this rank's count, or the SP group's for an `sp_token_mean`).
        global_tokens: the step's ``N_global`` from `global_token_count`.
        reduce_size: ranks the gradients are averaged over (the loss group size, dp × sp).
        replicas: ranks that hold this same ``loss`` value (1 for a per-rank mean, P for an SP-group mean).
    Returns:
        0-d tensor ``loss * tokens * reduce_size / (replicas * max(N_global, 1))``, 0 when ``tokens`` is 0.
    """
    if reduce_size < 1 or replicas < 1:
        raise ValueError(f"reduce_size and replicas must be >= 1, got {reduce_size} and {replicas}")
    count = _as_count(tokens, loss)
    denom = _as_count(global_tokens, loss).clamp(min=1).to(torch.float64) * replicas
    safe = torch.where(count > 0, loss, torch.zeros_like(loss))
    factor = (count.to(torch.float64) * reduce_size / denom).to(loss.dtype)
    return safe * factor
