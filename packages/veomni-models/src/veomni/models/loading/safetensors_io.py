"""Safetensors checkpoints on disk: resolving and reading (headers first, data by region) and streaming writes.

Reading: `CheckpointFiles` opens one file or a sharded index (``model.safetensors.index.json``), reads only
the headers, and hands out `FileTensor`s; data is read when a region of one is asked for, and the bytes read
are counted. Writing: `SafetensorsStreamWriter` writes a file whose header is planned up front (names, shapes,
dtypes), so tensors can be written one by one and dropped; nothing but the current tensor is held in memory.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from veomni.models.loading.lazy import FileTensor

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_INDEX_NAME = "model.safetensors.index.json"

# safetensors' dtype names (the header's "dtype" field) and torch's.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def resolve_checkpoint(path: str | os.PathLike) -> tuple[Path, list[Path], dict[str, Path] | None]:
    """Find the safetensors files of a checkpoint.

    Args:
        path: a ``.safetensors`` file, an index ``.json`` file, or a directory holding ``model.safetensors``
            or ``model.safetensors.index.json`` (checked in that order, as transformers does).
    Returns:
        ``(directory, files, weight_map)``; ``weight_map`` (key -> file) is None for a single file.
    """
    p = Path(path)
    if p.is_dir():
        if (p / SAFE_WEIGHTS_NAME).is_file():
            return p, [p / SAFE_WEIGHTS_NAME], None
        if (p / SAFE_INDEX_NAME).is_file():
            p = p / SAFE_INDEX_NAME
        else:
            found = sorted(x.name for x in p.iterdir())
            hint = ""
            if any(n.endswith((".bin", ".pt", ".pth")) for n in found):
                hint = " (PyTorch pickle checkpoints are not read: convert them to safetensors first)"
            raise FileNotFoundError(
                f"no {SAFE_WEIGHTS_NAME} or {SAFE_INDEX_NAME} in {p}{hint}; the directory holds {found[:20]}"
            )
    if not p.is_file():
        raise FileNotFoundError(f"checkpoint {p} does not exist")
    if p.suffix == ".safetensors":
        return p.parent, [p], None
    if p.suffix != ".json":
        raise ValueError(f"checkpoint {p}: expected a .safetensors file, an index .json or a directory")
    index = json.loads(p.read_text())
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise ValueError(f"{p} is not a safetensors index: it has no 'weight_map' object")
    weight_map = {key: p.parent / name for key, name in index["weight_map"].items()}
    missing = sorted({str(f) for f in weight_map.values() if not f.is_file()})
    if missing:
        raise FileNotFoundError(f"{p} names shard files that do not exist: {missing}")
    return p.parent, sorted(set(weight_map.values())), weight_map


class CheckpointFiles(contextlib.AbstractContextManager):
    """The tensors of a safetensors checkpoint, by key. Opening reads headers only.

    Attributes:
        directory: where the checkpoint lives (its ``config.json``, if any, is next to the weights).
        tensors: ``{key: FileTensor}`` in file order.
        bytes_read: tensor bytes read from disk so far (headers not counted).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.directory, files, weight_map = resolve_checkpoint(path)
        self.bytes_read = 0
        self._stack = contextlib.ExitStack()
        self._handles: dict[Path, object] = {}
        self.tensors: dict[str, FileTensor] = {}
        try:
            for file in files:
                handle = self._open(file)
                keys = list(handle.keys())  # type: ignore[attr-defined]
                if weight_map is not None:
                    listed = {k for k, f in weight_map.items() if f == file}
                    absent = sorted(listed - set(keys))
                    if absent:
                        raise ValueError(
                            f"the index lists {absent[:8]} in {file.name}, which does not hold them"
                        )
                    keys = [k for k in keys if k in listed]
                for key in keys:
                    if key in self.tensors:
                        raise ValueError(f"checkpoint key {key!r} appears in more than one file")
                    sl = handle.get_slice(key)  # type: ignore[attr-defined]
                    dtype_name = sl.get_dtype()
                    if dtype_name not in DTYPES:
                        raise ValueError(
                            f"{file.name}: {key} has dtype {dtype_name}, not one of {sorted(DTYPES)}"
                        )
                    self.tensors[key] = FileTensor(
                        key,
                        sl.get_shape(),
                        DTYPES[dtype_name],
                        handle=lambda h=handle: h,
                        on_read=self._count,
                    )
        except BaseException:
            self.close()
            raise

    def _open(self, file: Path) -> object:
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(
                safe_open(str(file), framework="pt", device="cpu")
            )
        return self._handles[file]

    def _count(self, nbytes: int) -> None:
        self.bytes_read += nbytes

    def config(self) -> dict | None:
        """The ``config.json`` next to the weights, or None."""
        cfg = self.directory / "config.json"
        return json.loads(cfg.read_text()) if cfg.is_file() else None

    def close(self) -> None:
        """Release the open files."""
        self._stack.close()
        self._handles.clear()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty((), dtype=dtype).element_size()


class SafetensorsStreamWriter:
    """Write one safetensors file tensor by tensor, in the order its header was planned.

    ``entries`` is ``[(name, shape, dtype), ...]``; `write` must then be called once per entry, in that order,
    with a tensor of exactly that shape and dtype. The header is written first (so each tensor can be dropped
    as soon as it is on disk) and `close` checks that every entry arrived.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        entries: Sequence[tuple[str, Sequence[int], torch.dtype]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        self._expected: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        for name, shape, dtype in entries:
            if dtype not in DTYPE_NAMES:
                raise ValueError(f"{name}: dtype {dtype} cannot be stored in safetensors")
            if name in header:
                raise ValueError(f"tensor name {name!r} planned twice")
            size = _nbytes(shape, dtype)
            header[name] = {
                "dtype": DTYPE_NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
            self._expected.append((name, tuple(int(d) for d in shape), dtype))
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors pads the header so the data starts 8-byte aligned
        self.total_bytes = offset
        self._file = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._file.write(struct.pack("<Q", len(raw)))
        self._file.write(raw)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next planned tensor (any device; it is copied to CPU for writing)."""
        if self._next >= len(self._expected):
            raise ValueError(f"{name}: every planned tensor was already written")
        want_name, want_shape, want_dtype = self._expected[self._next]
        if (name, tuple(tensor.shape), tensor.dtype) != (want_name, want_shape, want_dtype):
            raise ValueError(
                f"expected {want_name} {list(want_shape)} {want_dtype} next, got {name} "
                f"{list(tensor.shape)} {tensor.dtype}"
            )
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._file.write(data.numpy().data)
        self._next += 1

    def close(self) -> None:
        """Finish the file; raises if planned tensors were not written."""
        self._file.close()
        if self._next != len(self._expected):
            left = [n for n, _, _ in self._expected[self._next :]]
            raise ValueError(
                f"safetensors file closed with {len(left)} planned tensors unwritten: {left[:6]}"
            )
