"""Rows that are tokens already (``data.format: pretokenized``): ``input_ids``, with ``labels`` or ``loss_mask``.

No tokenizer call and no chat template: the ids are what the model sees. Which tokens are trained:

- ``labels`` (HF's convention, unshifted: ``labels[j]`` is ``input_ids[j]`` where token j is a target, -100 where it
  is not; the model shifts): a label that is neither is refused, since it would mean labels shifted already or
  belonging to other ids;
- ``loss_mask``: 0/1 (or bool) per token, 1 where the token is a target;
- neither: every token but the first, as for ``data.kind: text``.

Token 0 is never trained (nothing precedes it). An ``attention_mask`` holding a 0 is refused: padding would be
packed and trained as tokens; strip it. Ids outside the tokenizer's vocabulary are refused, naming the row.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from veomni.train.data.sources import DataError, RowRef

IGNORE = -100


class PretokenizedEncoder:
    """The encoder of pretokenized rows (module docstring); ``tokenizer`` gives the vocabulary size only."""

    columns: tuple[str, ...] = ("input_ids",)
    optional_columns: tuple[str, ...] = ("labels", "loss_mask", "attention_mask")

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab = len(tokenizer)

    def __call__(self, row: dict[str, Any], ref: RowRef) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids int64 [n], trained bool [n])`` of one row (`veomni.train.data.kinds` protocol)."""
        ids = _ints(row.get("input_ids"), "input_ids", ref)
        if ids.size == 0:
            raise DataError(f"{ref}: 'input_ids' is empty and produced no tokens (data.format: pretokenized)")
        bad = np.flatnonzero((ids < 0) | (ids >= self.vocab))
        if bad.size:
            raise DataError(
                f"{ref}: input_ids[{bad[0]}]={ids[bad[0]]} is outside the tokenizer's vocabulary of {self.vocab} "
                "(were the rows tokenised with another tokenizer?) (data.format: pretokenized)"
            )
        labels, mask = row.get("labels"), row.get("loss_mask")
        if labels is not None and mask is not None:
            raise DataError(
                f"{ref}: the row gives both 'labels' and 'loss_mask'; give one (data.format: pretokenized)"
            )
        if labels is not None:
            labels = _ints(labels, "labels", ref, len(ids))
            wrong = np.flatnonzero((labels != IGNORE) & (labels != ids))
            if wrong.size:
                j = wrong[0]
                raise DataError(
                    f"{ref}: labels[{j}]={labels[j]} is neither -100 nor input_ids[{j}]={ids[j]}; labels must be "
                    "unshifted (HF's convention: the model shifts them) (data.format: pretokenized)"
                )
            trained = labels != IGNORE
        elif mask is not None:
            values = _ints(mask, "loss_mask", ref, len(ids))
            if not np.isin(values, (0, 1)).all():
                raise DataError(f"{ref}: 'loss_mask' must hold 0 or 1 per token (data.format: pretokenized)")
            trained = values.astype(bool)
        else:
            trained = np.ones(len(ids), dtype=bool)
        attention = row.get("attention_mask")
        if attention is not None and not (_ints(attention, "attention_mask", ref, len(ids)) == 1).all():
            raise DataError(
                f"{ref}: 'attention_mask' holds a 0: padded rows would train their padding; strip it "
                "(data.format: pretokenized)"
            )
        trained = trained.copy()
        trained[0] = False
        return ids, trained


def _ints(value: Any, name: str, ref: RowRef, length: int | None = None) -> np.ndarray:
    """``value`` as a 1-D int64 array (bools read as 0/1), of ``length`` items when given."""
    array = np.asarray(value) if isinstance(value, list | tuple | np.ndarray) else None
    if array is not None and array.size == 0:
        array = array.astype(np.int64)
    if array is None or array.ndim != 1 or array.dtype.kind not in "iub":
        raise DataError(
            f"{ref}: {name!r} must be a list of integers, found {value!r:.80} (data.format: pretokenized)"
        )
    out = array.astype(np.int64)
    if length is not None and len(out) != length:
        raise DataError(
            f"{ref}: {name!r} has {len(out)} entries but 'input_ids' has {length}; they must align one to one "
            "(data.format: pretokenized)"
        )
    return out
