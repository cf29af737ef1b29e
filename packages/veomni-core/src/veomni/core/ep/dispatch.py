"""Token dispatch and combine across the expert-parallel group, for top-k routed MoE layers.

EP rank ``r`` of an ``ep``-rank group owns the contiguous experts ``[r*E/ep, (r+1)*E/ep)`` (the layout
`apply_expert_plan` produces). `dispatch_tokens` sends each (token, selected expert) pair to the rank owning
that expert and hands back the received rows grouped by local expert; `combine_tokens` sends the expert
outputs back and sums them into their tokens with the routing weights.

Autograd convention (shared by every veomni collective): the objective is the SUM over ranks of the scalars
each rank calls backward on, and every collective's backward is its exact adjoint under that convention, with
no hidden scaling. The all-to-all's adjoint is the all-to-all with input and output splits swapped.

Determinism: all row movement is done by gathers (``index_select``) whose backward is another gather through
the inverse permutation; duplicated rows are summed with a reduction over a fixed axis. No atomics, so results
and gradients are bitwise reproducible for a given input.
"""

from __future__ import annotations

import zlib
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import Tensor

# Extra columns appended to the per-expert counts in the one all_gather: [ids out of range, hidden size,
# dtype code]. They let every rank detect a peer's bad input from the same host read and raise together,
# instead of one rank raising while its peers hang in the all-to-all (or, for a dtype mismatch, silently
# exchange garbage).
_META_COLS = 3


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
    ) -> Tensor:
        ctx.splits = (list(input_splits), list(output_splits))
        ctx.group = group
        x = x.contiguous()
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x, list(output_splits), list(input_splits), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        input_splits, output_splits = ctx.splits
        grad = grad.contiguous()
        grad_in = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        # Rows that went r -> s come back s -> r: the same exchange with the splits swapped.
        dist.all_to_all_single(grad_in, grad, input_splits, output_splits, group=ctx.group)
        return grad_in, None, None, None


def all_to_all_rows(
    x: Tensor, input_splits: list[int], output_splits: list[int], group: dist.ProcessGroup
) -> Tensor:
    """Differentiable ``all_to_all_single`` along dim 0 with explicit splits.

    Args:
        x: ``[sum(input_splits), ...]``; rows ``input_splits[:d]`` onwards go to group rank ``d``.
        input_splits: rows sent to each rank of ``group`` (length ``group`` size).
        output_splits: rows received from each rank; must equal what the peers send.
        group: the process group (all members must call this together).

    Returns:
        ``[sum(output_splits), ...]``, same dtype and device, the received rows in source-rank order.
        Backward is the same exchange with the splits swapped (the exact adjoint, no scaling).
    """
    if x.shape[0] != sum(input_splits):
        raise ValueError(
            f"all_to_all_rows: x has {x.shape[0]} rows but input_splits sum to {sum(input_splits)}"
        )
    out: Tensor = _AllToAll.apply(x, list(output_splits), list(input_splits), group)
    return out


class _GatherRows(torch.autograd.Function):
    """``x[index]`` whose backward gathers through ``inverse`` and sums each run of ``fold`` rows."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, index: Tensor, inverse: Tensor, fold: int) -> Tensor:
        ctx.save_for_backward(inverse)
        ctx.fold = fold
        ctx.num_rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        (inverse,) = ctx.saved_tensors
        grad_x = grad.index_select(0, inverse)
        if ctx.fold > 1:
            grad_x = torch.unflatten(grad_x, 0, (ctx.num_rows, ctx.fold)).sum(1)
        return grad_x, None, None, None


def _gather_rows(x: Tensor, index: Tensor, inverse: Tensor, fold: int) -> Tensor:
    """``x[index]`` (``index`` 1-D int64) with the `_GatherRows` backward."""
    out: Tensor = _GatherRows.apply(x, index, inverse, fold)
    return out


@attrs.frozen(kw_only=True, eq=False)
class DispatchHandle:
    """What `combine_tokens` needs to undo one `dispatch_tokens` call. Treat as opaque.

    Attributes:
        group: the EP group (None: no expert parallelism).
        ep_size, ep_rank: size of and this rank's index in ``group``.
        num_tokens, top_k: ``T`` and ``k`` of the dispatched ``expert_ids``.
        order: ``[T*k]`` int64, the flat ``(token, slot)`` index of each sent row (expert-major order).
        unsort: ``[T*k]`` int64, the inverse permutation of ``order``.
        regroup: ``[N]`` int64, the received row placed at each expert-major position (None: identity).
        ungroup: ``[N]`` int64, the inverse of ``regroup`` (None: identity).
        input_splits: rows sent to each EP rank. output_splits: rows received from each EP rank.
        tokens_per_local_expert: rows for each local expert, in local expert order (host ints).
        local_expert_counts: the same as a ``[E/ep]`` int64 tensor on the device (no host copy needed).
    """

    group: dist.ProcessGroup | None
    ep_size: int
    ep_rank: int
    num_tokens: int
    top_k: int
    order: Tensor
    unsort: Tensor
    regroup: Tensor | None
    ungroup: Tensor | None
    input_splits: tuple[int, ...]
    output_splits: tuple[int, ...]
    tokens_per_local_expert: tuple[int, ...]
    local_expert_counts: Tensor

    @property
    def num_received(self) -> int:
        return sum(self.output_splits)


def _group_size_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 1, 0
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError("dispatch_tokens: this process is not a member of the given EP group")
    return size, rank


def _check_dispatch_inputs(hidden: Tensor, expert_ids: Tensor, num_experts: int, ep_size: int) -> None:
    if hidden.dim() != 2:
        raise ValueError(f"dispatch_tokens: hidden must be [T, H], got shape {tuple(hidden.shape)}")
    if not hidden.is_floating_point():
        raise TypeError(f"dispatch_tokens: hidden must be floating point, got {hidden.dtype}")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"dispatch_tokens: expert_ids must be [T, k] with T = hidden.shape[0] = {hidden.shape[0]}, "
            f"got shape {tuple(expert_ids.shape)}"
        )
    if expert_ids.shape[1] < 1:
        raise ValueError("dispatch_tokens: expert_ids has k = 0 experts per token; top-k needs k >= 1")
    if expert_ids.dtype != torch.int64:
        raise TypeError(f"dispatch_tokens: expert_ids must be int64, got {expert_ids.dtype}")
    if expert_ids.device != hidden.device:
        raise ValueError(
            f"dispatch_tokens: expert_ids is on {expert_ids.device} but hidden on {hidden.device}"
        )
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"dispatch_tokens: num_experts must be a positive int, got {num_experts!r}")
    if num_experts % ep_size != 0:
        raise ValueError(
            f"dispatch_tokens: num_experts={num_experts} is not divisible by the EP group size {ep_size}"
        )


def _check_gathered(table: list[list[int]], num_experts: int, ep_rank: int, hidden: Tensor) -> None:
    """Raise, identically on every rank, if any rank's input was bad (all ranks read the same table)."""
    bad = {r: row[num_experts] for r, row in enumerate(table) if row[num_experts]}
    if bad:
        raise ValueError(
            f"dispatch_tokens: expert_ids outside [0, {num_experts}) on EP rank(s) {sorted(bad)} "
            f"(count per rank: {bad}); this is EP rank {ep_rank}"
        )
    sizes = [row[num_experts + 1] for row in table]
    if len(set(sizes)) > 1:
        raise ValueError(f"dispatch_tokens: hidden size differs across EP ranks: {sizes} (rank order)")
    codes = [row[num_experts + 2] for row in table]
    if len(set(codes)) > 1:
        raise TypeError(
            f"dispatch_tokens: hidden dtype differs across EP ranks (this is EP rank {ep_rank}, "
            f"{hidden.dtype}); every rank must dispatch the same dtype"
        )


def _exclusive_cumsum(x: Tensor) -> Tensor:
    return torch.cumsum(x, 0) - x


def _regroup_indices(chunks: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """Index maps between received order ``[src][local_expert]`` and expert-major ``[local_expert][src]``.

    ``chunks`` is ``[ep, L]`` int64 on the device: rows from source ``s`` for local expert ``j``. Returns
    ``(regroup, ungroup)``, both ``[total]``: ``received[regroup]`` is expert-major and
    ``expert_major[ungroup]`` is back in received order. Built on the device with a known output size, so no
    host sync.
    """
    ep, local = chunks.shape
    src_start = _exclusive_cumsum(chunks.reshape(-1)).view(ep, local)
    sizes_t = chunks.t().reshape(-1)
    dst_start = _exclusive_cumsum(sizes_t).view(local, ep).t()
    shift = dst_start - src_start  # where each chunk moves, [ep, L]
    positions = torch.arange(total, device=chunks.device)
    ungroup = positions + torch.repeat_interleave(shift.reshape(-1), chunks.reshape(-1), output_size=total)
    regroup = positions + torch.repeat_interleave(-shift.t().reshape(-1), sizes_t, output_size=total)
    return regroup, ungroup


def dispatch_tokens(
    hidden: Tensor, expert_ids: Tensor, num_experts: int, group: dist.ProcessGroup | None
) -> tuple[Tensor, list[int], DispatchHandle]:
    """Send each token's row to the EP ranks owning its selected experts; group received rows by local expert.

    Args:
        hidden: ``[T, H]`` floating point; ``T`` may differ between ranks (0 included), ``H`` and dtype
            may not.
        expert_ids: ``[T, k]`` int64 on ``hidden``'s device, values in ``[0, num_experts)``; repeats allowed.
        num_experts: ``E``, the same on every rank, divisible by the EP group size.
        group: the EP group; every member must call this together. None means no expert parallelism (one
            rank owning every expert; note: NOT the default group). A group of size 1 behaves the same: no
            communication, identical results.

    Returns:
        ``(x, tokens_per_local_expert, handle)``: ``x`` is ``[N, H]`` (hidden's dtype) holding, for local
        expert 0, 1, ... in turn, the rows routed to it, ordered by source rank and, within a source, by
        (token, slot); ``tokens_per_local_expert`` is a host list of length ``E/ep`` summing to ``N``;
        ``handle`` is for `combine_tokens`. ``x`` is differentiable w.r.t. ``hidden``.

    Host syncs: exactly one, ``table_dev.tolist()`` below. It reads the all-gathered ``[ep, E + 3]`` count
    table (which waits for the local sort and the all_gather) because the all-to-all split sizes must be host
    ints. Everything else is derived either on the host from that one read or on the device from the gathered
    table; nothing copies Python data to the device (a pageable host-to-device copy would also block) and no
    ``non_blocking`` copies are made, so there is no copy-ordering hazard to reason about.

    Errors: local shape/dtype errors raise before any communication. Ids out of range, or hidden sizes or
    dtypes that differ between ranks, are detected from the gathered table and raise on every rank alike.
    """
    ep_size, ep_rank = _group_size_rank(group)
    _check_dispatch_inputs(hidden, expert_ids, num_experts, ep_size)
    num_tokens, top_k = expert_ids.shape
    local = num_experts // ep_size
    device = hidden.device

    flat_ids = expert_ids.reshape(-1)
    # Stable: rows for one expert keep (token, slot) order, so the layout is deterministic.
    sorted_ids, order = torch.sort(flat_ids, stable=True)
    unsort = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=device))
    # Counts from the sorted ids' boundaries: no atomics and, unlike bincount on CUDA, no sync.
    bounds = torch.searchsorted(sorted_ids, torch.arange(num_experts + 1, device=device))
    meta = torch.empty(num_experts + _META_COLS, dtype=torch.int64, device=device)
    meta[:num_experts] = bounds.diff()
    meta[num_experts] = bounds[0] + (flat_ids.numel() - bounds[-1])  # ids < 0 plus ids >= E
    # fill_ with a host scalar launches a kernel; `meta[i] = int` would copy from the host and sync on CUDA.
    meta[num_experts + 1 : num_experts + 2].fill_(hidden.shape[1])
    meta[num_experts + 2 :].fill_(zlib.crc32(str(hidden.dtype).encode()) & 0x7FFFFFFF)

    if ep_size > 1:
        gathered = meta.new_empty(ep_size * meta.numel())
        dist.all_gather_into_tensor(gathered, meta, group=group)
        table_dev = gathered.view(ep_size, -1)
    else:
        table_dev = meta.view(1, -1)
    table = table_dev.tolist()  # THE host sync (see docstring).
    _check_gathered(table, num_experts, ep_rank, hidden)

    mine = table[ep_rank]
    input_splits = [sum(mine[d * local : (d + 1) * local]) for d in range(ep_size)]
    received = [row[ep_rank * local : (ep_rank + 1) * local] for row in table]  # [src][local_expert]
    output_splits = [sum(chunk) for chunk in received]
    per_expert = [sum(received[s][j] for s in range(ep_size)) for j in range(local)]
    total = sum(output_splits)

    x = _gather_rows(hidden, order // top_k, unsort, top_k)
    regroup = ungroup = None
    # ep_size > 1 implies a group (`_group_size_rank`); the None test is for the type checker.
    if group is not None and ep_size > 1:
        x = all_to_all_rows(x, input_splits, output_splits, group)
        if local > 1:  # with one local expert, [src][expert] already is [expert][src]
            chunks = table_dev[:, ep_rank * local : (ep_rank + 1) * local]
            regroup, ungroup = _regroup_indices(chunks, total)
            x = _gather_rows(x, regroup, ungroup, 1)
    counts_dev = table_dev[:, ep_rank * local : (ep_rank + 1) * local].sum(0)

    handle = DispatchHandle(
        group=group,
        ep_size=ep_size,
        ep_rank=ep_rank,
        num_tokens=num_tokens,
        top_k=top_k,
        order=order,
        unsort=unsort,
        regroup=regroup,
        ungroup=ungroup,
        input_splits=tuple(input_splits),
        output_splits=tuple(output_splits),
        tokens_per_local_expert=tuple(per_expert),
        local_expert_counts=counts_dev,
    )
    return x, per_expert, handle


def combine_tokens(expert_out: Tensor, routing_weights: Tensor, handle: DispatchHandle) -> Tensor:
    """Inverse of `dispatch_tokens`: return expert outputs to their tokens and sum them with routing weights.

    ``y[t] = sum_j routing_weights[t, j] * out(t, j)`` where ``out(t, j)`` is the ``expert_out`` row produced
    for token ``t``'s ``j``-th selection. Products and the sum are computed in fp32 (fp64 for fp64 inputs): a
    bf16 running sum would lose the low-order bits of smaller contributions. Only the result is cast to
    ``expert_out.dtype``. No host syncs.

    Args:
        expert_out: ``[N, H_out]`` floating point, rows in the order `dispatch_tokens` returned them.
        routing_weights: ``[T, k]`` floating point (any float dtype; used in the accumulation dtype).
        handle: from the matching `dispatch_tokens` call; every EP rank must call this together.

    Returns:
        ``[T, H_out]`` in ``expert_out.dtype``. Differentiable w.r.t. ``expert_out`` and ``routing_weights``
        (and, through dispatch, the hidden states).
    """
    if not isinstance(handle, DispatchHandle):
        raise TypeError(f"combine_tokens: handle must be a DispatchHandle, got {type(handle).__name__}")
    if expert_out.dim() != 2 or expert_out.shape[0] != handle.num_received:
        raise ValueError(
            f"combine_tokens: expert_out must be [N, H] with N = {handle.num_received} dispatched rows, "
            f"got shape {tuple(expert_out.shape)}"
        )
    if not expert_out.is_floating_point():
        raise TypeError(f"combine_tokens: expert_out must be floating point, got {expert_out.dtype}")
    expected = (handle.num_tokens, handle.top_k)
    if tuple(routing_weights.shape) != expected:
        raise ValueError(
            f"combine_tokens: routing_weights must be [T, k] = {list(expected)}, "
            f"got {list(routing_weights.shape)}"
        )
    if not routing_weights.is_floating_point():
        raise TypeError(
            f"combine_tokens: routing_weights must be floating point, got {routing_weights.dtype}"
        )

    rows = expert_out
    # regroup and ungroup are set together, and a handle with ep_size > 1 holds its group.
    if handle.ungroup is not None and handle.regroup is not None:
        rows = _gather_rows(rows, handle.ungroup, handle.regroup, 1)
    if handle.group is not None and handle.ep_size > 1:
        rows = all_to_all_rows(rows, list(handle.output_splits), list(handle.input_splits), handle.group)
    rows = _gather_rows(rows, handle.unsort, handle.order, 1)  # back to (token, slot) order
    # At least fp32; fp64 inputs keep fp64.
    acc = torch.promote_types(expert_out.dtype, torch.float32)
    rows = rows.view(handle.num_tokens, handle.top_k, expert_out.shape[1]).to(acc)
    out = (rows * routing_weights.to(acc).unsqueeze(-1)).sum(1)
    return out.to(expert_out.dtype)
