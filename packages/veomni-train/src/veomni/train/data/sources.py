"""Row sources: random access to the rows of jsonl and parquet files, each row traceable to its file and row.

A `RowSource` concatenates its files into one index space ``0 .. len - 1``. Rows are read on demand: jsonl files
are indexed once (the byte offset of every non-blank line) and read with a seek; parquet files load only the
columns a row needs, once per process. HF ``datasets`` data (``save_to_disk`` directories, ``.arrow`` shards,
remote URLs, ``data.dataset``) is read through that library (`veomni.train.data.hf_sources`). Objects pickle
without their open handles, so DataLoader workers can receive them under any start method.
"""

from __future__ import annotations

import bisect
import glob
import json
import os
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np


class DataError(ValueError):
    """Bad input data: the message names the file and the row (or line).

    A DataError raised in a DataLoader worker comes back to the main process as the original one-line message:
    torch rebuilds the exception in the main process from ``"Caught DataError in DataLoader worker process N.
    Original Traceback ...: <message>"``, and the constructor takes the original message back out of that (the
    worker's traceback says nothing the message does not: file and row are in it).
    """

    def __init__(self, message: str = "") -> None:
        super().__init__(_worker_message(message, type(self)))


def _worker_message(message: str, cls: type) -> str:
    """The original message of a ``cls`` error that torch's ``ExceptionWrapper.reraise`` wrapped in its worker
    traceback (the text after the traceback's last ``module.Class: ``); any other message as it is."""
    if not (
        isinstance(message, str) and message.startswith(f"Caught {cls.__name__} in DataLoader worker process")
    ):
        return message
    marker = f"\n{cls.__module__}.{cls.__qualname__}: "
    at = message.rfind(marker)
    return message if at < 0 else message[at + len(marker) :].rstrip("\n")


class OverlongError(DataError):
    """A row longer than ``data.max_seq_len`` under a length policy that refuses it. ``data.overlong`` decides what
    happens to such rows, so they are never bad rows that ``data.on_bad_row: skip`` leaves out."""


# How a bad row is reported under ``data.on_bad_row: skip``: the first kind whose marker the error message holds.
# The markers are the stable parts of the messages the readers and encoders raise (tests/train/test_bad_rows.py
# checks each kind), so a reworded message shows up as "malformed row", never as a lost row.
BAD_ROW_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("unreadable row", ("not valid JSON", "expected a JSON object")),
    ("missing image file", ("no such image file",)),
    ("missing audio file", ("no such audio file",)),
    ("non-finite media values", ("are not finite (NaN or Inf)",)),
    (
        "unreadable image",
        ("not a readable image", "corrupt or truncated", "the image is empty", "image processor"),
    ),
    (
        "placeholder/image count mismatch",
        ("placeholder(s) in the rendered conversation", "placeholder(s) or payload-free"),
    ),
    ("media in text data", ("but data.kind is conversation",)),
    ("image over the patch budget", ("data.patches_per_micro_batch",)),
    ("empty row", ("produced no tokens", "rendered to no tokens")),
    ("chat template failure", ("the chat template failed", "not prefix-stable")),
)


def bad_row_kind(message: str) -> str:
    """The report kind of a bad row's `DataError` message (`BAD_ROW_KINDS`; ``malformed row`` otherwise)."""
    for kind, markers in BAD_ROW_KINDS:
        if any(marker in message for marker in markers):
            return kind
    return "malformed row"


@attrs.frozen
class RowRef:
    """Where a row comes from. ``row`` is 0-based within the file; ``line`` is the 1-based jsonl line."""

    file: str
    row: int
    line: int | None = None

    def __str__(self) -> str:
        if self.line is not None:
            return f"{self.file} line {self.line}"
        return f"{self.file} row {self.row} (0-based)"


DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")
FILE_FORMATS = ("jsonl", "parquet", "arrow")


def expand_data_files(entries: Sequence[str]) -> list[str]:
    """Each entry as the files it names, in order: a file itself; a glob (``data/*.jsonl``, ``**`` recursive) its
    matches, sorted; a ``save_to_disk`` directory or a URL itself; another directory its ``.jsonl`` / ``.json`` /
    ``.parquet`` / ``.arrow`` files (not recursive), sorted. A pattern or directory naming no data file is an error
    (a typo must not shrink the dataset silently)."""
    from veomni.train.data.hf_sources import is_disk_dataset, is_url

    out: list[str] = []
    for entry in entries:
        if is_url(entry) or (os.path.isdir(entry) and is_disk_dataset(entry)):
            out.append(entry)
        elif any(c in entry for c in "*?["):
            matches = sorted(p for p in glob.glob(entry, recursive=True) if os.path.isfile(p))
            if not matches:
                raise DataError(f"{entry}: the pattern matches no file")
            out += matches
        elif os.path.isdir(entry):
            names = sorted(os.listdir(entry))
            found = [os.path.join(entry, n) for n in names if n.lower().endswith(DATA_SUFFIXES)]
            if not found:
                raise DataError(
                    f"{entry}: a directory with no {', '.join(DATA_SUFFIXES)} file and not a save_to_disk dataset; it "
                    f"holds {names[:10]}"
                )
            out += found
        else:
            out.append(entry)
    return out


def detect_format(path: str, format: str) -> str:
    """How ``path`` is read: ``hf_disk`` (a ``save_to_disk`` directory, local or URL), ``remote`` (another URL,
    by its extension), else ``format`` itself, or by extension when it is ``auto`` (``jsonl``, ``parquet``,
    ``arrow``)."""
    from veomni.train.data.hf_sources import is_disk_dataset, is_url

    if format not in ("auto", *FILE_FORMATS):
        raise DataError(f"data file format must be auto, {', '.join(FILE_FORMATS)}; found {format!r}")
    if is_url(path):
        return "hf_disk" if is_disk_dataset(path) else "remote"
    if os.path.isdir(path) and is_disk_dataset(path):
        return "hf_disk"
    if format != "auto":
        return format
    lower = path.lower()
    if lower.endswith((".jsonl", ".json")):
        return "jsonl"
    if lower.endswith(".parquet"):
        return "parquet"
    if lower.endswith(".arrow"):
        return "arrow"
    raise DataError(
        f"{path}: cannot tell the format from the extension (expected .jsonl, .json, .parquet or .arrow, or a "
        "save_to_disk directory); set data.file_format"
    )


class JsonlFile:
    """One JSON object per line; blank lines are skipped (they are not rows)."""

    def __init__(self, path: str) -> None:
        if not os.path.isfile(path):
            raise DataError(f"{path}: no such data file")
        _check_text_file(path)
        self.path = path
        offsets, lines = [], []
        with open(path, "rb") as f:
            pos = 0
            for number, raw in enumerate(f, start=1):
                if raw.strip():
                    offsets.append(pos)
                    lines.append(number)
                pos += len(raw)
        self._offsets = np.asarray(offsets, dtype=np.int64)
        self._lines = np.asarray(lines, dtype=np.int64)
        self._handle: Any = None
        self._pid = -1

    def __len__(self) -> int:
        return len(self._offsets)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handle": None, "_pid": -1}

    def ref(self, row: int) -> RowRef:
        return RowRef(self.path, row, int(self._lines[row]))

    def read(self, row: int) -> dict[str, Any]:
        # A handle opened before a fork would share its file position with the children; reopen per process.
        if self._handle is None or self._pid != os.getpid():
            self._handle = open(self.path, "rb")  # noqa: SIM115 - kept open for the life of the reader
            self._pid = os.getpid()
        self._handle.seek(int(self._offsets[row]))
        raw = self._handle.readline()
        try:
            value = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise DataError(f"{self.ref(row)}: not valid JSON ({err})") from None
        if not isinstance(value, dict):
            raise DataError(f"{self.ref(row)}: expected a JSON object, found {type(value).__name__}")
        return value


def _check_text_file(path: str) -> None:
    """Refuse a binary file read as jsonl as a whole, before its first line is taken for a bad row."""
    with open(path, "rb") as f:
        head = f.read(4096)
    if head.startswith(b"PAR1"):
        found = "a parquet file (it starts with parquet's magic bytes PAR1)"
    elif b"\0" in head:
        found = "binary data (NUL bytes in its first 4 KiB)"
    else:
        try:
            head.decode("utf-8")
            return
        except UnicodeDecodeError as err:
            if err.start >= len(head) - 3:  # a multi-byte character cut by the 4 KiB window
                return
            found = f"bytes that are not UTF-8 text (offset {err.start})"
    raise DataError(
        f"{path}: read as jsonl (data.file_format), but the file holds {found}; set data.file_format: auto to decide by "
        "extension, or the format the file really has"
    )


class ParquetFile:
    """A parquet file read column-wise: only ``columns`` are loaded, once per process, when first needed.
    ``optional`` columns are loaded where the file has them and read as None where it does not."""

    def __init__(self, path: str, columns: Sequence[str], optional: Sequence[str] = ()) -> None:
        import pyarrow.parquet as pq

        if not os.path.isfile(path):
            raise DataError(f"{path}: no such data file")
        self.path = path
        self.columns = list(columns)
        try:
            meta = pq.ParquetFile(path)
        except Exception as err:  # pyarrow raises several types for unreadable files
            raise DataError(f"{path}: not a readable parquet file ({err})") from None
        names = meta.schema_arrow.names
        missing = [c for c in self.columns if c not in names]
        if missing:
            raise DataError(f"{path}: missing column(s) {missing}; the file has {names}")
        self.columns += [c for c in optional if c in names and c not in self.columns]
        self.absent = [c for c in optional if c not in names]
        self._num_rows = meta.metadata.num_rows
        self._table: Any = None

    def __len__(self) -> int:
        return self._num_rows

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_table": None, "_json": {}}

    def ref(self, row: int) -> RowRef:
        return RowRef(self.path, row)

    def read(self, row: int) -> dict[str, Any]:
        if self._table is None:
            import pyarrow.parquet as pq

            self._table = pq.read_table(self.path, columns=self.columns)
            self._json = {c: _has_json(self._table.schema.field(c).type) for c in self.columns}
        values = {}
        for c in self.columns:
            value = self._table.column(c)[row].as_py()
            values[c] = _decode_json(value, self._table.schema.field(c).type) if self._json[c] else value
        return {**values, **dict.fromkeys(self.absent)}


def _has_json(arrow_type: Any) -> bool:
    """Whether a column type holds arrow's JSON extension type anywhere (HF ``datasets`` writes mixed-shape
    objects, e.g. messages of which only some have a loss mask, that way)."""
    if getattr(arrow_type, "extension_name", None) == "arrow.json":
        return True
    return any(_has_json(arrow_type.field(i).type) for i in range(arrow_type.num_fields))


def _decode_json(value: Any, arrow_type: Any) -> Any:
    """``value`` (``as_py`` of a ``arrow_type`` value) with its JSON-extension strings parsed, as the JSON they are."""
    if value is None:
        return None
    if getattr(arrow_type, "extension_name", None) == "arrow.json":
        return json.loads(value) if isinstance(value, str) else value
    if isinstance(value, list) and hasattr(arrow_type, "value_type"):
        return [_decode_json(v, arrow_type.value_type) for v in value]
    if isinstance(value, dict) and arrow_type.num_fields:
        fields = {arrow_type.field(i).name: arrow_type.field(i).type for i in range(arrow_type.num_fields)}
        return {k: _decode_json(v, fields[k]) if k in fields else v for k, v in value.items()}
    return value


class RowSource:
    """Rows of several files as one sequence; ``source[i]`` is a dict, ``source.ref(i)`` says where it is from.

    Args:
        files: paths, read in this order.
        format: ``auto``, ``jsonl`` or ``parquet`` (`detect_format`).
        columns: the fields a row must provide (parquet loads only these; jsonl rows are checked when encoded).
        optional: fields a parquet file may lack (read as None there), e.g. DiT's ``video`` / ``image``, one of
            which each row gives.
    """

    def __init__(
        self, files: Sequence[str], format: str, columns: Sequence[str], optional: Sequence[str] = ()
    ) -> None:
        if not files:
            raise DataError("no data files given")
        opened: list[Any] = []
        for path in expand_data_files(files):
            kind = detect_format(path, format)
            if kind == "jsonl":
                opened.append(JsonlFile(path))
            elif kind == "parquet":
                opened.append(ParquetFile(path, columns, optional))
            else:
                from veomni.train.data.hf_sources import open_hf_file

                opened.append(open_hf_file(path, kind, columns, optional))
        self._open(opened, list(files))

    @classmethod
    def of(cls, files: Sequence[Any], what: str) -> RowSource:
        """A source over row files opened already (each with ``len``, ``read``, ``ref`` and ``path``, e.g. an
        `veomni.train.data.hf_sources.HFRows`); ``what`` names them in errors."""
        source = cls.__new__(cls)
        source._open(list(files), [what])
        return source

    def _open(self, files: list[Any], described: list[str]) -> None:
        self.files: list[Any] = files
        self._starts = np.cumsum([0] + [len(f) for f in self.files]).tolist()
        if self._starts[-1] == 0:
            raise DataError(f"the data files hold no rows: {described}")

    def __len__(self) -> int:
        return self._starts[-1]

    def _locate(self, index: int) -> tuple[Any, int]:
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} is out of range for {len(self)} rows")
        file_no = bisect.bisect_right(self._starts, index) - 1
        return self.files[file_no], index - self._starts[file_no]

    def __getitem__(self, index: int) -> dict[str, Any]:
        file, row = self._locate(index)
        return file.read(row)

    def ref(self, index: int) -> RowRef:
        """Where row ``index`` lives (file and row/line)."""
        file, row = self._locate(index)
        return file.ref(row)
