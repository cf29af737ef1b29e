"""The plan of a mixture of sources (``data.sources``): which source each micro-batch comes from, seeded and
independent of the world size.

Each source keeps its own stream of micro-batches: its epochs, one after the other, each its kept rows shuffled by
a seed of its own and packed first-fit (`veomni.train.data.plan.epoch_micro_batches`), so a micro-batch never mixes
sources (which makes the per-source loss exact: a micro-batch's loss is one source's). The mixture is cut into
rounds, the epochs of `veomni.train.data.schedule.PlannedSteps`; round ``e`` takes from each source a number of
its next micro-batches and interleaves them:

- **by weight** (every source gives ``weight``): a round holds as many micro-batches as one pass over every source
  packs into (``sum_s M_s``, M_s the micro-batches of source s's first epoch), each drawn from source s with
  probability proportional to ``weight_s / fill_s`` (fill_s: the mean tokens of its micro-batches), so the
  expected *token* shares are the weights. The counts per round are one multinomial draw seeded by
  ``(seed, round)`` and the order a seeded permutation of them, which is the same as drawing every micro-batch
  independently; a source that runs out starts its next epoch (reshuffled).
- **by epochs** (every source gives ``epochs``): round ``e`` takes from source s the micro-batches between
  ``e * epochs_s`` and ``(e + 1) * epochs_s`` passes over it (a fractional pass takes that fraction of the
  epoch's micro-batches), interleaved by a seeded permutation. One round is one epoch of the mixture
  (``train.epochs`` counts them).

With ``data.shuffle: false`` no row order is shuffled and the round's micro-batches are interleaved evenly
(source s's i-th micro-batch at ``(i + 0.5) / n_s`` of the round) instead of permuted. Nothing here depends on the
number of ranks: a resume on another DP size continues at the same micro-batch.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence

import attrs
import numpy as np

from veomni.train.data.plan import DatasetIndex, MicroBatches, epoch_micro_batches
from veomni.train.data.sources import DataError

MIX = 0x6D6978  # "mix": the mixture's draws use seeds (seed, MIX, round, what), apart from any row shuffle
PLAN_CACHE = 3  # a source's epoch plans kept in memory (the current one and its neighbours)


@attrs.frozen(eq=False)
class MixedBatches(MicroBatches):
    """A round's micro-batches (rows are global: source s's row i is ``offsets_s + i``) and each one's source."""

    sources: np.ndarray = attrs.field(factory=lambda: np.zeros(0, dtype=np.int64))

    def digest(self) -> str:
        h = hashlib.sha256(super().digest().encode())
        h.update(self.sources.astype(np.int64).tobytes())
        return h.hexdigest()[:16]


class SourceStream:
    """One source's micro-batches, epoch after epoch of its own, as one endless sequence (positions from 0)."""

    def __init__(
        self, index: DatasetIndex, seed: int, budget: int, shuffle: bool, patch_budget: int | None
    ) -> None:
        self.index, self.budget, self.shuffle, self.patch_budget = index, budget, shuffle, patch_budget
        self.seed = seed
        self._starts = [0]  # _starts[k]: position of source epoch k's first micro-batch
        self._plans: dict[int, MicroBatches] = {}

    def plan(self, k: int) -> MicroBatches:
        """Source epoch ``k``'s micro-batches (a few are cached)."""
        if k not in self._plans:
            if len(self._plans) >= PLAN_CACHE:
                self._plans.pop(max(self._plans, key=lambda e: abs(e - k)))
            self._plans[k] = epoch_micro_batches(
                self.index, self.seed, k, self.budget, self.shuffle, patch_budget=self.patch_budget
            )
        return self._plans[k]

    def start(self, k: int) -> int:
        """The position of source epoch ``k``'s first micro-batch."""
        while len(self._starts) <= k:
            e = len(self._starts) - 1
            length = len(self.plan(e))
            if length == 0:
                raise DataError("a source of the mixture packs into no micro-batch")
            self._starts.append(self._starts[-1] + length)
        return self._starts[k]

    def locate(self, position: int) -> tuple[int, int]:
        """``(source epoch, micro-batch in it)`` of stream position ``position``."""
        k = len(self._starts) - 1
        while self.start(k) <= position:
            k += 1
        k = bisect.bisect_right(self._starts, position) - 1
        return k, position - self._starts[k]

    def passes(self, x: float) -> int:
        """The stream position after ``x`` passes over the source (a fractional pass: that share of its epoch)."""
        k = math.floor(x)
        return self.start(k) + math.floor((x - k) * (self.start(k + 1) - self.start(k)))

    def micro_batches(self, first: int, count: int) -> list[np.ndarray]:
        """The rows (local) of positions ``first .. first + count - 1``."""
        out: list[np.ndarray] = []
        k, j = self.locate(first)
        while len(out) < count:
            plan = self.plan(k)
            take = min(len(plan) - j, count - len(out))
            out += [plan[i] for i in range(j, j + take)]
            k, j = k + 1, 0
        return out


class MixturePlan:
    """The rounds of a mixture (module docstring).

    Args:
        indexes: each source's `DatasetIndex`, in ``data.sources`` order.
        weights, epochs: one of them per source (the other None).
        seed, budget, shuffle, patch_budget: as for one source (`epoch_micro_batches`).
    """

    def __init__(
        self,
        indexes: Sequence[DatasetIndex],
        *,
        weights: Sequence[float] | None,
        epochs: Sequence[float] | None,
        seed: int,
        budget: int,
        shuffle: bool,
        patch_budget: int | None = None,
    ) -> None:
        if (weights is None) == (epochs is None):
            raise DataError("a mixture gives every source a weight, or every source epochs")
        self.seed, self.shuffle = seed, shuffle
        self.weights = None if weights is None else np.asarray(weights, dtype=np.float64)
        self.epochs = None if epochs is None else [float(e) for e in epochs]
        # Each source shuffles by a seed of its own: two sources of the same rows are not read in lockstep.
        seeds = [
            int(np.random.SeedSequence([seed, MIX, s]).generate_state(1)[0]) for s in range(len(indexes))
        ]
        self.streams = [
            SourceStream(i, sd, budget, shuffle, patch_budget) for i, sd in zip(indexes, seeds, strict=True)
        ]
        self.offsets = np.cumsum([0] + [len(i.lengths) for i in indexes]).astype(np.int64)
        if self.weights is not None:
            first = np.asarray([s.start(1) for s in self.streams], dtype=np.float64)
            fill = np.asarray([i.total_tokens for i in indexes], dtype=np.float64) / first
            share = self.weights / fill
            self.probabilities = share / share.sum()
            self.round_size = int(first.sum())
        self._cumulative = [
            np.zeros(len(indexes), dtype=np.int64)
        ]  # _cumulative[e]: micro-batches before round e

    def counts(self, e: int) -> np.ndarray:
        """Micro-batches of each source in round ``e`` (int64 ``[sources]``)."""
        if self.weights is not None:
            rng = np.random.Generator(np.random.PCG64([self.seed, MIX, e, 0]))
            return rng.multinomial(self.round_size, self.probabilities).astype(np.int64)
        return np.asarray(
            [s.passes((e + 1) * n) - s.passes(e * n) for s, n in zip(self.streams, self.epochs, strict=True)],
            dtype=np.int64,
        )

    def first(self, e: int) -> np.ndarray:
        """Each source's stream position at the start of round ``e``."""
        while len(self._cumulative) <= e:
            self._cumulative.append(self._cumulative[-1] + self.counts(len(self._cumulative) - 1))
        return self._cumulative[e]

    def order(self, e: int, counts: np.ndarray) -> np.ndarray:
        """The source of each micro-batch of round ``e`` (int64 ``[sum(counts)]``)."""
        labels = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        if self.shuffle:
            return np.random.Generator(np.random.PCG64([self.seed, MIX, e, 1])).permutation(labels)
        # Evenly: source s's i-th micro-batch at (i + 0.5) / n_s of the round; ties by source.
        at = np.concatenate([(np.arange(n) + 0.5) / n for n in counts if n]) if labels.size else np.zeros(0)
        return labels[np.lexsort((labels, at))]

    def round(self, e: int) -> MixedBatches:
        """Round ``e``'s micro-batches."""
        counts, first = self.counts(e), self.first(e)
        pending = [
            iter(s.micro_batches(int(f), int(n))) for s, f, n in zip(self.streams, first, counts, strict=True)
        ]
        labels = self.order(e, counts)
        parts = [next(pending[s]) + self.offsets[s] for s in labels.tolist()]
        sizes = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
        rows = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        return MixedBatches(rows=rows, offsets=offsets, sources=labels)
