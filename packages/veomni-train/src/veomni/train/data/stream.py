"""Training steps from a streaming dataset (``data.dataset.streaming: true``): no index, packing on the fly.

A corpus too big to tokenise at start-up is read as an HF ``IterableDataset``, in stream order, and packed as it
comes: each row is encoded (length policy as for indexed data) and placed first-fit into one of `OPEN_BINS` open
micro-batches of ``train.tokens_per_micro_batch`` tokens; when none has room the oldest is closed. That is the
packing of `veomni.train.data.plan.pack_rows` applied to the stream, with a bounded buffer, so the micro-batches
are a function of the stream alone: every rank reads and encodes the whole stream and keeps the micro-batches the
step schedule deals it (micro-batch ``g * dp + r`` of each step, as for indexed data), and knows every step's
global token counts without communication. When the stream ends, the open micro-batches are closed, the last
partial step is left out, and the next epoch reads the stream again (``set_epoch``).

What is exact and what is not:

- **resume**: the trainer state holds the stream position after each step's last row (``IterableDataset.
  state_dict``) and the samples waiting in the open micro-batches, so a resumed run continues with the very same
  steps, also on another DP size (the schedule is global, as for indexed data);
- **no shuffle**: rows come in stream order (``data.shuffle`` must be false; shuffle the corpus beforehand),
  since a shuffle buffer is not part of a resumable position;
- **no step count from the data**: the run length is ``train.steps`` (``train.epochs`` needs the index);
- **no bad-row fraction**: with ``data.on_bad_row: skip`` a bad row is left out and counted as it is met;
- every rank encodes every row (what the global schedule costs without an index); text and conversation data only.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
from torch.utils.data import DataLoader
from torch.utils.data import IterableDataset as TorchIterable

from veomni.train.data.encode import Encoder, Sample, encode_value
from veomni.train.data.loader import DataTopology, Step
from veomni.train.data.packing import collate
from veomni.train.data.plan import OPEN_BINS
from veomni.train.data.schedule import identity, loader_generator
from veomni.train.data.sources import DataError, OverlongError, RowRef, bad_row_kind

log = logging.getLogger(__name__)
STATE_FORMAT = "veomni.train.data.stream/1"


def _start() -> dict[str, Any]:
    """The position before the first row: epoch 0, no stream state, no open micro-batch."""
    return {"epoch": 0, "rows": 0, "stream": None, "bins": [], "bad": {}}


class _Steps(TorchIterable):
    """Worker side: from ``position`` on, encode and pack the stream and yield whole steps ``(epoch, this rank's
    micro-batches, tokens, valid tokens, sample lengths, position after the step)``."""

    def __init__(self, hf: Any, encoder: Encoder, convert: Any, what: str, position: dict[str, Any], *,
                 budget: int, per_step: int, topology: DataTopology, pad_id: int, max_seq_len: int,
                 overlong: str, skip: bool) -> None:  # fmt: skip
        self.hf, self.encoder, self.convert, self.what = hf, encoder, convert, what
        self.position, self.budget, self.per_step, self.topology = position, budget, per_step, topology
        self.pad_id, self.max_seq_len, self.overlong, self.skip = pad_id, max_seq_len, overlong, skip

    def __iter__(
        self,
    ) -> Iterator[tuple[int, list[dict[str, Any]], int, int, tuple[int, ...], dict[str, Any]]]:
        position = copy.deepcopy(self.position)
        while True:
            stream = copy.deepcopy(self.hf)
            stream.set_epoch(position["epoch"])
            if position["stream"] is not None:
                stream.load_state_dict(position["stream"])
            bins: list[list[Sample]] = [[_sample(*s) for s in b] for b in position["bins"]]
            pending: list[list[Sample]] = []
            for row in stream:
                sample = self._encode(row, position)
                position["rows"] += 1
                if sample is None:
                    continue
                closed = _place(bins, sample, self.budget)
                if closed is not None:
                    pending.append(closed)
                if len(pending) == self.per_step:
                    position["stream"], position["bins"] = stream.state_dict(), [_saved(b) for b in bins]
                    yield self._step(pending, position)
                    pending = []
            # The stream ended: the open micro-batches close in order; a last partial step is left out.
            pending += bins
            full = len(pending) - len(pending) % self.per_step
            position["stream"] = stream.state_dict()
            for k in range(0, full, self.per_step):
                # The micro-batches still to come stay in the position: a resume there closes them in order.
                position["bins"] = [_saved(b) for b in pending[k + self.per_step :]]
                yield self._step(pending[k : k + self.per_step], position)
            if position["rows"] == 0:
                raise DataError(f"{self.what}: the stream holds no row")
            log.info("data: %s: epoch %d read (%d rows); %d micro-batches left out", self.what,
                     position["epoch"], position["rows"], len(pending) - full)  # fmt: skip
            position = {**_start(), "epoch": position["epoch"] + 1, "bad": position["bad"]}

    def _encode(self, row: Any, position: dict[str, Any]) -> Sample | None:
        ref = RowRef(f"{self.what} (epoch {position['epoch']})", position["rows"])
        try:
            value = self.convert(row, ref) if self.convert is not None else dict(row)
            return encode_value(value, ref, position["rows"], self.encoder, self.max_seq_len, self.overlong)
        except OverlongError:
            raise
        except DataError as err:
            if not self.skip:
                raise
            kind = bad_row_kind(str(err))
            position["bad"][kind] = position["bad"].get(kind, 0) + 1
            if position["bad"][kind] <= 3:
                log.warning("data: %s; data.on_bad_row=skip: left out", err)
            return None

    def _step(self, micro: list[list[Sample]], position: dict[str, Any]) -> tuple:
        dp, rank = self.topology.dp_size, self.topology.dp_rank
        mine = [
            collate(micro[g * dp + rank], sp_rank=self.topology.sp_rank, sp_size=self.topology.sp_size,
                    pad_id=self.pad_id)
            for g in range(self.per_step // dp)
        ]  # fmt: skip
        samples = [s for b in micro for s in b]
        tokens = sum(len(s.input_ids) for s in samples)
        valid = sum(s.num_trained for s in samples)
        lengths = tuple(len(s.input_ids) for s in samples)
        return position["epoch"], mine, tokens, valid, lengths, copy.deepcopy(position)


def _place(bins: list[list[Sample]], sample: Sample, budget: int) -> list[Sample] | None:
    """First-fit ``sample`` into the open micro-batches (`veomni.train.data.plan.pack_rows`' rule); the closed
    one when a new micro-batch had to open and more than `OPEN_BINS` were open."""
    n = len(sample.input_ids)
    if n > budget:
        raise DataError(f"a stream row has {n} tokens, more than the micro-batch budget {budget}")
    for b in bins:
        if sum(len(s.input_ids) for s in b) + n <= budget:
            b.append(sample)
            return None
    bins.append([sample])
    return bins.pop(0) if len(bins) > OPEN_BINS else None


def _saved(samples: list[Sample]) -> list[tuple[list[int], list[bool], int, bool]]:
    return [(s.input_ids.tolist(), s.trained.tolist(), s.index, s.truncated) for s in samples]


def _sample(ids: list[int], trained: list[bool], index: int, truncated: bool) -> Sample:
    return Sample(np.asarray(ids, dtype=np.int64), np.asarray(trained, dtype=bool), index, truncated)


@attrs.frozen
class _StreamRefs:
    what: str

    def ref(self, row: int) -> RowRef:
        return RowRef(f"{self.what} (row of its epoch)", row)


class StreamData:
    """This rank's training steps from a streaming dataset (module docstring), resumable like `TrainData`.

    Args:
        hf: the ``datasets.IterableDataset``.
        encoder: the row encoder (text or conversation); ``convert``: a preset's ``convert(row, ref)`` or None.
        what: how rows are named in errors (the dataset).
        topology, tokens_per_micro_batch, grad_accum, max_seq_len, overlong, pad_id, pin_memory: as `TrainData`.
        num_workers: 0 encodes in this process, else one DataLoader worker (a stream is read in order).
        on_bad_row: ``error`` raises at a bad row (on every rank: they read the same rows); ``skip`` counts it.
    """

    def __init__(self, hf: Any, encoder: Encoder, convert: Any, what: str, *, topology: DataTopology,
                 tokens_per_micro_batch: int, grad_accum: int, max_seq_len: int, overlong: str, pad_id: int = 0,
                 num_workers: int = 0, pin_memory: bool = False, on_bad_row: str = "error") -> None:  # fmt: skip
        if hasattr(encoder, "measure"):
            raise DataError(
                f"{what}: a streaming dataset trains text or conversation data, not multimodal rows"
            )
        self.hf, self.encoder, self.convert, self.what, self.topology = hf, encoder, convert, what, topology
        self.budget, self.grad_accum, self.max_seq_len, self.overlong = (
            tokens_per_micro_batch, grad_accum, max_seq_len, overlong)  # fmt: skip
        self.pad_id, self.pin_memory, self.skip = pad_id, pin_memory, on_bad_row == "skip"
        self.num_workers = min(num_workers, 1)
        self.replaced: dict[int, str] = {}  # never filled: a bad stream row is left out, not replaced
        self._position, self._step, self._generation = _start(), 0, 0

    @property
    def source(self) -> _StreamRefs:
        """What names a packed sample's row (``batch["sample_index"]``: its number within its epoch's stream)."""
        return _StreamRefs(self.what)

    @property
    def per_step(self) -> int:
        """Micro-batches per step over all DP ranks (``grad_accum * dp``)."""
        return self.grad_accum * self.topology.dp_size

    def total_steps(self, epochs: int) -> int:
        raise DataError("a streaming dataset has no step count per epoch (no index); set train.steps")

    def __iter__(self) -> Iterator[Step]:
        self._generation += 1
        generation = self._generation
        steps = _Steps(
            self.hf, self.encoder, self.convert, self.what, self._position, budget=self.budget,
            per_step=self.per_step, topology=self.topology, pad_id=self.pad_id, max_seq_len=self.max_seq_len,
            overlong=self.overlong, skip=self.skip,
        )  # fmt: skip
        loader = DataLoader(steps, batch_size=None, num_workers=self.num_workers, pin_memory=self.pin_memory,
                            collate_fn=identity, generator=loader_generator())  # fmt: skip
        for epoch, micro, tokens, valid, lengths, position in loader:
            if generation != self._generation:
                raise RuntimeError("StreamData was re-iterated or reloaded; this iterator is stale")
            step = self._step
            self._position, self._step = position, step + 1
            yield Step(step=step, epoch=epoch, micro_batches=micro, tokens=tokens, valid_tokens=valid,
                       sample_tokens=lengths)  # fmt: skip

    def bad_rows(self) -> dict[str, Any]:
        """Bad rows left out so far (``data.on_bad_row: skip``): total and per kind."""
        counts = dict(self._position["bad"])
        return {"total": sum(counts.values()), "by_kind": counts}

    def state_dict(self) -> dict[str, Any]:
        """The stream position after the last step handed out, and what must match for it to mean the same."""
        return {"format": STATE_FORMAT, "step": self._step, "position": copy.deepcopy(self._position),
                "tokens_per_micro_batch": self.budget, "dataset": self.what, "dp_size": self.topology.dp_size,
                "grad_accum": self.grad_accum}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; the micro-batch budget and the dataset must be the saved ones."""
        if state.get("format") != STATE_FORMAT:
            raise DataError(
                f"data state has format {state.get('format')!r}, expected {STATE_FORMAT!r} (a streaming dataset); "
                "the checkpoint was saved from other data"
            )
        mine = {"tokens_per_micro_batch": self.budget, "dataset": self.what}
        bad = [f"{k}: saved {state.get(k)!r}, now {v!r}" for k, v in mine.items() if state.get(k) != v]
        if bad:
            raise DataError(
                "cannot resume the stream position, the data or its packing changed: " + "; ".join(bad)
            )
        self._position, self._step = copy.deepcopy(state["position"]), int(state["step"])
        self._generation += 1

    def summary(self) -> dict[str, Any]:
        """Numbers for the start-of-run log (a stream has no token counts before it is read)."""
        return {"stream": self.what, "position_epoch": self._position["epoch"],
                "position_rows": self._position["rows"], "grad_accum": self.grad_accum}  # fmt: skip
