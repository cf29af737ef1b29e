"""The step schedule shared by every training-data iterator: epochs of planned micro-batches, handed to the DP
ranks step by step, with a resumable position.

A subclass (`veomni.train.data.TrainData` for packed text/multimodal rows, `veomni.train.data.dit.DitData` for
DiT clips) says how an epoch's micro-batches are planned (`PlannedSteps._make_plan`) and what a worker loads for
one; this class owns the position ``(epoch, cursor, step)``, the order in which this rank reads the plan
(`rank_schedule`), the DataLoader over the keys ``(epoch, micro-batch)`` and the step loop.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from veomni.train.data.plan import MicroBatches, rank_schedule, steps_in_epoch
from veomni.train.data.sources import DataError

log = logging.getLogger(__name__)

EMPTY_EPOCHS_LIMIT = 100
"""Consecutive epochs packed into fewer micro-batches than one step after which iterating stops with an error
(skipping them is for the odd epoch whose packing came out short, not for data that no longer makes a step)."""


class KeySampler(Sampler):
    """A sampler over an endless iterator of dataset keys (the DataLoader reads it lazily)."""

    def __init__(self, keys: Iterator[Any]) -> None:
        self._keys = keys

    def __iter__(self) -> Iterator[Any]:
        return self._keys


def identity(x: Any) -> Any:
    """``collate_fn`` for datasets whose items are already whole micro-batches."""
    return x


def loader_generator() -> torch.Generator:
    """The ``generator`` of the data's DataLoaders: each iterator draws its workers' base seed from it instead of
    torch's global RNG, which dropout draws from. A resumed run makes its train iterator after the checkpoint's RNG
    state is restored, and every evaluation pass makes one between two training steps; either draw would shift the
    training's random stream. No worker reads the seed (orders and noise come from explicitly seeded generators)."""
    return torch.Generator().manual_seed(0)


class PlannedSteps:
    """Epoch / cursor / step bookkeeping over planned micro-batches.

    Subclasses set ``topology`` (a `DataTopology`), ``grad_accum``, ``num_workers`` and ``pin_memory``, call
    `_init_schedule` and implement `_make_plan`. ``cursor`` counts micro-batches of the current epoch already
    handed out over all DP ranks; a step takes ``grad_accum * dp`` of them.
    """

    topology: Any
    grad_accum: int
    num_workers: int
    pin_memory: bool

    def _init_schedule(self) -> None:
        self._plans: dict[int, MicroBatches] = {}
        self._epoch, self._cursor, self._step, self._generation = 0, 0, 0, 0

    def _make_plan(self, epoch: int) -> MicroBatches:
        raise NotImplementedError

    @property
    def per_step(self) -> int:
        """Micro-batches per step over all DP ranks (``grad_accum * dp``)."""
        return self.grad_accum * self.topology.dp_size

    def plan(self, epoch: int) -> MicroBatches:
        """Epoch ``epoch``'s micro-batches (the last two epochs' plans are cached)."""
        if epoch not in self._plans:
            self._plans = {e: p for e, p in self._plans.items() if e >= epoch - 1}
            self._plans[epoch] = self._make_plan(epoch)
        return self._plans[epoch]

    def steps_in_epoch(self, epoch: int) -> int:
        """Optimizer steps in a whole epoch."""
        return steps_in_epoch(len(self.plan(epoch)), 0, self.per_step)

    def total_steps(self, epochs: int) -> int:
        """Steps in ``epochs`` whole epochs (what ``train.epochs`` means)."""
        return sum(self.steps_in_epoch(e) for e in range(epochs))

    def _empty_epochs(self, epoch: int, cursor: int, streak: int) -> int:
        """The count of consecutive epochs without a whole step up to ``epoch`` (entered at ``cursor``), given the
        count before it. An epoch packed into fewer micro-batches than one step is skipped, as `total_steps` counts
        it (first-fit packing depends on the shuffled order, so an epoch may come out a micro-batch short of one
        step while the others make steps); `EMPTY_EPOCHS_LIMIT` of them in a row is a `DataError`."""
        if cursor or steps_in_epoch(len(self.plan(epoch)), 0, self.per_step):
            return 0
        if streak + 1 >= EMPTY_EPOCHS_LIMIT:
            raise DataError(
                f"epochs {epoch - streak}..{epoch} of the training data each pack into fewer micro-batches than one "
                f"step (grad_accum {self.grad_accum} x dp {self.topology.dp_size}); lower train.tokens_per_step"
            )
        return streak + 1

    def _keys(self, epoch: int, cursor: int) -> Iterator[tuple[int, int]]:
        empty = 0
        while True:
            empty = self._empty_epochs(epoch, cursor, empty)
            plan = self.plan(epoch)
            for _, _, j in rank_schedule(
                len(plan), cursor, self.grad_accum, self.topology.dp_size, self.topology.dp_rank
            ):
                yield epoch, j
            epoch, cursor = epoch + 1, 0

    def _scheduled_steps(
        self, dataset: Dataset, name: str
    ) -> Iterator[tuple[int, int, list[Any], np.ndarray]]:
        """``(step, epoch, this rank's micro-batches, the step's plan rows over all DP ranks)`` from the current
        position on, forever. The position is advanced *before* each yield: a checkpoint taken after a step
        resumes after it. Re-iterating or `load_state_dict` makes a live iterator raise (it would be stale)."""
        self._generation += 1
        generation = self._generation
        loader = DataLoader(
            dataset,
            batch_size=None,
            sampler=KeySampler(self._keys(self._epoch, self._cursor)),
            num_workers=self.num_workers,
            collate_fn=identity,
            pin_memory=self.pin_memory,
            generator=loader_generator(),
        )
        batches = iter(loader)
        empty = 0
        while True:
            empty = self._empty_epochs(self._epoch, self._cursor, empty)
            plan = self.plan(self._epoch)
            n_steps = steps_in_epoch(len(plan), self._cursor, self.per_step)
            if empty:
                log.warning(
                    "data: epoch %d packs into %d micro-batches, fewer than one step (%d); it is skipped, as the "
                    "run's step count (total_steps) counts it",
                    self._epoch, len(plan), self.per_step,
                )  # fmt: skip
            for _ in range(n_steps):
                micro = [next(batches) for _ in range(self.grad_accum)]
                if generation != self._generation:
                    raise RuntimeError(f"{name} was re-iterated or reloaded; this iterator is stale")
                rows = plan.rows[plan.offsets[self._cursor] : plan.offsets[self._cursor + self.per_step]]
                step, epoch = self._step, self._epoch
                self._cursor += self.per_step
                self._step += 1
                yield step, epoch, micro, rows
            self._epoch, self._cursor = self._epoch + 1, 0
