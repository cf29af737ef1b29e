"""Ulysses sequence-parallel collectives with exact autograd adjoints.

Convention for every autograd collective in veomni: the training objective is the *sum over ranks* of the scalars
each rank calls ``backward`` on, and each collective's backward is its exact adjoint under that convention, with
no hidden scaling. (FSDP then averages gradients over the world; `veomni.core.loss` scales losses to match.)

Layouts use ``P`` for the SP group size, ``S`` for the full (padded) sequence length and ``H`` for heads:

    seq_to_heads:  [..., S/P, ..., H, ...]   -> [..., S, ..., H/P, ...]
    heads_to_seq:  [..., S, ..., H/P, ...]   -> [..., S/P, ..., H, ...]
    gather_sequence: [..., S_r, ...] on rank r -> [..., sum_r S_r, ...] on every rank

Host syncs: `gather_sequence` with ``equal_sizes=False`` reads the exchanged shapes to the host once; nothing else
here synchronises with the host.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from veomni.core.sp.padding import _norm_dim, pad_to_length, pad_to_multiple, unpad


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    world = dist.get_world_size(group)
    if x.shape[scatter_dim] % world != 0:
        raise ValueError(
            f"all-to-all scatters dim {scatter_dim} of shape {tuple(x.shape)} over {world} ranks: "
            f"its size must be divisible by {world}"
        )
    # Chunk p (destination rank p) becomes row p of a contiguous send buffer. Contiguity before allocating the
    # receive buffer matters: NCCL rejects buffers that inherit odd strides.
    send = torch.unflatten(x, scatter_dim, (world, x.shape[scatter_dim] // world))
    send = send.movedim(scatter_dim, 0).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # Row p of recv came from rank p and holds that rank's part of the gathered dim, in rank order.
    return recv.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int
    ) -> torch.Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        # An all-to-all is a permutation of elements across ranks; its adjoint is the inverse permutation.
        return _all_to_all(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup, *, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Differentiable all-to-all: split ``scatter_dim`` into P chunks (chunk p to rank p), concatenate the
    received chunks along ``gather_dim`` in rank order.

    Args:
        x: ``[..., N, ..., M, ...]`` with N (at ``scatter_dim``) divisible by P; any dtype.
    Returns:
        ``[..., N/P, ..., M*P, ...]``; backward is the same collective with the dims swapped.
    """
    scatter_dim, gather_dim = _norm_dim(x, scatter_dim), _norm_dim(x, gather_dim)
    if scatter_dim == gather_dim:
        raise ValueError(f"scatter_dim and gather_dim must differ, both are {scatter_dim}")
    if dist.get_world_size(group) == 1:
        return x
    out: torch.Tensor = _AllToAll.apply(x, group, scatter_dim, gather_dim)
    return out


def _check_heads(num_heads: int, world: int, what: str) -> None:
    if num_heads % world != 0:
        raise ValueError(f"Ulysses SP needs {what} divisible by the SP size {world}, got {num_heads}")


def seq_to_heads(
    x: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    seq_dim: int,
    head_dim: int,
    unpadded_len: int | None = None,
) -> torch.Tensor:
    """Gather the sequence and scatter the heads: ``[..., S/P, ..., H, ...] -> [..., S, ..., H/P, ...]``.

    Rank r ends up with heads ``[r*H/P, (r+1)*H/P)`` of the whole sequence.

    Args:
        x: the local sequence shard; every rank's shard has the same length ``S/P`` (pad before slicing).
        unpadded_len: the true full length; the tail padding beyond it is cut off (backward pads it back).
    Returns:
        ``[..., S or unpadded_len, ..., H/P, ...]``, same dtype.
    """
    seq_dim, head_dim = _norm_dim(x, seq_dim), _norm_dim(x, head_dim)
    _check_heads(x.shape[head_dim], dist.get_world_size(group), "the number of heads")
    out = all_to_all(x, group, scatter_dim=head_dim, gather_dim=seq_dim)
    if unpadded_len is not None:
        out = unpad(out, seq_dim, unpadded_len)
    return out


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup, *, seq_dim: int, head_dim: int) -> torch.Tensor:
    """Gather the heads and scatter the sequence: ``[..., S, ..., H/P, ...] -> [..., S_pad/P, ..., H, ...]``.

    ``S`` may be any length: it is zero-padded to a multiple of P first, so this inverts `seq_to_heads` with
    ``unpadded_len`` exactly.

    Args:
        x: the full sequence of this rank's heads, identical ``S`` on every rank.
    Returns:
        ``[..., ceil(S/P), ..., H, ...]``, same dtype.
    """
    seq_dim, head_dim = _norm_dim(x, seq_dim), _norm_dim(x, head_dim)
    x = pad_to_multiple(x, seq_dim, dist.get_world_size(group))
    return all_to_all(x, group, scatter_dim=seq_dim, gather_dim=head_dim)


def qkv_seq_to_heads(
    qkv: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    seq_dim: int,
    num_heads: int,
    unpadded_len: int | None = None,
) -> torch.Tensor:
    """`seq_to_heads` for a fused QKV projection whose last dim is ``[3, H, D]`` flattened.

    One all-to-all moves Q, K and V together; each rank receives its heads of all three.

    Args:
        qkv: ``[..., S/P, ..., 3*H*D]`` (``seq_dim`` must not be the last dim).
    Returns:
        ``[..., S, ..., 3*(H/P)*D]``, laid out as ``[3, H/P, D]`` in the last dim.
    """
    seq_dim = _norm_dim(qkv, seq_dim)
    if seq_dim == qkv.dim() - 1:
        raise ValueError("qkv_seq_to_heads: the last dim holds the fused heads; seq_dim must be another dim")
    last = qkv.shape[-1]
    if num_heads < 1 or last % (3 * num_heads) != 0:
        raise ValueError(f"fused QKV last dim {last} is not 3 * num_heads({num_heads}) * head_dim")
    split = torch.unflatten(qkv, -1, (3, num_heads, last // (3 * num_heads)))
    out = seq_to_heads(split, group, seq_dim=seq_dim, head_dim=-2, unpadded_len=unpadded_len)
    return out.flatten(-3)


# Codes for the dtype check before variable-size gathers. A rank whose dtype differs from its peers' would make
# NCCL reinterpret bytes silently, so mismatches are refused before any data moves.
_DTYPE_CODES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)  # fmt: skip
_MAX_DIMS = 8


def _exchange_shapes(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> list[int]:
    """All ranks' sizes along ``dim`` (one collective, one host read), after checking dtypes and other dims."""
    if x.dtype not in _DTYPE_CODES or x.dim() > _MAX_DIMS:
        raise ValueError(f"gather_sequence supports the dtypes {_DTYPE_CODES} and <= {_MAX_DIMS} dims")
    world = dist.get_world_size(group)
    meta = torch.full((2 + _MAX_DIMS,), -1, dtype=torch.int64)
    meta[0], meta[1] = _DTYPE_CODES.index(x.dtype), x.dim()
    meta[2 : 2 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
    gathered = torch.empty(world * meta.numel(), dtype=torch.int64, device=x.device)
    dist.all_gather_into_tensor(gathered, meta.to(x.device), group=group)
    rows = gathered.view(world, -1).tolist()  # the one host sync of a variable-size gather
    mine = meta.tolist()
    for peer, row in enumerate(rows):
        if row[0] != mine[0]:
            raise TypeError(
                f"gather_sequence: dtype mismatch across the group, this rank has {x.dtype} and group rank "
                f"{peer} has {_DTYPE_CODES[row[0]]}"
            )
        other_dims = [s for i, s in enumerate(row[2:]) if i != dim]
        if row[1] != mine[1] or other_dims != [s for i, s in enumerate(mine[2:]) if i != dim]:
            raise ValueError(
                f"gather_sequence: shapes must agree outside dim {dim}; this rank has {tuple(x.shape)}, "
                f"group rank {peer} has {tuple(row[2 : 2 + row[1]])}"
            )
    return [row[2 + dim] for row in rows]


def _gather_padded(x: torch.Tensor, group: dist.ProcessGroup, dim: int, sizes: list[int]) -> torch.Tensor:
    world, longest = len(sizes), max(sizes)
    if longest == 0:
        return x  # every shard is empty
    # all_gather_into_tensor needs equal shards: pad each to the longest, cut the padding after.
    send = pad_to_length(x.movedim(dim, 0), 0, longest).contiguous()
    recv = torch.empty((world * longest, *send.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(recv, send, group=group)
    parts = [recv.narrow(0, r * longest, sizes[r]) for r in range(world)]
    return torch.cat(parts, 0).movedim(0, dim)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, dim: int, sizes: list[int]
    ) -> torch.Tensor:
        rank = dist.get_rank(group)
        ctx.group, ctx.dim = group, dim
        ctx.offset, ctx.size = sum(sizes[:rank]), sizes[rank]
        return _gather_padded(x, group, dim, sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        # Every rank used the whole gathered tensor, so a shard's gradient is the sum of all ranks' gradients
        # for its slice. The clone keeps the in-place all-reduce off autograd's buffer.
        total = grad.contiguous().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.group)
        return total.narrow(ctx.dim, ctx.offset, ctx.size), None, None, None


def gather_sequence(
    x: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    dim: int,
    equal_sizes: bool = False,
) -> torch.Tensor:
    """All-gather shards of possibly different lengths along ``dim``, concatenated in rank order.

    Backward sums the gradient over the group and returns this rank's slice: the exact adjoint when each rank
    consumes the gathered tensor (for example, different downstream slices of it).

    Args:
        x: ``[..., S_r, ...]``; all other dims and the dtype must agree across ranks (checked, unless
            ``equal_sizes``).
        equal_sizes: promise that every shard has this rank's shape and dtype; skips the shape exchange and its
            host sync.
    Returns:
        ``[..., sum_r S_r, ...]``, identical on every rank.
    """
    dim = _norm_dim(x, dim)
    world = dist.get_world_size(group)
    if world == 1:
        return x
    sizes = [x.shape[dim]] * world if equal_sizes else _exchange_shapes(x, group, dim)
    out: torch.Tensor = _GatherSequence.apply(x, group, dim, sizes)
    return out


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.contiguous().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # y_r = sum_s x_s on every rank, so dL/dx_s = sum_r dL/dy_r: the adjoint is the same all-reduce.
        total = grad.contiguous().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.group)
        return total, None


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable all-reduce (sum) over ``group``; backward all-reduces the gradient.

    Args:
        x: any shape and floating dtype.
    Returns:
        same shape and dtype, the sum over ranks, identical on every rank.
    """
    if dist.get_world_size(group) == 1:
        return x
    out: torch.Tensor = _AllReduceSum.apply(x, group)
    return out
