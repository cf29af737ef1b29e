"""Gradient-norm clipping across the dense FSDP mesh and the expert (ep_fsdp x ep) meshes.

Each rank holds a piece of the global gradient. The global p-norm is ``(sum over distinct pieces of
|g|^p)^(1/p)``, so each piece must be counted exactly once:

- dense DTensor gradients are sharded over ``dp_shard * sp``: sum over ``state.fsdp_shard_group`` only. HSDP
  replicas hold identical shards; summing over the replicate dim too would count every piece ``dp_replicate``
  times.
- expert DTensor gradients are sharded over ``ep_fsdp`` and hold distinct experts on each EP rank: sum over
  ``ep_fsdp_group``, then over ``ep_group`` (again never over ``ep_replicate``).
- plain (non-DTensor) gradients are replicated: dense ones are counted locally, EP-sliced ones summed over
  ``ep_group``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Shard

from veomni.core.ep.plan import expert_shard_of
from veomni.core.parallel_state import ParallelState


def _named(parameters_or_model: nn.Module | Tensor | Iterable[Tensor]) -> list[tuple[str, Tensor]]:
    if isinstance(parameters_or_model, nn.Module):
        return list(parameters_or_model.named_parameters())
    if isinstance(parameters_or_model, Tensor):
        return [("params[0]", parameters_or_model)]
    return [(f"params[{i}]", p) for i, p in enumerate(parameters_or_model)]


def _shard_ranks(name: str, grad: DTensor, cache: dict[int, tuple[int, ...]]) -> tuple[int, ...] | None:
    """Global ranks ``grad`` is sharded over (None: replicated everywhere)."""
    placements = grad.placements
    if any(isinstance(p, Partial) for p in placements):
        raise ValueError(
            f"clip_grad_norm: the gradient of {name} has Partial placements {placements} (not yet reduced); "
            "clip after the last micro-step's backward, with gradient sync on"
        )
    dims = [i for i, p in enumerate(placements) if isinstance(p, Shard)]
    if len(dims) > 1:
        raise ValueError(
            f"clip_grad_norm: the gradient of {name} is sharded over several mesh dims {placements}"
        )
    if not dims:
        return None
    # Compared by ranks, not by group object: DTensor treats meshes with the same layout as equal and may hand
    # back an equal mesh of another ParallelState, whose groups hold the same ranks.
    group = grad.device_mesh.get_group(dims[0])
    if id(group) not in cache:
        cache[id(group)] = _ranks(group)
    return cache[id(group)]


def _ranks(group: dist.ProcessGroup) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def _power_sum(tensors: list[Tensor], p: float, device: torch.device) -> Tensor:
    """``sum |x|^p`` (or ``max |x|`` for p = inf) over ``tensors``, accumulated in fp32, as a 0-dim tensor."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        # Empty shards exist (uneven FSDP sharding) and have no inf-norm; they contribute nothing anyway.
        if t.numel():
            groups.setdefault((t.device, t.dtype), []).append(t)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for group in groups.values():  # one copy per group (e.g. CPU-offloaded gradients), not one per tensor
        # One multi-tensor kernel per (device, dtype) instead of a launch per tensor (~300 for a 1.7B model).
        stacked = torch.stack(torch._foreach_norm(group, p, dtype=torch.float32))
        total = _combine(total, (stacked.max() if math.isinf(p) else stacked.pow(p).sum()).to(device), p)
    return total


def _combine(a: Tensor, b: Tensor, p: float) -> Tensor:
    return torch.maximum(a, b) if math.isinf(p) else a + b


def _all_reduce(x: Tensor, p: float, group: dist.ProcessGroup | None) -> Tensor:
    """``x`` (0-dim fp32) summed over ``group``, or its max for p = inf. A backend's MAX keeps the non-NaN value
    (gloo's is std::max), so a NaN on one rank travels as a flag beside the max and comes back as NaN everywhere."""
    if not math.isinf(p):
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        return x
    packed = torch.stack([x, torch.isnan(x).to(x.dtype)])
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    return torch.where(packed[1] > 0, torch.full_like(packed[0], math.nan), packed[0])


def clip_grad_norm(
    parameters_or_model: nn.Module | Tensor | Iterable[Tensor],
    max_norm: float,
    state: ParallelState,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
    scale_gradients: bool = True,
) -> Tensor:
    """Clip gradients in place to a global norm of ``max_norm``; return the global norm before clipping.

    Every rank must call this with the same parameters (it runs collectives on ``state``'s groups). The local
    sums are taken over ``grad.to_local()`` with ``_foreach_norm(..., dtype=float32)``, so bf16 gradients are
    accumulated in fp32 without an fp32 copy. One coefficient ``min(1, max_norm / (norm + 1e-6))`` multiplies
    every gradient, as in ``torch.nn.utils.clip_grad_norm_``.

    A non-finite norm is returned as is (inf or nan) and, as in torch, still applied: gradients become nan (or
    0 for an inf norm). Check the returned norm and skip the optimizer step, or pass ``error_if_nonfinite``.

    Args:
        parameters_or_model: a module (its parameters), one tensor, or an iterable of tensors. Parameters with
            no gradient are skipped. EP expert parameters are recognised by `expert_shard_of`, or as DTensors
            sharded over the ``ep_fsdp`` group.
        max_norm: the largest allowed global norm, > 0.
        state: the parallel state the model was sharded with.
        norm_type: p > 0, or ``inf`` (max-abs, combined with MAX reductions).
        error_if_nonfinite: raise ``RuntimeError`` (on every rank alike) if the norm is nan or inf.
        scale_gradients: False computes the norm only; the caller applies `clip_coefficient` itself (e.g.
            inside a fused optimizer's ``grad_scale``, saving a pass over the gradients).

    Returns:
        The global norm, a 0-dim fp32 tensor on ``state.device``, identical on every rank.
    """
    norm_type = float(norm_type)
    if not (norm_type > 0):
        raise ValueError(f"clip_grad_norm: norm_type must be > 0 or inf, got {norm_type}")
    if not (float(max_norm) > 0):
        raise ValueError(f"clip_grad_norm: max_norm must be > 0, got {max_norm}")
    device = state.device
    dense_group = state.fsdp_shard_group
    expected = {False: _ranks(dense_group), True: _ranks(state.ep_fsdp_group) if state.ep_enabled else None}
    cache: dict[int, tuple[int, ...]] = {}

    # buckets[(is_expert, is_sharded)] -> local gradient tensors
    buckets: dict[tuple[bool, bool], list[Tensor]] = {
        (e, s): [] for e in (False, True) for s in (False, True)
    }
    for name, param in _named(parameters_or_model):
        grad = param.grad
        if grad is None:
            continue
        is_expert = state.ep_enabled and expert_shard_of(param) is not None
        if isinstance(grad, DTensor):
            ranks = _shard_ranks(name, grad, cache)
            is_expert = is_expert or (state.ep_enabled and ranks == expected[True])
            if ranks is not None and ranks != expected[is_expert]:
                kind = "an expert" if is_expert else "a dense"
                raise ValueError(
                    f"clip_grad_norm: {name} is {kind} parameter but its gradient is sharded over ranks "
                    f"{list(ranks)}, not this rank's {'ep_fsdp' if is_expert else 'dp_shard_sp'} group "
                    f"{list(expected[is_expert] or ())}; was it sharded by apply_fsdp2 with this "
                    "ParallelState?"
                )
            buckets[(is_expert, ranks is not None)].append(grad.to_local())
        else:
            buckets[(is_expert, False)].append(grad)

    p = norm_type
    dense = _all_reduce(_power_sum(buckets[(False, True)], p, device), p, dense_group)
    total = _combine(dense, _power_sum(buckets[(False, False)], p, device), p)
    if state.ep_enabled:
        expert = _all_reduce(_power_sum(buckets[(True, True)], p, device), p, state.ep_fsdp_group)
        expert = _combine(expert, _power_sum(buckets[(True, False)], p, device), p)
        expert = _all_reduce(expert, p, state.ep_group)
        total = _combine(total, expert, p)
    if not math.isinf(p):
        total = total.pow(1.0 / p)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"clip_grad_norm: the total {p}-norm of the gradients is non-finite ({total.item()})"
        )

    if not scale_gradients:
        return total
    _multiply(sum(buckets.values(), []), clip_coefficient(total, max_norm))
    return total


def scale_gradients_(parameters_or_model: nn.Module | Tensor | Iterable[Tensor], coefficient: Tensor) -> None:
    """Multiply every gradient of ``parameters_or_model`` in place by ``coefficient`` (a 0-d tensor, e.g.
    `clip_coefficient` over a loss scale): each rank its local shards, no collective."""
    grads = [p.grad for _, p in _named(parameters_or_model) if p.grad is not None]
    _multiply([g.to_local() if isinstance(g, DTensor) else g for g in grads], coefficient)


def _multiply(tensors: list[Tensor], coefficient: Tensor) -> None:
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    for (dev, dtype), group in groups.items():
        # The coefficient in the gradients' own dtype keeps `_foreach_mul_` on its multi-tensor kernel (a
        # mismatched fp32 scalar fell back to one kernel per tensor on CUDA); for bf16 gradients it is rounded
        # as each product is anyway.
        torch._foreach_mul_(group, coefficient.to(device=dev, dtype=dtype))


def clip_coefficient(total_norm: Tensor, max_norm: float) -> Tensor:
    """``min(1, max_norm / (total_norm + 1e-6))``: what `clip_grad_norm` multiplies every gradient by (0-d fp32)."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
