"""Rows read through the Hugging Face ``datasets`` library (the ``veomni-train[datasets]`` extra).

Each of these is one row file of a `veomni.train.data.sources.RowSource` (an `HFRows`: random access by row,
every row traceable to its path and row number):

- a ``save_to_disk`` directory (``dataset_info.json`` + ``state.json``; a ``DatasetDict`` directory is refused
  with its splits named: give the split's directory), read by ``datasets.load_from_disk``;
- an ``.arrow`` shard, read by ``datasets.Dataset.from_file`` (memory-mapped);
- a remote path, any fsspec URL (``s3://``, ``gs://``, ``hdfs://``, ``https://``, ``file://``, ``memory://``): a
  ``save_to_disk`` directory, or a ``.jsonl`` / ``.json`` / ``.parquet`` / ``.arrow`` file read by the matching
  ``datasets`` builder (downloaded and converted to Arrow once, in the ``datasets`` cache);
- ``data.dataset``: the arguments of ``datasets.load_dataset`` (local files by builder name, a local dataset
  directory or a Hub id); ``streaming: true`` there makes an ``IterableDataset``, read by
  `veomni.train.data.stream` instead.

Image, audio and video features are read undecoded: a row holds the file's bytes (or its path), which the
multimodal encoders decode as they do for jsonl rows. Rows are plain dicts, as the jsonl reader gives them.
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

from veomni.train.data.sources import DataError, RowRef

log = logging.getLogger(__name__)

REMOTE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
"""A remote file's extension -> the ``datasets`` builder that reads it."""


def datasets_module() -> Any:
    """``import datasets``, or a `DataError` naming the extra that installs it."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            "reading this data needs the Hugging Face datasets library: pip install 'veomni-train[datasets]'"
        ) from None
    return datasets


def is_url(path: str) -> bool:
    """Whether ``path`` is an fsspec URL (``scheme://...``) rather than a local path."""
    return "://" in path


def is_disk_dataset(path: str) -> bool:
    """Whether ``path`` (local or URL) is a directory written by ``save_to_disk`` (a dataset or a dataset dict)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(path)
    if fs.isfile(posixpath.join(root, "dataset_dict.json")):
        return True
    return fs.isfile(posixpath.join(root, "dataset_info.json")) and fs.isfile(
        posixpath.join(root, "state.json")
    )


class HFRows:
    """A ``datasets.Dataset`` as one row file: ``len``, ``read(row) -> dict`` and ``ref(row)`` (`RowRef` with
    ``path``). Only ``columns`` (required) and the ``optional`` columns the dataset has are read; absent optional
    ones read as None. Pickles as the dataset does (a memory-mapped table by its file path)."""

    def __init__(self, dataset: Any, path: str, columns: Sequence[str], optional: Sequence[str] = ()) -> None:
        names = list(dataset.column_names)
        missing = [c for c in columns if c not in names]
        if missing:
            raise DataError(f"{path}: missing column(s) {missing}; the dataset has {names}")
        keep = [*dict.fromkeys([*columns, *(c for c in optional if c in names)])]
        self.path = path
        self.absent = [c for c in optional if c not in names]
        self.dataset, self.media = _undecoded(dataset.select_columns(keep) if keep else dataset)

    def __len__(self) -> int:
        return len(self.dataset)

    def ref(self, row: int) -> RowRef:
        return RowRef(self.path, row)

    def read(self, row: int) -> dict[str, Any]:
        value = dict(self.dataset[row])
        for column in self.media:
            value[column] = _media_value(value[column])
        return {**value, **dict.fromkeys(self.absent)}


def _undecoded(dataset: Any) -> tuple[Any, list[str]]:
    """``dataset`` with its top-level image / audio / video columns (and lists of them) read undecoded, and the
    names of those columns: their values are ``{"bytes", "path"}`` dicts that `_media_value` turns into what a
    jsonl row gives."""
    datasets = datasets_module()
    media_types = tuple(
        getattr(datasets, name) for name in ("Image", "Audio", "Video") if hasattr(datasets, name)
    )
    columns = []
    for name, feature in dataset.features.items():
        inner = getattr(feature, "feature", None)
        if isinstance(feature, media_types) and getattr(feature, "decode", False):
            dataset = dataset.cast_column(name, type(feature)(decode=False))
        elif isinstance(inner, media_types) and getattr(inner, "decode", False):
            dataset = dataset.cast_column(name, type(feature)(type(inner)(decode=False)))
        elif not (isinstance(feature, media_types) or isinstance(inner, media_types)):
            continue
        columns.append(name)
    return dataset, columns


def _media_value(value: Any) -> Any:
    """An undecoded medium (``{"bytes", "path"}``) as its bytes, else its path; lists item by item."""
    if isinstance(value, list):
        return [_media_value(v) for v in value]
    if isinstance(value, Mapping) and ("bytes" in value or "path" in value):
        return value.get("bytes") or value.get("path")
    return value


def open_hf_file(path: str, kind: str, columns: Sequence[str], optional: Sequence[str] = ()) -> HFRows:
    """The `HFRows` of one data-file entry that `veomni.train.data.sources.detect_format` found to be ``kind``:
    ``hf_disk`` (a ``save_to_disk`` directory, local or remote), ``arrow`` (a local shard) or ``remote`` (a file
    URL, read by the builder of its extension)."""
    datasets = datasets_module()
    if kind == "hf_disk":
        loaded = _load(lambda: datasets.load_from_disk(path), path)
        if isinstance(loaded, datasets.DatasetDict):
            raise DataError(
                f"{path}: a DatasetDict with splits {list(loaded)}; name the split's directory, e.g. "
                f"{posixpath.join(path, next(iter(loaded)))}"
            )
        return HFRows(loaded, path, columns, optional)
    if kind == "arrow":
        return HFRows(_load(lambda: datasets.Dataset.from_file(path), path), path, columns, optional)
    import fsspec

    fs, root = fsspec.core.url_to_fs(path)
    if not fs.exists(root):
        raise DataError(f"{path}: no such file or directory")
    suffix = posixpath.splitext(path.lower())[1]
    if suffix not in REMOTE_BUILDERS:
        raise DataError(
            f"{path}: a remote path that is neither a save_to_disk directory nor a file with one of the extensions "
            f"{sorted(REMOTE_BUILDERS)}"
        )
    builder = REMOTE_BUILDERS[suffix]
    loaded = _load(lambda: datasets.load_dataset(builder, data_files=path, split="train"), path)
    return HFRows(loaded, path, columns, optional)


def _load(load: Any, what: str) -> Any:
    """``load()``, with the library's errors for a missing or unreadable dataset as one-line `DataError` s."""
    try:
        return load()
    except FileNotFoundError as err:
        raise DataError(f"{what}: no such dataset ({err})") from None
    except (ValueError, OSError) as err:
        raise DataError(f"{what}: not a readable dataset ({type(err).__name__}: {err})") from None


def load_dataset_spec(spec: Mapping[str, Any]) -> Any:
    """``datasets.load_dataset(**spec)`` (``data.dataset``): a ``Dataset``, or an ``IterableDataset`` with
    ``streaming: true``. Without ``split``, a result of one split is that split (logged); of several, an error
    naming them."""
    datasets = datasets_module()
    what = f"data.dataset {dict(spec)}"
    loaded = _load(lambda: datasets.load_dataset(**spec), what)
    if isinstance(loaded, datasets.DatasetDict | datasets.IterableDatasetDict):
        if len(loaded) != 1:
            raise DataError(
                f"{what}: the dataset has splits {list(loaded)}; choose one with data.dataset.split"
            )
        (split,) = loaded
        log.info("data.dataset: reading its one split, %r", split)
        loaded = loaded[split]
    return loaded


def describe_spec(spec: Mapping[str, Any]) -> str:
    """A short name of a ``data.dataset`` for row references: ``dataset <path>[/<name>][:<split>]``."""
    name = f"/{spec['name']}" if spec.get("name") else ""
    split = f":{spec['split']}" if spec.get("split") else ""
    return f"dataset {spec.get('path')}{name}{split}"
