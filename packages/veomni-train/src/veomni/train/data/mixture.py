"""The training data of a mixture of sources (``data.sources``): one `Step` per optimizer step, resumable.

Each source is indexed exactly as one dataset is (its own rows, format, kind and encoder); the micro-batches come
from `veomni.train.data.mixture_plan.MixturePlan` and are dealt to the DP ranks by the step schedule that one
dataset uses (`veomni.train.data.schedule.PlannedSteps`), so the resume guarantees are the same: the state after
step k, loaded into a fresh `MixtureData`, yields step k + 1 onwards exactly, and a different DP size continues at
the same global micro-batch. A change of the sources (names, rows, weights or epochs), seed, shuffle flag or
micro-batch budget is an error: the saved position would mean other samples.

Each micro-batch holds rows of one source, named by its ``"source"`` entry (the position in ``Step.sources``), so
the trainer can report each source's loss exactly; every `Step` carries each source's token and trained-token
counts over all DP ranks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import numpy as np
from torch.utils.data import Dataset

from veomni.train.data.loader import DataTopology, Step, _note_replaced, _PackedRows
from veomni.train.data.mixture_plan import MixedBatches, MixturePlan
from veomni.train.data.plan import DatasetIndex, steps_in_epoch
from veomni.train.data.schedule import PlannedSteps
from veomni.train.data.sources import DataError, RowRef

STATE_FORMAT = "veomni.train.data.mixture/1"


@attrs.frozen(eq=False)
class MixturePart:
    """One source of a mixture, indexed.

    Attributes:
        name: ``data.sources[i].name``.
        source: its rows (a `veomni.train.data.sources.RowSource`, or one converted by a format preset).
        encoder: its row encoder; index: its exact `DatasetIndex`.
        weight, epochs: its share (one of them is None, for every part alike).
    """

    name: str
    source: Any
    encoder: Any
    index: DatasetIndex
    weight: float | None = None
    epochs: float | None = None


class _MixedRows(Dataset):
    """Worker side: the micro-batch ``(round, j)`` read, encoded and collated by its source's reader."""

    def __init__(self, plan: MixturePlan, readers: Sequence[_PackedRows]) -> None:
        self.plan, self.readers = plan, list(readers)
        self._round: tuple[int, MixedBatches] | None = None

    def __getitem__(self, key: tuple[int, int]) -> dict[str, Any]:
        e, j = key
        if self._round is None or self._round[0] != e:
            self._round = (e, self.plan.round(e))
        batches = self._round[1]
        s = int(batches.sources[j])
        offset = int(self.plan.offsets[s])
        batch = self.readers[s][("rows", batches[j] - offset)]
        # Rows are named globally (sample_index, replaced_rows), as `MixtureData.source` reads them.
        batch["sample_index"] = [int(r) + offset for r in batch["sample_index"]]
        batch["replaced_rows"] = [(int(r) + offset, m) for r, m in batch["replaced_rows"]]
        batch["source"] = s
        return batch


class MixedSource:
    """The rows of every part in one index space (part s's row i is ``offsets[s] + i``), for references."""

    def __init__(self, parts: Sequence[MixturePart], offsets: np.ndarray) -> None:
        self.parts, self.offsets = list(parts), offsets

    def ref(self, row: int) -> RowRef:
        """Where global row ``row`` lives: its part's file and row."""
        s = int(np.searchsorted(self.offsets, row, side="right")) - 1
        return self.parts[s].source.ref(row - int(self.offsets[s]))


class MixtureData(PlannedSteps):
    """This rank's training steps over a mixture of sources (module docstring); arguments as `TrainData`'s, with
    ``parts`` in place of one source, encoder and index."""

    def __init__(self, parts: Sequence[MixturePart], *, topology: DataTopology, tokens_per_micro_batch: int,
                 grad_accum: int, seed: int, shuffle: bool, max_seq_len: int, overlong: str, num_workers: int = 0,
                 pad_id: int = 0, pin_memory: bool = False, patches_per_micro_batch: int | None = None,
                 on_bad_row: str = "error") -> None:  # fmt: skip
        if grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
        self.parts, self.topology, self.grad_accum = list(parts), topology, grad_accum
        self.budget, self.seed, self.shuffle, self.patch_budget = (
            tokens_per_micro_batch, seed, shuffle, patches_per_micro_batch)  # fmt: skip
        self.num_workers, self.pin_memory = num_workers, pin_memory
        by_weight = self.parts[0].weight is not None
        self.mix = MixturePlan(
            [p.index for p in self.parts], weights=[p.weight for p in self.parts] if by_weight else None,
            epochs=None if by_weight else [p.epochs for p in self.parts], seed=seed, budget=tokens_per_micro_batch,
            shuffle=shuffle, patch_budget=patches_per_micro_batch,
        )  # fmt: skip
        # Per global row: its token and trained counts, and its part (the step counts come from these).
        self.lengths = np.concatenate([p.index.lengths for p in self.parts])
        self.trained = np.concatenate([p.index.trained for p in self.parts])
        self.part_of = np.repeat(np.arange(len(self.parts)), [len(p.index.lengths) for p in self.parts])
        self.source = MixedSource(self.parts, self.mix.offsets)
        readers = [
            _PackedRows(p.source, p.encoder, p.index, max_seq_len=max_seq_len, overlong=overlong, order=None,
                        sp_rank=topology.sp_rank, sp_size=topology.sp_size, pad_id=pad_id, on_bad_row=on_bad_row)
            for p in self.parts
        ]  # fmt: skip
        self._dataset = _MixedRows(self.mix, readers)
        self._init_schedule()
        self.replaced: dict[
            int, str
        ] = {}  # global rows this rank's workers replaced by a filler -> their error
        if self.steps_in_epoch(0) == 0:
            raise DataError(
                f"the mixture's first round makes {len(self.plan(0))} micro-batches of <= {self.budget} tokens, "
                f"fewer than one step needs (grad_accum {grad_accum} x dp {topology.dp_size}); lower "
                "train.tokens_per_step"
            )

    def _make_plan(self, epoch: int) -> MixedBatches:
        return self.mix.round(epoch)

    def __iter__(self) -> Iterator[Step]:
        names = [p.name for p in self.parts]
        for step, epoch, micro, rows in self._scheduled_steps(self._dataset, "MixtureData"):
            for batch in micro:
                _note_replaced(batch, self.replaced)
            parts = self.part_of[rows]
            tokens = np.bincount(parts, weights=self.lengths[rows], minlength=len(names)).astype(np.int64)
            trained = np.bincount(parts, weights=self.trained[rows], minlength=len(names)).astype(np.int64)
            yield Step(
                step=step, epoch=epoch, micro_batches=micro, tokens=int(tokens.sum()), valid_tokens=int(trained.sum()),
                sample_tokens=tuple(self.lengths[rows].tolist()),
                sources=tuple(zip(names, tokens.tolist(), trained.tolist(), strict=True)),
            )  # fmt: skip

    def total_steps(self, epochs: int) -> int:
        """Steps in ``epochs`` rounds (mixture epochs); only a mixture by epochs has them."""
        if self.mix.weights is not None:
            raise DataError("a mixture by weight has no epochs; set train.steps (or give each source epochs)")
        return super().total_steps(epochs)

    def digest(self) -> str:
        """A fingerprint of the sources: names, shares and token counts."""
        h = hashlib.sha256()
        for p in self.parts:
            h.update(f"{p.name}|{p.weight}|{p.epochs}|{p.index.digest()}".encode())
        return h.hexdigest()[:16]

    def bad_rows(self) -> dict[str, Any]:
        """The rows the parts' indexes left out (``data.on_bad_row: skip``), total and per ``source/kind``."""
        counts = {f"{p.name}/{k}": n for p in self.parts for k, n in p.index.bad.counts().items()}
        return {"total": sum(len(p.index.bad) for p in self.parts), "by_kind": counts}

    def state_dict(self) -> dict[str, Any]:
        """Position after the last step handed out, plus what must match for it to mean the same data."""
        return {"format": STATE_FORMAT, "epoch": self._epoch, "cursor": self._cursor, "step": self._step,
                "seed": self.seed, "shuffle": self.shuffle, "tokens_per_micro_batch": self.budget,
                "patches_per_micro_batch": self.patch_budget, "mixture_digest": self.digest(),
                "sources": [p.name for p in self.parts], "plan_digest": self.plan(self._epoch).digest(),
                "dp_size": self.topology.dp_size, "grad_accum": self.grad_accum}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (module docstring: what may differ); invalidates live iterators."""
        if state.get("format") != STATE_FORMAT:
            raise DataError(
                f"data state has format {state.get('format')!r}, expected {STATE_FORMAT!r}: the checkpoint was "
                "saved from data that was not this mixture of data.sources"
            )
        mine = {"sources": [p.name for p in self.parts], "seed": self.seed, "shuffle": self.shuffle,
                "tokens_per_micro_batch": self.budget, "patches_per_micro_batch": self.patch_budget,
                "mixture_digest": self.digest()}  # fmt: skip
        bad = [f"{k}: saved {state.get(k)!r}, now {v!r}" for k, v in mine.items() if state.get(k) != v]
        if bad:
            raise DataError(
                "cannot resume the mixture's position, its sources or order changed: " + "; ".join(bad)
            )
        epoch = int(state["epoch"])
        if self.plan(epoch).digest() != state["plan_digest"]:
            raise DataError(
                f"cannot resume the mixture's position: round {epoch}'s plan differs from the saved one"
            )
        self._epoch, self._cursor, self._step = epoch, int(state["cursor"]), int(state["step"])
        self._generation += 1

    def summary(self) -> dict[str, Any]:
        """Numbers for the start-of-run log: per source rows and tokens, the first round's shares and steps."""
        plan = self.plan(0)
        used = steps_in_epoch(len(plan), 0, self.per_step) * self.per_step
        counts = np.bincount(plan.sources, minlength=len(self.parts))
        return {
            "sources": {p.name: {"rows": p.index.num_rows, "tokens": p.index.total_tokens,
                                 "trained_tokens": p.index.total_trained_tokens, "bad_rows": len(p.index.bad),
                                 "micro_batches_in_round_0": int(c)} for p, c in zip(self.parts, counts, strict=True)},
            "micro_batches_per_round": len(plan), "micro_batches_left_out_per_round": len(plan) - used,
            "steps_per_round": self.steps_in_epoch(0), "grad_accum": self.grad_accum,
        }  # fmt: skip
