"""Padding and slicing along the sequence dimension for Ulysses SP. Plain differentiable tensor ops, no comms.

Every rank of an SP group holds the same full sequence before slicing. Slicing pads first (to a multiple of the
SP size, times an optional scale), so no token is ever dropped, and gradients flow back only into this rank's
slice: the rest of the sequence is owned by its peers, whose gradients reach shared parameters through FSDP's
reduction, not through this tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _norm_dim(x: torch.Tensor, dim: int) -> int:
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def padded_length(length: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``length``."""
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    return -(-length // multiple) * multiple


def pad_to_length(x: torch.Tensor, dim: int, length: int, value: float = 0) -> torch.Tensor:
    """Pad ``x`` at the end of ``dim`` with ``value`` up to exactly ``length`` (>= its current size).

    Args:
        x: any shape ``[..., S, ...]`` and dtype.
    Returns:
        ``[..., length, ...]``; ``x`` itself when it already has that length.
    """
    dim = _norm_dim(x, dim)
    extra = length - x.shape[dim]
    if extra < 0:
        raise ValueError(f"cannot pad dim {dim} of shape {tuple(x.shape)} down to length {length}")
    if extra == 0:
        return x
    # F.pad takes (left, right) pairs starting from the last dim.
    pads = [0, 0] * (x.dim() - 1 - dim) + [0, extra]
    return F.pad(x, pads, value=value)


def pad_to_multiple(x: torch.Tensor, dim: int, multiple: int, value: float = 0) -> torch.Tensor:
    """Pad ``x`` at the end of ``dim`` with ``value`` up to a multiple of ``multiple`` (no copy if already one).

    Args:
        x: any shape ``[..., S, ...]`` and dtype.
    Returns:
        ``[..., ceil(S / multiple) * multiple, ...]``, same dtype and device.
    """
    dim = _norm_dim(x, dim)
    return pad_to_length(x, dim, padded_length(x.shape[dim], multiple), value)


def unpad(x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """Keep the first ``length`` entries of ``dim`` (inverse of `pad_to_multiple`).

    Args:
        x: ``[..., S_pad, ...]`` with ``S_pad >= length``.
    Returns:
        ``[..., length, ...]`` (a view).
    """
    dim = _norm_dim(x, dim)
    if length > x.shape[dim] or length < 0:
        raise ValueError(f"cannot unpad dim {dim} of shape {tuple(x.shape)} to length {length}")
    return x.narrow(dim, 0, length)


def slice_for_rank(x: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """This rank's contiguous chunk of an already padded ``dim`` (length divisible by ``world_size``).

    Returns:
        ``[..., S / world_size, ...]`` (a view).
    """
    dim = _norm_dim(x, dim)
    length = x.shape[dim]
    if length % world_size != 0:
        raise ValueError(
            f"dim {dim} has length {length}, not divisible by {world_size}; pad first (pad_to_multiple)"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is out of range for world size {world_size}")
    chunk = length // world_size
    return x.narrow(dim, rank * chunk, chunk)


def pad_and_slice(
    x: torch.Tensor,
    dim: int,
    group: dist.ProcessGroup,
    *,
    pad_value: float = 0,
    pad_scale: int = 1,
) -> torch.Tensor:
    """Pad ``dim`` to a multiple of ``P * pad_scale`` and return this rank's chunk (P = SP group size).

    ``pad_scale`` keeps units of several rows together: for vision patches that are later merged 2x2, pass 4 so
    that a merge group never straddles two ranks (each chunk is a whole number of merge groups).

    Args:
        x: ``[..., S, ...]``, identical on every rank of ``group``.
    Returns:
        ``[..., ceil(S / (P * pad_scale)) * pad_scale, ...]``; gradients flow back to this rank's chunk only.
    """
    if pad_scale < 1:
        raise ValueError(f"pad_scale must be >= 1, got {pad_scale}")
    world = dist.get_world_size(group)
    padded = pad_to_multiple(x, dim, world * pad_scale, pad_value)
    return slice_for_rank(padded, dim, dist.get_rank(group), world)


def slice_sequence(x: torch.Tensor, dim: int, group: dist.ProcessGroup, *, pad_value: float = 0) -> torch.Tensor:
    """This rank's chunk of the full sequence ``x``, padding first so that no token is dropped.

    Args:
        x: ``[..., S, ...]``, identical on every rank of ``group``.
    Returns:
        ``[..., ceil(S / P), ...]``.
    """
    return pad_and_slice(x, dim, group, pad_value=pad_value, pad_scale=1)
