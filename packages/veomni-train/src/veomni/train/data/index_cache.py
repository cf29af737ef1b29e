"""An on-disk cache of the exact token index (``data.index_cache``): start-up and every resume tokenise the data
once, not each time.

The index (`veomni.train.data.plan.DatasetIndex`: per row its tokens, trained tokens, patches, the bad rows) is a
function of the rows, the tokenizer, the chat template and the data settings. The cache stores it under a key
that digests all of them (`index_key`); a change of any of them is another key, so a stale index is never read:

- **files**: per row file its path, size, modification time and a SHA-256 of its first and last MiB (of all of it
  when smaller), so an edited file is a miss without reading a whole corpus at every start (a warm start costs
  2 MiB per file); an HF dataset by the fingerprint ``datasets`` keeps for it;
- **tokenizer and template**: the serialised fast tokenizer (or the vocabulary), the special tokens, the chat
  template in use, and every ``.json`` / ``.jinja`` file of the tokenizer's directory (the processor configs of
  multimodal data among them);
- **settings**: the data section's fields that change what a row encodes to (kind, format, columns, fields, loss
  choices, length policy, bad-row policy, media settings), the encoder's class, and the versions of veomni-train,
  transformers and tokenizers.

With a process group, rank 0 reads the cache and broadcasts the index (ranks on other nodes need no shared
directory), and writes it (atomically) after a miss. Each row a worker reads is still checked against its indexed
length (`veomni.train.data.loader`), the last guard against a file changed in place with its size and time.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

from veomni.train.data.plan import BadRows, DatasetIndex

log = logging.getLogger(__name__)
CACHE_FORMAT = "veomni.train.data.index_cache/1"
EDGE = 2**20  # a file's first and last MiB are hashed (all of a file up to twice that)
SETTINGS = ("kind", "format", "columns", "file_format", "text_field", "messages_field", "loss_mask_field",
            "assistant_only_loss", "add_eos", "max_seq_len", "overlong", "on_bad_row", "max_bad_fraction",
            "media_root", "patches_per_micro_batch", "video_fps", "video_max_frames", "video_frame_pixels",
            "use_audio_in_video", "chat_template")  # fmt: skip
"""Data-section fields that change what the rows encode to (the rest, e.g. shuffle or num_workers, do not)."""


def file_digest(path: str) -> str:
    """Path, size, modification time and a SHA-256 of the content (its first and last `EDGE` bytes, or all of it)."""
    stat = os.stat(path)
    h = hashlib.sha256(f"{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    with open(path, "rb") as f:
        if stat.st_size <= 2 * EDGE:
            h.update(f.read())
        else:
            h.update(f.read(EDGE))
            f.seek(stat.st_size - EDGE)
            h.update(f.read(EDGE))
    return h.hexdigest()


def _row_file_digest(row_file: Any) -> str:
    """A row file's digest: an HF dataset's fingerprint, a local file's `file_digest`."""
    dataset = getattr(row_file, "dataset", None)
    if dataset is not None:
        return f"datasets:{dataset._fingerprint}:{len(dataset)}"
    return file_digest(row_file.path)


def tokenizer_digest(tokenizer: Any) -> str:
    """The tokenizer as it encodes: serialised model and vocabulary, special tokens, chat template, and the
    ``.json`` / ``.jinja`` files of its directory (processor configs too)."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps([str(t) for t in tokenizer.all_special_tokens]).encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    root = Path(str(getattr(tokenizer, "name_or_path", "")))
    if root.is_dir():
        for path in sorted([*root.glob("*.json"), *root.glob("*.jinja")]):
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def index_key(data: Any, source: Any, encoder: Any) -> str:
    """The cache key of ``source``'s index as ``encoder`` makes it under ``data``'s settings (module docstring)."""
    settings = {name: _plain(getattr(data, name, None)) for name in SETTINGS}
    parts = {
        "format": CACHE_FORMAT,
        "files": [_row_file_digest(f) for f in source.files],
        "tokenizer": tokenizer_digest(encoder.tokenizer),
        "settings": settings,
        "encoder": f"{type(encoder).__module__}.{type(encoder).__qualname__}",
        "versions": {p: _version(p) for p in ("veomni-train", "transformers", "tokenizers")},
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _save(path: Path, index: DatasetIndex) -> None:
    """Write ``index`` to ``path`` atomically (a temporary file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    examples = json.dumps([list(e) for e in index.bad.examples])
    with open(tmp, "wb") as f:
        np.savez(
            f, lengths=index.lengths, trained=index.trained, counts=np.asarray([index.truncated, index.dropped]),
            patches=np.zeros(0) if index.patches is None else index.patches, has_patches=index.patches is not None,
            bad_rows=index.bad.rows, bad_kinds=np.asarray(index.bad.kinds, dtype=str), bad_examples=examples,
        )  # fmt: skip
    os.replace(tmp, path)


def _load(path: Path) -> DatasetIndex:
    with np.load(path) as z:
        bad = BadRows(
            rows=z["bad_rows"].astype(np.int64),
            kinds=tuple(str(k) for k in z["bad_kinds"].tolist()),
            examples=tuple((int(r), str(m)) for r, m in json.loads(str(z["bad_examples"]))),
        )
        return DatasetIndex(
            lengths=z["lengths"], trained=z["trained"], truncated=int(z["counts"][0]), dropped=int(z["counts"][1]),
            patches=z["patches"] if bool(z["has_patches"]) else None, bad=bad,
        )  # fmt: skip


def cached_index(
    directory: str | None, key: str, what: str, group: dist.ProcessGroup | None
) -> tuple[DatasetIndex | None, Path | None]:
    """The cached index of ``key`` (read by rank 0 and broadcast to ``group``), or None on a miss; and the file
    a miss is stored to by `store_index` (None without a cache directory)."""
    if directory is None:
        return None, None
    path = Path(directory) / f"{key}.npz"
    rank0 = group is None or dist.get_rank(group) == 0
    found = None
    if rank0 and path.is_file():
        try:
            found = _load(path)
        except (OSError, ValueError, KeyError) as err:  # a damaged file is a miss, rewritten after indexing
            log.warning("%s: the cached index %s is unreadable (%s); indexing again", what, path, err)
    if group is not None:
        box = [found]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        found = box[0]
    if found is not None and rank0:
        log.info("%s: token index read from the cache %s (%d rows)", what, path, found.num_rows)
    return found, path


def store_index(path: Path | None, index: DatasetIndex, group: dist.ProcessGroup | None, what: str) -> None:
    """Rank 0 writes a freshly built ``index`` to ``path`` (no-op without a cache)."""
    if path is None or (group is not None and dist.get_rank(group) != 0):
        return
    _save(path, index)
    log.info("%s: token index written to the cache %s", what, path)
