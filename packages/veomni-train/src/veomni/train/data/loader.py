"""The training and evaluation data of one rank: DataLoader workers that read, tokenise and pack, plus state.

`TrainData` yields one `Step` per optimizer step: this rank's ``grad_accum`` packed micro-batches (batch dicts, see
`veomni.train.data.packing`) and the step's global token counts. It is deterministic (the plan in
`veomni.train.data.plan`) and resumable:

* ``state_dict()`` after consuming step k and ``load_state_dict`` into a fresh `TrainData` make it yield step
  k + 1 onwards exactly as an uninterrupted run would (same world size: identical batches on every rank).
* A different DP size (or grad_accum) continues at the same global micro-batch: no sample of the epoch is
  repeated or skipped. When ``grad_accum * dp`` is unchanged (the recipe's token contract fixes it), every step
  holds the same micro-batches as before, only dealt to other ranks. SP size may change freely (SP peers share
  micro-batches).
* A different seed, shuffle flag, micro-batch budget or dataset (token counts) is an error: the saved position
  would mean something else.

Rows that a worker reads again are checked against the index: a row whose token count changed since indexing
(the file was edited during the run) is an error naming file and row.

Bad rows under ``on_bad_row="skip"``: the index left out those it found; a row that fails only when a worker
encodes it (pixels that do not decode behind a valid header) is replaced by pad tokens of its indexed length with
nothing trained and no image, so every rank's shapes and collectives stay as planned (docs/train.md). Each such
row is logged and kept in ``replaced``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
from torch.utils.data import DataLoader, Dataset

from veomni.train.data.encode import Encoder, Sample, encode_row
from veomni.train.data.packing import collate, padding_batch
from veomni.train.data.plan import (
    DatasetIndex,
    MicroBatches,
    epoch_micro_batches,
    pack_rows,
    steps_in_epoch,
)
from veomni.train.data.schedule import KeySampler, PlannedSteps, identity, loader_generator
from veomni.train.data.sources import DataError, OverlongError, RowSource

log = logging.getLogger(__name__)
STATE_FORMAT = "veomni.train.data/1"


def _positive(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be >= 1, got {value}")


@attrs.frozen
class DataTopology:
    """Where this rank sits for data: its DP rank/size (who reads what) and SP rank/size (which slice it keeps)."""

    dp_rank: int = 0
    dp_size: int = attrs.field(default=1, validator=_positive)
    sp_rank: int = 0
    sp_size: int = attrs.field(default=1, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.dp_rank < self.dp_size or not 0 <= self.sp_rank < self.sp_size:
            raise ValueError(f"ranks out of range: {self}")

    @classmethod
    def from_parallel_state(cls, state: Any) -> DataTopology:
        """From a `veomni.core.ParallelState` (DP over ``dp_replicate * dp_shard``, SP peers share data)."""
        return cls(dp_rank=state.dp_rank, dp_size=state.dims.dp, sp_rank=state.sp_rank, sp_size=state.dims.sp)


@attrs.frozen(eq=False)
class Step:
    """One optimizer step's data on this rank.

    Attributes:
        step: 0-based global step index.
        epoch: the epoch it belongs to.
        micro_batches: ``grad_accum`` batch dicts for this rank.
        tokens: packed tokens of the whole step over all DP ranks (before SP padding).
        valid_tokens: valid labels of the whole step over all DP ranks: the loss normaliser ``N_global``, known
            here without communication (``veomni.core.global_token_count`` over the batches gives the same).
        patches: vision patches of the whole step over all DP ranks (multimodal data; 0 for text).
        sample_tokens: every packed sample's tokens over all DP ranks (the attention FLOPs of the whole step).
        sources: a mixture's ``(name, tokens, valid_tokens)`` of every source over all DP ranks (``data.sources``,
            each micro-batch's ``"source"`` the position of its source here); empty for one source.
    """

    step: int
    epoch: int
    micro_batches: list[dict[str, Any]]
    tokens: int
    valid_tokens: int
    patches: int = 0
    sample_tokens: tuple[int, ...] = ()
    sources: tuple[tuple[str, int, int], ...] = ()


class _PackedRows(Dataset):
    """Worker side: reads, tokenises and collates the rows a key names.

    Keys: ``(epoch, j)`` for micro-batch j of an epoch's plan (rebuilt from ``order``, the seed/budget/shuffle
    of `epoch_micro_batches`, and cached for the current epoch), ``("rows", array)`` for explicit rows, or
    ``"padding"`` for a filler batch.
    """

    def __init__(
        self,
        source: RowSource,
        encoder: Encoder,
        index: DatasetIndex,
        *,
        max_seq_len: int,
        overlong: str,
        order: dict[str, Any] | None,
        sp_rank: int,
        sp_size: int,
        pad_id: int,
        on_bad_row: str = "error",
    ) -> None:
        self.source, self.encoder, self.index = source, encoder, index
        self.max_seq_len, self.overlong, self.order = max_seq_len, overlong, order
        self.collate_args = dict(sp_rank=sp_rank, sp_size=sp_size, pad_id=pad_id)
        self.multimodal = hasattr(encoder, "measure")
        self.skip = on_bad_row == "skip"
        self._plan: tuple[int, MicroBatches] | None = None

    def rows(self, key: tuple[int, int] | tuple[str, np.ndarray]) -> np.ndarray:
        if key[0] == "rows":
            return key[1]
        if self.order is None:
            raise ValueError(f"key {key!r} names an epoch, but this dataset has no epoch order")
        epoch, j = key
        if self._plan is None or self._plan[0] != epoch:
            self._plan = (epoch, epoch_micro_batches(self.index, epoch=epoch, **self.order))
        return self._plan[1][j]

    def __getitem__(self, key: Any) -> dict[str, Any]:
        if isinstance(key, str) and key == "padding":
            if self.multimodal:
                from veomni.train.data.multimodal_batch import multimodal_padding_batch

                return multimodal_padding_batch(**self.collate_args)
            return padding_batch(**self.collate_args)
        samples, replaced = [], []
        for row in self.rows(key).tolist():
            try:
                sample = encode_row(self.source, self.encoder, row, self.max_seq_len, self.overlong)
            except OverlongError:
                raise
            except DataError as err:
                if not self.skip:
                    raise
                samples.append(self._filler(row))
                replaced.append((row, str(err)))
                continue
            if sample is None or len(sample.input_ids) != self.index.lengths[row]:
                raise DataError(
                    f"{self.source.ref(row)}: now gives {0 if sample is None else len(sample.input_ids)} tokens, "
                    f"but {self.index.lengths[row]} when the data was indexed; was the file changed during the run?"
                )
            samples.append(sample)
        if self.multimodal:
            from veomni.train.data.multimodal_batch import collate_multimodal

            batch = collate_multimodal(
                samples, **self.collate_args, vision_metadata=self.encoder.vision_metadata
            )
        else:
            batch = collate(samples, **self.collate_args)
        batch["replaced_rows"] = replaced
        return batch

    def _filler(self, row: int) -> Sample:
        """What takes a bad row's place in a worker (module docstring): the indexed token count of pad ids,
        nothing trained, no image."""
        ids = np.full(int(self.index.lengths[row]), self.collate_args["pad_id"], dtype=np.int64)
        filler_media = getattr(self.encoder, "filler_media", None)  # pairs: two segments, as every pair sample
        media = None if filler_media is None else filler_media(len(ids))
        if self.multimodal:
            from veomni.train.data.multimodal_batch import MediaSample

            no_grid = np.zeros((0, 3), dtype=np.int64)
            media = MediaSample(np.zeros((0, 1), np.float32), no_grid, self.encoder.positions(ids, no_grid))
        return Sample(ids, np.zeros(len(ids), dtype=bool), row, media=media)


def _note_replaced(batch: dict[str, Any], replaced: dict[int, str]) -> None:
    """Take the worker's list of rows it replaced by a filler off ``batch``; log each row the first time."""
    for row, message in batch.pop("replaced_rows", []):
        if row not in replaced:
            log.warning(
                "data: %s; data.on_bad_row=skip: replaced by pad tokens with nothing trained (a bad row found "
                "only when encoded, not when indexed)",
                message,
            )
        replaced[row] = message


class TrainData(PlannedSteps):
    """This rank's training steps, forever (epoch after epoch); the loop stops after its step count.

    Args:
        source, encoder, index: the rows, how to tokenise them, and their exact `DatasetIndex`.
        topology: this rank's DP/SP position.
        tokens_per_micro_batch: packing budget of one micro-batch (per DP rank, before the SP split).
        grad_accum: micro-batches per step on each DP rank (`veomni.train.recipe.Recipe.grad_accum`).
        seed, shuffle: the per-epoch order.
        max_seq_len, overlong: the length policy the index was built with.
        num_workers: DataLoader workers (0: in process); pad_id: token id of SP padding.
        pin_memory: pin the batches' host memory (for asynchronous copies to a GPU).
        patches_per_micro_batch: vision patches one micro-batch may hold (multimodal data; None: no limit).
        on_bad_row: ``skip`` puts a filler in the place of a row that fails only when a worker encodes it (module
            docstring); ``error`` raises.
    """

    def __init__(
        self,
        source: RowSource,
        encoder: Encoder,
        index: DatasetIndex,
        *,
        topology: DataTopology,
        tokens_per_micro_batch: int,
        grad_accum: int,
        seed: int,
        shuffle: bool,
        max_seq_len: int,
        overlong: str,
        num_workers: int = 0,
        pad_id: int = 0,
        pin_memory: bool = False,
        patches_per_micro_batch: int | None = None,
        on_bad_row: str = "error",
    ) -> None:
        if grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
        self.source, self.index, self.topology = source, index, topology
        self.budget, self.grad_accum, self.seed, self.shuffle = (
            tokens_per_micro_batch,
            grad_accum,
            seed,
            shuffle,
        )
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self._plan_args: dict[str, Any] = dict(seed=seed, budget=tokens_per_micro_batch, shuffle=shuffle)
        self.patch_budget = patches_per_micro_batch
        if patches_per_micro_batch is not None:
            self._plan_args["patch_budget"] = patches_per_micro_batch
        self._dataset = _PackedRows(
            source,
            encoder,
            index,
            max_seq_len=max_seq_len,
            overlong=overlong,
            order=self._plan_args,
            sp_rank=topology.sp_rank,
            sp_size=topology.sp_size,
            pad_id=pad_id,
            on_bad_row=on_bad_row,
        )
        self._init_schedule()
        self.replaced: dict[int, str] = {}  # rows this rank's workers replaced by a filler -> their error
        if self.steps_in_epoch(0) == 0:
            raise DataError(
                f"the training data makes {len(self.plan(0))} micro-batches of <= {self.budget} tokens, fewer than "
                f"one step needs (grad_accum {grad_accum} x dp {topology.dp_size}); lower train.tokens_per_step"
            )

    def _make_plan(self, epoch: int) -> MicroBatches:
        return epoch_micro_batches(self.index, epoch=epoch, **self._plan_args)

    def __iter__(self) -> Iterator[Step]:
        for step, epoch, micro, rows in self._scheduled_steps(self._dataset, "TrainData"):
            for batch in micro:
                _note_replaced(batch, self.replaced)
            yield Step(
                step=step,
                epoch=epoch,
                micro_batches=micro,
                tokens=int(self.index.lengths[rows].sum()),
                valid_tokens=int(self.index.trained[rows].sum()),
                patches=0 if self.index.patches is None else int(self.index.patches[rows].sum()),
                sample_tokens=tuple(self.index.lengths[rows].tolist()),
            )

    def state_dict(self) -> dict[str, Any]:
        """Position after the last step handed out, plus what must match for it to mean the same data."""
        extra = {} if self.patch_budget is None else {"patches_per_micro_batch": self.patch_budget}
        return {
            **extra,
            "format": STATE_FORMAT,
            "epoch": self._epoch,
            "cursor": self._cursor,
            "step": self._step,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "tokens_per_micro_batch": self.budget,
            "index_digest": self.index.digest(),
            "plan_digest": self.plan(self._epoch).digest(),
            "dp_size": self.topology.dp_size,
            "grad_accum": self.grad_accum,
            "bad_rows": len(self.index.bad),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (see the module docstring for what may differ); invalidates live iterators."""
        if state.get("format") != STATE_FORMAT:
            raise DataError(f"data state has format {state.get('format')!r}, expected {STATE_FORMAT!r}")
        mine = {"seed": self.seed, "shuffle": self.shuffle, "tokens_per_micro_batch": self.budget}
        mine["index_digest"] = self.index.digest()
        if self.patch_budget is not None or "patches_per_micro_batch" in state:
            mine["patches_per_micro_batch"] = self.patch_budget
        bad = [f"{k}: saved {state.get(k)!r}, now {v!r}" for k, v in mine.items() if state.get(k) != v]
        if state.get("bad_rows", 0) != len(self.index.bad):  # states saved before bad rows existed hold none
            bad.append(f"bad_rows (left out): saved {state.get('bad_rows', 0)}, now {len(self.index.bad)}")
        if bad:
            raise DataError(
                "cannot resume the data position, the data or its order changed: " + "; ".join(bad)
            )
        epoch, cursor = int(state["epoch"]), int(state["cursor"])
        if self.plan(epoch).digest() != state["plan_digest"]:
            raise DataError(
                f"cannot resume the data position: epoch {epoch}'s plan differs from the saved one "
                "(same seed and data, so the shuffle or packing code changed, e.g. a numpy upgrade)"
            )
        if (state["dp_size"], state["grad_accum"]) != (self.topology.dp_size, self.grad_accum):
            log.info(
                "data: resuming with dp=%d grad_accum=%d (saved with dp=%d grad_accum=%d) at micro-batch %d of "
                "epoch %d; no sample is repeated or skipped",
                self.topology.dp_size,
                self.grad_accum,
                state["dp_size"],
                state["grad_accum"],
                cursor,
                epoch,
            )
        self._epoch, self._cursor, self._step = epoch, cursor, int(state["step"])
        self._generation += 1

    def summary(self) -> dict[str, Any]:
        """Numbers for the start-of-run log: rows, exact tokens, truncation, packing and steps per epoch."""
        plan = self.plan(0)
        used = steps_in_epoch(len(plan), 0, self.per_step) * self.per_step
        return {
            "rows": self.index.num_rows,
            "samples": self.index.num_samples,
            "tokens": self.index.total_tokens,
            "trained_tokens": self.index.total_trained_tokens,
            "truncated": self.index.truncated,
            "dropped": self.index.dropped,
            "bad_rows": len(self.index.bad),
            "micro_batches_per_epoch": len(plan),
            "micro_batches_left_out_per_epoch": len(plan) - used,
            "packing_efficiency": self.index.total_tokens / (len(plan) * self.budget),
            "steps_per_epoch": self.steps_in_epoch(0),
            "grad_accum": self.grad_accum,
        }


class EvalData:
    """One pass over the evaluation data, in file order, dealt round-robin over the DP ranks.

    Every rank yields the same number of batches (``len(self)``): ranks with fewer micro-batches get filler
    batches (``is_padding`` True, no valid label), so collectives inside the forward stay matched.
    """

    def __init__(
        self,
        source: RowSource,
        encoder: Encoder,
        index: DatasetIndex,
        *,
        topology: DataTopology,
        tokens_per_micro_batch: int,
        max_seq_len: int,
        overlong: str,
        num_workers: int = 0,
        pad_id: int = 0,
        pin_memory: bool = False,
        patches_per_micro_batch: int | None = None,
        on_bad_row: str = "error",
    ) -> None:
        self.source, self.index, self.topology = source, index, topology
        self.num_workers, self.pin_memory = num_workers, pin_memory
        kept = np.flatnonzero(index.lengths > 0)
        if patches_per_micro_batch is None:
            self.plan = pack_rows(kept, index.lengths, tokens_per_micro_batch)
        else:
            self.plan = pack_rows(
                kept,
                index.lengths,
                tokens_per_micro_batch,
                patches=index.patches,
                patch_budget=patches_per_micro_batch,
            )
        self._dataset = _PackedRows(
            source,
            encoder,
            index,
            max_seq_len=max_seq_len,
            overlong=overlong,
            order=None,
            sp_rank=topology.sp_rank,
            sp_size=topology.sp_size,
            pad_id=pad_id,
            on_bad_row=on_bad_row,
        )
        self.replaced: dict[int, str] = {}  # as `TrainData.replaced`

    def __len__(self) -> int:
        return -(-len(self.plan) // self.topology.dp_size)

    @property
    def valid_tokens(self) -> int:
        """Valid labels of the whole evaluation set over all ranks (the perplexity denominator)."""
        return self.index.total_trained_tokens

    def _keys(self) -> Iterator[Any]:
        for i in range(len(self)):
            j = i * self.topology.dp_size + self.topology.dp_rank
            yield ("rows", self.plan[j]) if j < len(self.plan) else "padding"

    def __iter__(self) -> Iterator[dict[str, Any]]:
        loader = DataLoader(
            self._dataset,
            batch_size=None,
            sampler=KeySampler(self._keys()),
            num_workers=self.num_workers,
            collate_fn=identity,
            pin_memory=self.pin_memory,
            generator=loader_generator(),
        )
        for batch in loader:
            _note_replaced(batch, self.replaced)
            yield batch
