"""The exact token index of a dataset and the deterministic plan of micro-batches built from it.

`index_dataset` tokenises every row once (in DataLoader workers, and split over the ranks of a process group when
one is given) and keeps two numbers per row: its token count after the over-length policy and its trained-token
count. Everything else is arithmetic on those arrays, identical on every rank with no communication:

* `epoch_micro_batches`: the epoch's sample order (a seeded shuffle of the kept rows, by ``(seed, epoch)``), cut
  into micro-batches of at most ``budget`` tokens by first-fit over a few open micro-batches. The result does not
  depend on the number of ranks.
* Dealing (`rank_schedule`): step k of an epoch takes the next ``per_step = grad_accum * dp`` micro-batches;
  micro-step g on DP rank r is micro-batch ``cursor + k * per_step + g * dp + r``. The epoch's last
  ``M mod per_step`` micro-batches (fewer than one step) are left out; the next epoch reshuffles everything.

Because the micro-batches are a property of the data and not of the world size, and ``per_step`` equals
``tokens_per_step / tokens_per_micro_batch`` (independent of dp), a run resumed on another DP size continues at the
same micro-batch and sees the same steps: the same samples per step, spread over different ranks.

Bad rows (a row the reader or encoder rejects with a `DataError`: invalid JSON, a missing or unreadable image, a
placeholder/image mismatch, ...) are found here, where every row is read once. With ``on_bad_row="error"`` the
first one (lowest row) is raised on every rank after the counts are gathered, so no rank is left waiting in the
gather. With ``"skip"`` they get length 0 and are recorded in `BadRows`: a function of the data alone, identical
on every rank, so no plan ever holds one; more than ``max_bad_fraction`` of the rows, or all of them, is an error.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterator

import attrs
import numpy as np
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from veomni.train.data.encode import Encoder, encode_row
from veomni.train.data.sources import DataError, OverlongError, RowSource, bad_row_kind

INDEX_CHUNK = 256
OPEN_BINS = 8
EXAMPLES = 3  # bad rows named per kind in reports
OVERLONG = "over-long"  # an `OverlongError`: data.overlong's business, raised in every mode, never skipped


@attrs.frozen(eq=False)
class BadRows:
    """Rows that failed to read or encode when the data was indexed, left out under ``on_bad_row="skip"``.

    Attributes:
        rows: int64 ``[k]``, the bad rows' indices in their `RowSource`, ascending.
        kinds: the report kind of each (`veomni.train.data.sources.bad_row_kind`), aligned with ``rows``.
        examples: ``(row, message)`` of the first `EXAMPLES` rows of each kind; the messages name file and row.
    """

    rows: np.ndarray = attrs.field(factory=lambda: np.zeros(0, dtype=np.int64))
    kinds: tuple[str, ...] = ()
    examples: tuple[tuple[int, str], ...] = ()

    def __len__(self) -> int:
        return len(self.rows)

    def counts(self) -> dict[str, int]:
        """Bad rows per kind, most frequent first."""
        return dict(Counter(self.kinds).most_common())

    def first_message(self) -> str:
        """The error of the lowest bad row."""
        return min(self.examples)[1]

    def report(self) -> list[str]:
        """One line per kind: the count and the first rows' errors."""
        lines = []
        for kind, count in self.counts().items():
            named = [
                m for row, m in self.examples if self.kinds[int(np.searchsorted(self.rows, row))] == kind
            ]
            more = f"; and {count - len(named)} more" if count > len(named) else ""
            lines.append(f"{count} x {kind}: " + "; ".join(named) + more)
        return lines


@attrs.frozen(eq=False)
class DatasetIndex:
    """Per-row token counts of a dataset, exact (from tokenising every row).

    Attributes:
        lengths: int64 ``[rows]``, tokens of each row after the over-length policy; 0 for a dropped row.
        trained: int64 ``[rows]``, trained tokens (valid labels) of each row.
        truncated: rows cut to ``max_seq_len``.
        dropped: rows left out for being longer than ``max_seq_len``.
        patches: int64 ``[rows]``, vision patches of each row (multimodal data; None for text).
        bad: the bad rows left out (``on_bad_row="skip"``; empty otherwise); their lengths are 0.
    """

    lengths: np.ndarray
    trained: np.ndarray
    truncated: int
    dropped: int
    patches: np.ndarray | None = None
    bad: BadRows = attrs.field(factory=BadRows)

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    @property
    def num_samples(self) -> int:
        """Rows that take part in training (not dropped)."""
        return int((self.lengths > 0).sum())

    @property
    def total_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def total_trained_tokens(self) -> int:
        return int(self.trained.sum())

    def digest(self) -> str:
        """A fingerprint of the token counts (changes when the data, tokenizer or length policy do)."""
        h = hashlib.sha256(self.lengths.astype(np.int64).tobytes())
        h.update(self.trained.astype(np.int64).tobytes())
        if self.patches is not None:
            h.update(self.patches.astype(np.int64).tobytes())
        if len(self.bad):  # only then, so that data without bad rows keeps the digest it always had
            h.update(b"bad" + self.bad.rows.astype(np.int64).tobytes())
        return h.hexdigest()[:16]


def _measure(
    source: RowSource, encoder: Encoder, row: int, max_seq_len: int, overlong: str
) -> tuple[int, int, int]:
    """``(tokens, trained, patches)`` of a multimodal row from its image headers, after the length policy."""
    ref = source.ref(row)
    length, trained, patches = encoder.measure(source[row], ref)
    if length <= max_seq_len:
        return length, trained, patches
    if overlong == "drop":
        return 0, 0, 0
    raise OverlongError(
        f"{ref}: {length} tokens, longer than data.max_seq_len={max_seq_len}"
        + (
            ""
            if overlong == "error"
            else "; a multimodal row cannot be truncated: set data.overlong to drop or error"
        )
    )


class _IndexChunks(Dataset):
    def __init__(
        self,
        source: RowSource,
        encoder: Encoder,
        max_seq_len: int,
        overlong: str,
        starts: list[int],
        size: int,
        skip: bool,
    ) -> None:
        self.source, self.encoder, self.max_seq_len, self.overlong = source, encoder, max_seq_len, overlong
        self.starts, self.size, self.skip = starts, size, skip

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray, list]:
        """``(start, lengths, trained, truncated, patches, bad)``; ``bad`` lists ``(row, kind, message)`` with
        the message kept for the first `EXAMPLES` rows of each kind only (None after), so that a mostly bad
        dataset does not ship every message through the gather. The chunk stops at its first over-long row
        (`OVERLONG`), and without ``skip`` at its first bad row."""
        start = self.starts[i]
        stop = min(start + self.size, len(self.source))
        lengths = np.zeros(stop - start, dtype=np.int64)
        trained = np.zeros(stop - start, dtype=np.int64)
        truncated = np.zeros(stop - start, dtype=bool)
        patches = np.zeros(stop - start, dtype=np.int64)
        bad: list[tuple[int, str, str | None]] = []
        seen: Counter[str] = Counter()
        for k, row in enumerate(range(start, stop)):
            try:
                # Multimodal rows are measured from image headers, no pixel decoded.
                if hasattr(self.encoder, "measure"):
                    lengths[k], trained[k], patches[k] = _measure(
                        self.source, self.encoder, row, self.max_seq_len, self.overlong
                    )
                    continue
                sample = encode_row(self.source, self.encoder, row, self.max_seq_len, self.overlong)
            except DataError as err:
                # Returned, not raised: a rank that raised here would leave its peers waiting in the gather.
                kind = OVERLONG if isinstance(err, OverlongError) else bad_row_kind(str(err))
                seen[kind] += 1
                bad.append((row, kind, str(err) if seen[kind] <= EXAMPLES else None))
                lengths[k] = trained[k] = patches[k] = 0
                if kind == OVERLONG or not self.skip:
                    break
                continue
            if sample is not None:
                lengths[k], trained[k], truncated[k] = (
                    len(sample.input_ids),
                    sample.num_trained,
                    sample.truncated,
                )
        return start, lengths, trained, truncated, patches, bad


def _identity(x: object) -> object:
    return x


def index_dataset(
    source: RowSource,
    encoder: Encoder,
    *,
    max_seq_len: int,
    overlong: str,
    num_workers: int = 0,
    group: dist.ProcessGroup | None = None,
    chunk_rows: int = INDEX_CHUNK,
    on_bad_row: str = "error",
    max_bad_fraction: float = 0.01,
) -> DatasetIndex:
    """Tokenise every row once and return the exact `DatasetIndex` (bad rows: the module docstring).

    Args:
        num_workers: DataLoader workers for the tokenisation (0: in this process).
        group: when given, each of its ranks tokenises a share of the rows and the counts are all-gathered
            (``all_gather_object``; for NCCL the current CUDA device must be set). Every rank must call this.
        chunk_rows: rows per work item (the unit split over workers and ranks).
        on_bad_row: ``error`` (the lowest bad row raises `DataError`) or ``skip`` (left out, in ``index.bad``).
        max_bad_fraction: with ``skip``, more bad rows than this fraction of all rows is a `DataError`.

    Raises:
        DataError: a bad row (``error``), too many bad rows (``skip``), an over-long row ``overlong`` refuses, or
            no row left; raised on every rank of ``group`` alike.
    """
    if on_bad_row not in ("error", "skip"):
        raise DataError(f"data.on_bad_row must be error or skip, found {on_bad_row!r}")
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    starts = list(range(0, len(source), chunk_rows))[rank::world]
    loader = DataLoader(
        _IndexChunks(source, encoder, max_seq_len, overlong, starts, chunk_rows, on_bad_row == "skip"),
        batch_size=None,
        num_workers=num_workers,
        collate_fn=_identity,
    )
    parts = []
    for part in loader:
        parts.append(part)
        if any(kind == OVERLONG or on_bad_row == "error" for _, kind, _ in part[5]):
            break  # an error follows; the rest of this rank's rows cannot change which (the lowest row wins)
    if group is not None:
        gathered: list[list | None] = [None] * world
        dist.all_gather_object(gathered, parts, group=group)
        parts = [p for rank_parts in gathered for p in (rank_parts or [])]
    lengths = np.zeros(len(source), dtype=np.int64)
    trained = np.zeros(len(source), dtype=np.int64)
    truncated = np.zeros(len(source), dtype=bool)
    patches = np.zeros(len(source), dtype=np.int64)
    found: list[tuple[int, str, str | None]] = []
    for start, chunk_lengths, chunk_trained, chunk_truncated, chunk_patches, chunk_bad in parts:
        stop = start + len(chunk_lengths)
        lengths[start:stop], trained[start:stop], truncated[start:stop], patches[start:stop] = (
            chunk_lengths,
            chunk_trained,
            chunk_truncated,
            chunk_patches,
        )
        found.extend(chunk_bad)
    found.sort(key=lambda entry: entry[0])
    stops = [entry for entry in found if entry[1] == OVERLONG or on_bad_row == "error"]
    if stops:
        row, kind, message = stops[0]
        hint = "" if kind == OVERLONG else " (data.on_bad_row: skip leaves bad rows out and counts them)"
        raise (OverlongError if kind == OVERLONG else DataError)(f"{message}{hint}")
    bad = _bad_rows(found)
    _check_bad_fraction(bad, len(source), max_bad_fraction)
    dropped = int((lengths == 0).sum()) - len(bad)
    if dropped + len(bad) == len(source):
        raise DataError(
            f"every one of the {len(source)} rows was left out: {dropped} longer than max_seq_len={max_seq_len}, "
            f"{len(bad)} bad"
        )
    return DatasetIndex(
        lengths=lengths,
        trained=trained,
        truncated=int(truncated.sum()),
        dropped=dropped,
        patches=patches if hasattr(encoder, "measure") else None,
        bad=bad,
    )


def _bad_rows(found: list[tuple[int, str, str | None]]) -> BadRows:
    """`BadRows` from the chunks' ``(row, kind, message)`` entries, sorted by row."""
    per_kind: Counter[str] = Counter()
    examples = []
    for row, kind, message in found:
        per_kind[kind] += 1
        if per_kind[kind] <= EXAMPLES:
            # The first rows of a kind overall are among the first of their chunk, which kept the message.
            assert message is not None
            examples.append((row, message))
    return BadRows(
        rows=np.asarray([row for row, _, _ in found], dtype=np.int64),
        kinds=tuple(kind for _, kind, _ in found),
        examples=tuple(examples),
    )


def _check_bad_fraction(bad: BadRows, num_rows: int, max_bad_fraction: float) -> None:
    """Skipping is for the odd broken row: all rows bad, or more than the bound, is a `DataError`."""
    if not len(bad):
        return
    report = "\n  ".join(bad.report())
    if len(bad) == num_rows:
        raise DataError(f"every one of the {num_rows} rows is bad:\n  {report}")
    if len(bad) > max_bad_fraction * num_rows:
        raise DataError(
            f"{len(bad)} of {num_rows} rows ({len(bad) / num_rows:.2%}) are bad, more than "
            f"data.max_bad_fraction={max_bad_fraction}; fix the data or raise the bound:\n  {report}"
        )


@attrs.frozen(eq=False)
class MicroBatches:
    """An epoch's micro-batches in CSR form: micro-batch j holds rows ``rows[offsets[j]:offsets[j + 1]]``."""

    rows: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, j: int) -> np.ndarray:
        return self.rows[self.offsets[j] : self.offsets[j + 1]]

    def digest(self) -> str:
        h = hashlib.sha256(self.rows.astype(np.int64).tobytes())
        h.update(self.offsets.astype(np.int64).tobytes())
        return h.hexdigest()[:16]


def epoch_order(index: DatasetIndex, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The kept rows of ``index`` in epoch ``epoch``'s order (int64; a permutation seeded by (seed, epoch))."""
    kept = np.flatnonzero(index.lengths > 0)
    if not shuffle:
        return kept
    rng = np.random.Generator(np.random.PCG64([seed, epoch]))
    return kept[rng.permutation(len(kept))]


def pack_rows(
    order: np.ndarray,
    lengths: np.ndarray,
    budget: int,
    open_bins: int = OPEN_BINS,
    *,
    patches: np.ndarray | None = None,
    patch_budget: int | None = None,
) -> MicroBatches:
    """Cut ``order`` into micro-batches of at most ``budget`` tokens: first-fit over ``open_bins`` open ones.

    Each row goes into the oldest open micro-batch with room; with none, a new one opens and, when more than
    ``open_bins`` are open, the oldest is closed. Micro-batches are emitted in closing order. With ``patches``
    and ``patch_budget`` (multimodal data) a micro-batch also holds at most ``patch_budget`` vision patches.
    """
    closed: list[list[int]] = []
    bins: list[list[int]] = []
    room: list[int] = []
    patch_room: list[int] = []
    two = patches is not None and patch_budget is not None
    for row in order.tolist():
        n = int(lengths[row])
        p = int(patches[row]) if two else 0
        if n > budget:
            raise DataError(f"row {row} has {n} tokens, more than the micro-batch budget {budget}")
        if two and p > patch_budget:
            raise DataError(
                f"row {row} has {p} vision patches, more than the micro-batch budget {patch_budget}"
            )
        for b, free in enumerate(room):
            if free >= n and (not two or patch_room[b] >= p):
                bins[b].append(row)
                room[b] -= n
                if two:
                    patch_room[b] -= p
                break
        else:
            if len(bins) == open_bins:
                closed.append(bins.pop(0))
                room.pop(0)
                if two:
                    patch_room.pop(0)
            bins.append([row])
            room.append(budget - n)
            if two:
                patch_room.append(patch_budget - p)
    closed.extend(bins)
    sizes = np.fromiter((len(b) for b in closed), dtype=np.int64, count=len(closed))
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    rows = np.fromiter((r for b in closed for r in b), dtype=np.int64, count=int(offsets[-1]))
    return MicroBatches(rows=rows, offsets=offsets)


def epoch_micro_batches(
    index: DatasetIndex, seed: int, epoch: int, budget: int, shuffle: bool, patch_budget: int | None = None
) -> MicroBatches:
    """The micro-batches of epoch ``epoch`` (independent of the world size); ``patch_budget`` caps the vision
    patches of a micro-batch (multimodal data)."""
    order = epoch_order(index, seed, epoch, shuffle)
    if patch_budget is None:
        return pack_rows(order, index.lengths, budget)
    return pack_rows(order, index.lengths, budget, patches=index.patches, patch_budget=patch_budget)


def steps_in_epoch(num_micro_batches: int, cursor: int, per_step: int) -> int:
    """Whole steps left in an epoch of ``num_micro_batches`` from micro-batch ``cursor``."""
    return max(0, (num_micro_batches - cursor) // per_step)


def rank_schedule(
    num_micro_batches: int, cursor: int, grad_accum: int, dp_size: int, dp_rank: int
) -> Iterator[tuple[int, int, int]]:
    """``(step_in_epoch_from_cursor, micro_step, micro_batch)`` for every micro-batch DP rank ``dp_rank`` runs."""
    per_step = grad_accum * dp_size
    for k in range(steps_in_epoch(num_micro_batches, cursor, per_step)):
        for g in range(grad_accum):
            yield k, g, cursor + k * per_step + g * dp_size + dp_rank
