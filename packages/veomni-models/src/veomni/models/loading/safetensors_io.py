"""Safetensors checkpoints on disk: resolving and reading (headers first, data by region) and streaming writes.

Reading: `CheckpointFiles` opens one file or a sharded index (``model.safetensors.index.json``, or diffusers'
``diffusion_pytorch_model.safetensors.index.json``), checks that each file is complete, reads only the
headers, and hands out `FileTensor`s; data is read when a region of one is asked for, and the bytes read
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
# The file name stems of a checkpoint's weights, as transformers and diffusers write them.
WEIGHT_PREFIXES = ("model", "diffusion_pytorch_model")

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


class CheckpointFileError(ValueError):
    """A checkpoint file is unreadable: a truncated or corrupt safetensors file, a malformed index."""


def _find_in_directory(p: Path) -> Path:
    # transformers' names first, then diffusers'; a directory holding both kinds is ambiguous.
    found = {
        prefix: [
            p / n for n in (f"{prefix}.safetensors", f"{prefix}.safetensors.index.json") if (p / n).is_file()
        ]
        for prefix in WEIGHT_PREFIXES
    }
    kinds = [prefix for prefix, files in found.items() if files]
    if len(kinds) > 1:
        both = sorted(f.name for files in found.values() for f in files)
        raise CheckpointFileError(
            f"{p} holds both a transformers and a diffusers checkpoint ({both}); pass the file or index to load"
        )
    if kinds:
        return found[kinds[0]][0]
    names = sorted(x.name for x in p.iterdir())
    hint = ""
    if any(n.endswith((".bin", ".pt", ".pth")) for n in names):
        hint = " (PyTorch pickle checkpoints are not read: convert them to safetensors first)"
    expected = [f"{prefix}.safetensors[.index.json]" for prefix in WEIGHT_PREFIXES]
    raise FileNotFoundError(f"no {' or '.join(expected)} in {p}{hint}; the directory holds {names[:20]}")


def _read_index(p: Path) -> dict[str, Path]:
    try:
        index = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointFileError(f"the checkpoint index {p} is not valid JSON ({err})") from None
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        found = sorted(index) if isinstance(index, dict) else type(index).__name__
        raise CheckpointFileError(
            f"the checkpoint index {p} has no 'weight_map' object (key -> shard file name); it holds {found}"
        )
    bad = [k for k, v in index["weight_map"].items() if not isinstance(v, str) or not v]
    if bad:
        raise CheckpointFileError(f"the checkpoint index {p}: 'weight_map' entries {bad[:8]} name no file")
    weight_map = {key: p.parent / name for key, name in index["weight_map"].items()}
    missing = sorted({f.name for f in weight_map.values() if not f.is_file()})
    if missing:
        raise FileNotFoundError(f"the checkpoint index {p} names shard files that do not exist: {missing}")
    return weight_map


def check_safetensors_file(path: Path) -> None:
    """Raise `CheckpointFileError` naming ``path`` unless its header parses and its data is all there.

    Reads the header only. safetensors itself reports a truncated file without naming it.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointFileError(f"{path} is truncated: {size} bytes, not even the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise CheckpointFileError(
                f"{path} is truncated: its header needs bytes 8..{8 + n}, the file has {size} bytes"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointFileError(
            f"{path} is not a safetensors file: its header is not JSON ({err})"
        ) from None
    if not isinstance(header, dict):
        raise CheckpointFileError(f"{path} is not a safetensors file: its header is not a JSON object")
    ends = [
        v["data_offsets"][1]
        for k, v in header.items()
        if k != "__metadata__" and isinstance(v, dict) and len(v.get("data_offsets", ())) == 2
    ]
    need = 8 + n + max(ends, default=0)
    if need > size:
        raise CheckpointFileError(
            f"{path} is truncated: its header describes {need} bytes of tensors, the file has {size} bytes"
        )


def resolve_checkpoint(path: str | os.PathLike) -> tuple[Path, list[Path], dict[str, Path] | None]:
    """Find the safetensors files of a checkpoint.

    Args:
        path: a ``.safetensors`` file, an index ``.json`` file, or a directory holding ``model.safetensors``
            or ``model.safetensors.index.json`` (checked in that order, as transformers does), or their
            diffusers counterparts ``diffusion_pytorch_model.safetensors[.index.json]``.
    Returns:
        ``(directory, files, weight_map)``; ``weight_map`` (key -> file) is None for a single file.
    Raises:
        FileNotFoundError: nothing to load, or an index naming shards that do not exist.
        CheckpointFileError: a malformed index (not JSON, no ``weight_map``).
    """
    p = Path(path)
    if p.is_dir():
        p = _find_in_directory(p)
    if not p.is_file():
        raise FileNotFoundError(f"checkpoint {p} does not exist")
    if p.suffix == ".safetensors":
        return p.parent, [p], None
    if p.suffix != ".json":
        raise ValueError(f"checkpoint {p}: expected a .safetensors file, an index .json or a directory")
    weight_map = _read_index(p)
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
                        raise CheckpointFileError(
                            f"the checkpoint index lists {absent[:8]} in {file}, which does not hold them"
                        )
                    # Keys the index leaves out are kept, as transformers reads every tensor of a shard: the
                    # accounting then loads or names them instead of dropping them unreported.
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
            check_safetensors_file(file)
            try:
                handle = safe_open(str(file), framework="pt", device="cpu")
            except Exception as err:  # noqa: BLE001 - safetensors' own errors do not name the file
                raise CheckpointFileError(f"{file} cannot be read as safetensors: {err}") from None
            self._handles[file] = self._stack.enter_context(handle)
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
