"""Lazy tensors: checkpoint tensors known by shape and dtype, read one region at a time.

A converter composes them (stack experts, concatenate gate and up, transpose) without reading any data; the
loader then reads, for each parameter, only the region this rank holds. A per-expert checkpoint read under
EP therefore touches only this rank's experts, and an FSDP shard only its rows.

A region is one ``slice(start, stop)`` per dimension with explicit, in-range ints (step 1).

`stack`, `cat` and `transpose` accept real tensors too: when every input is a ``torch.Tensor`` they compute
eagerly and return one, so converters work unchanged on in-memory state dicts.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence

import torch

Region = tuple[slice, ...]


def full_region(shape: Sequence[int]) -> Region:
    """The region covering all of ``shape``."""
    return tuple(slice(0, n) for n in shape)


def region_shape(region: Region) -> tuple[int, ...]:
    """The shape of the block a region selects."""
    return tuple(s.stop - s.start for s in region)


def check_region(shape: Sequence[int], region: Region) -> None:
    """Raise ``ValueError`` unless ``region`` is a valid step-1 region of a tensor shaped ``shape``."""
    if len(region) != len(shape):
        raise ValueError(f"region {region} has {len(region)} dims, the tensor {len(shape)} ({list(shape)})")
    for dim, (s, n) in enumerate(zip(region, shape, strict=True)):
        if s.step not in (None, 1) or not 0 <= s.start <= s.stop <= n:
            raise ValueError(f"region {region}: dim {dim} slice {s} is not a step-1 range inside [0, {n}]")


class LazyTensor(abc.ABC):
    """A tensor of known ``shape`` and ``dtype`` whose data is read on demand, region by region."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @abc.abstractmethod
    def _read(self, region: Region) -> torch.Tensor: ...

    def read(self, region: Region) -> torch.Tensor:
        """The block ``region`` selects: a tensor shaped `region_shape` (region), dtype ``self.dtype``."""
        check_region(self.shape, region)
        return self._read(region)

    def materialize(self) -> torch.Tensor:
        """The whole tensor, shape ``self.shape``."""
        return self.read(full_region(self.shape))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={list(self.shape)}, dtype={self.dtype})"


class FileTensor(LazyTensor):
    """One tensor of a safetensors file, read through ``handle()`` (an open ``safetensors.safe_open``)."""

    def __init__(
        self,
        key: str,
        shape: Sequence[int],
        dtype: torch.dtype,
        handle: Callable[[], object],
        on_read: Callable[[int], None],
    ) -> None:
        self.key = key
        self.shape = tuple(int(n) for n in shape)
        self.dtype = dtype
        self._handle = handle
        self._on_read = on_read

    def _read(self, region: Region) -> torch.Tensor:
        shape = region_shape(region)
        if 0 in shape:
            return torch.empty(shape, dtype=self.dtype)
        handle = self._handle()
        # get_slice reads only the bytes of the block; a 0-dim tensor has no slice syntax.
        block = handle.get_slice(self.key)[region] if region else handle.get_tensor(self.key)  # type: ignore[attr-defined]
        self._on_read(block.numel() * block.element_size())
        return block.reshape(shape)


class InMemory(LazyTensor):
    """A lazy view of a tensor already in memory."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.shape = tuple(tensor.shape)
        self.dtype = tensor.dtype

    def _read(self, region: Region) -> torch.Tensor:
        return self.tensor[region] if region else self.tensor


def _common_dtype(parts: Sequence[LazyTensor], what: str) -> torch.dtype:
    dtypes = {p.dtype for p in parts}
    if len(dtypes) != 1:
        raise ValueError(f"{what}: the parts have different dtypes {sorted(map(str, dtypes))}")
    return parts[0].dtype


class Stacked(LazyTensor):
    """``torch.stack(parts, dim=0)`` of equally shaped parts."""

    def __init__(self, parts: Sequence[LazyTensor]) -> None:
        if not parts:
            raise ValueError("stack: no parts")
        shapes = {p.shape for p in parts}
        if len(shapes) != 1:
            raise ValueError(f"stack: the parts have different shapes {sorted(shapes)}")
        self.parts = list(parts)
        self.dtype = _common_dtype(self.parts, "stack")
        self.shape = (len(self.parts), *self.parts[0].shape)

    def _read(self, region: Region) -> torch.Tensor:
        rows = [self.parts[i].read(region[1:]) for i in range(region[0].start, region[0].stop)]
        if not rows:
            return torch.empty(region_shape(region), dtype=self.dtype)
        return torch.stack(rows, dim=0)


class Concatenated(LazyTensor):
    """``torch.cat(parts, dim)``: the parts agree on every other dim."""

    def __init__(self, parts: Sequence[LazyTensor], dim: int) -> None:
        if not parts:
            raise ValueError("cat: no parts")
        ndim = parts[0].ndim
        if not 0 <= dim < ndim:
            raise ValueError(f"cat: dim {dim} out of range for {ndim}-dim parts")
        rest = {p.shape[:dim] + p.shape[dim + 1 :] for p in parts}
        if len(rest) != 1 or any(p.ndim != ndim for p in parts):
            raise ValueError(f"cat along dim {dim}: incompatible shapes {[list(p.shape) for p in parts]}")
        self.parts = list(parts)
        self.dim = dim
        self.dtype = _common_dtype(self.parts, "cat")
        total = sum(p.shape[dim] for p in parts)
        self.shape = parts[0].shape[:dim] + (total,) + parts[0].shape[dim + 1 :]

    def _read(self, region: Region) -> torch.Tensor:
        want = region[self.dim]
        blocks = []
        offset = 0
        for part in self.parts:
            size = part.shape[self.dim]
            lo, hi = max(want.start, offset), min(want.stop, offset + size)
            if lo < hi:
                sub = list(region)
                sub[self.dim] = slice(lo - offset, hi - offset)
                blocks.append(part.read(tuple(sub)))
            offset += size
        if not blocks:
            return torch.empty(region_shape(region), dtype=self.dtype)
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=self.dim)


class Transposed(LazyTensor):
    """``source.transpose(dim0, dim1)``."""

    def __init__(self, source: LazyTensor, dim0: int, dim1: int) -> None:
        if not (0 <= dim0 < source.ndim and 0 <= dim1 < source.ndim):
            raise ValueError(f"transpose({dim0}, {dim1}) of a {source.ndim}-dim tensor")
        self.source = source
        self.dims = (dim0, dim1)
        self.dtype = source.dtype
        shape = list(source.shape)
        shape[dim0], shape[dim1] = shape[dim1], shape[dim0]
        self.shape = tuple(shape)

    def _read(self, region: Region) -> torch.Tensor:
        d0, d1 = self.dims
        swapped = list(region)
        swapped[d0], swapped[d1] = region[d1], region[d0]
        return self.source.read(tuple(swapped)).transpose(d0, d1)


TensorLike = torch.Tensor | LazyTensor


def as_lazy(tensor: TensorLike) -> LazyTensor:
    """``tensor`` as a `LazyTensor` (real tensors are wrapped, lazy ones returned as they are)."""
    return tensor if isinstance(tensor, LazyTensor) else InMemory(tensor)


def stack(parts: Sequence[TensorLike]) -> TensorLike:
    """Stack equally shaped parts on a new dim 0: eager if all are tensors, else lazy."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return Stacked([InMemory(p) for p in parts]).materialize()  # same checks, then one torch.stack
    return Stacked([as_lazy(p) for p in parts])


def cat(parts: Sequence[TensorLike], dim: int) -> TensorLike:
    """Concatenate along ``dim``: eager if all are tensors, else lazy."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return Concatenated([InMemory(p) for p in parts], dim).materialize()
    return Concatenated([as_lazy(p) for p in parts], dim)


def transpose(tensor: TensorLike, dim0: int, dim1: int) -> TensorLike:
    """Swap two dims: a contiguous tensor if ``tensor`` is one, else a lazy view."""
    if isinstance(tensor, torch.Tensor):
        return tensor.transpose(dim0, dim1).contiguous()
    return Transposed(tensor, dim0, dim1)


def shape_of(tensor: TensorLike) -> tuple[int, ...]:
    """The shape of a tensor or lazy tensor, as a tuple of ints."""
    return tuple(int(n) for n in tensor.shape)
