"""Padding-free packing of samples into one row, and the sequence-parallel split of that row.

`collate` turns the samples of one micro-batch into the batch dict the training loop consumes:

1. Pack (on the full sequence, before any SP split): concatenate the samples into one row of L tokens;
   ``position_ids`` restart at 0 for each sample (and at each segment of a sample that has several: the two
   answers of a preference pair); labels are shifted *per sample*: ``labels[t]`` is the next
   token of the same sample when that token is trained, else -100, and each sample's last position is -100, so
   no label crosses a sample boundary.
2. SP (``sp_size`` P > 1): pad the row to a multiple of P: ``input_ids`` with ``pad_id``, labels with -100, and
   ``position_ids`` with ``0, 1, 2, ...``, so the padding is one segment of its own that nothing else attends to.
3. ``cu_seqlens``/``max_seqlen`` from the FULL (padded) ``position_ids``, through
   `veomni.models.hf.attention.packed_kwargs`, the same rule the attention functions use.
4. Slice ``input_ids`` and ``labels`` to this rank's contiguous chunk, and ``position_ids`` last.

The batch (one rank's view)::

    input_ids       int64 [1, S]   S = L without SP, padded_len / P with SP
    labels          int64 [1, S]   already shifted: compare logits[:, t] with labels[:, t]; -100 is ignored
    position_ids    int64 [1, S]   this rank's slice of the full position ids
    cu_seqlens      int32 [n + 1]  segment offsets over the full padded row (the SP padding is one segment)
    max_seqlen      int            longest segment
    num_valid_tokens int64 []      labels != -100 on this rank (each token is counted on exactly one SP rank)
    seq_len         int            L, the packed length before SP padding
    padded_len      int            L rounded up to a multiple of P (== L without SP)
    sample_index    list[int]      row indices of the packed samples, in order
    next_ids        int64 [1, S]   segmented samples only: each position's next token in its segment, trained or
                                   not (-100 at a segment's end), sliced like the labels
    is_padding      bool           True only for the filler batches that even out evaluation across ranks
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from veomni.core.sp.padding import pad_to_length, padded_length, slice_for_rank
from veomni.models.hf.attention import packed_kwargs
from veomni.train.data.encode import Sample

IGNORE_INDEX = -100


def shifted_labels(input_ids: np.ndarray, trained: np.ndarray) -> np.ndarray:
    """Labels of one sample: ``labels[t] = input_ids[t + 1]`` where token t + 1 is trained, else -100.

    Args:
        input_ids: int ``[n]``; trained: bool ``[n]``.
    Returns:
        int64 ``[n]``; the last entry is always -100 (no next token inside the sample).
    """
    labels = np.full(len(input_ids), IGNORE_INDEX, dtype=np.int64)
    labels[:-1] = np.where(trained[1:], input_ids[1:], IGNORE_INDEX)
    return labels


def sample_positions(sample: Sample) -> np.ndarray:
    """Position ids of one sample: ``0 .. n-1``, restarting at each of its ``media.segment_starts`` when it has
    them (a preference pair: chosen and rejected answers are two attention segments of one sample,
    `veomni.train.data.pairs`). int64 ``[n]``."""
    n = len(sample.input_ids)
    starts = getattr(sample.media, "segment_starts", ())
    if not starts:
        return np.arange(n, dtype=np.int64)
    bounds = [0, *starts, n]
    return np.concatenate([np.arange(b - a, dtype=np.int64) for a, b in zip(bounds[:-1], bounds[1:], strict=True)])


def collate(
    samples: Sequence[Sample], *, sp_rank: int = 0, sp_size: int = 1, pad_id: int = 0
) -> dict[str, Any]:
    """Pack ``samples`` into one row and return this SP rank's batch (the layout in the module docstring)."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    if not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank {sp_rank} is out of range for sp_size {sp_size}")
    input_ids = np.concatenate([s.input_ids for s in samples]).astype(np.int64)
    labels = np.concatenate([shifted_labels(s.input_ids, s.trained) for s in samples])
    positions = np.concatenate([sample_positions(s) for s in samples])
    batch = _finish(
        torch.from_numpy(input_ids),
        torch.from_numpy(labels),
        torch.from_numpy(positions),
        sp_rank,
        sp_size,
        pad_id,
    )
    batch["sample_index"] = [s.index for s in samples]
    if any(getattr(s.media, "segment_starts", ()) for s in samples):
        # Segmented samples (preference pairs) also get every position's next token within its segment, trained or
        # not: ORPO's NLL term scores the prompt too (TRL's). Sliced for this SP rank like the labels.
        every = np.concatenate([shifted_labels(s.input_ids, sample_positions(s) > 0) for s in samples])
        full = pad_to_length(torch.from_numpy(every), 0, batch["padded_len"], value=IGNORE_INDEX)
        batch["next_ids"] = slice_for_rank(full, 0, sp_rank, sp_size).reshape(1, -1).contiguous()
    return batch


def padding_batch(*, sp_rank: int = 0, sp_size: int = 1, pad_id: int = 0) -> dict[str, Any]:
    """A one-token batch with no valid label, for ranks that run out of evaluation batches before their peers."""
    one = torch.tensor([pad_id], dtype=torch.int64)
    batch = _finish(
        one, torch.tensor([IGNORE_INDEX]), torch.zeros(1, dtype=torch.int64), sp_rank, sp_size, pad_id
    )
    batch["sample_index"] = []
    batch["is_padding"] = True
    return batch


def _finish(
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    positions: torch.Tensor,
    sp_rank: int,
    sp_size: int,
    pad_id: int,
) -> dict[str, Any]:
    seq_len = input_ids.numel()
    total = padded_length(seq_len, sp_size)
    pad = total - seq_len
    input_ids = pad_to_length(input_ids, 0, total, value=pad_id)
    labels = pad_to_length(labels, 0, total, value=IGNORE_INDEX)
    if pad:
        positions = torch.cat([positions, torch.arange(pad, dtype=torch.int64)])
    meta = packed_kwargs(positions)  # from the full row, before slicing
    local_ids = slice_for_rank(input_ids, 0, sp_rank, sp_size)
    local_labels = slice_for_rank(labels, 0, sp_rank, sp_size)
    local_positions = slice_for_rank(positions, 0, sp_rank, sp_size)
    return {
        "input_ids": local_ids.reshape(1, -1).contiguous(),
        "labels": local_labels.reshape(1, -1).contiguous(),
        "position_ids": local_positions.reshape(1, -1).contiguous(),
        "cu_seqlens": meta["cu_seq_lens_q"],
        "max_seqlen": meta["max_length_q"],
        "num_valid_tokens": (local_labels != IGNORE_INDEX).sum(dtype=torch.int64),
        "seq_len": seq_len,
        "padded_len": total,
        "is_padding": False,
    }


def unpack(batch: dict[str, Any]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Invert `collate` for an unsliced batch (``sp_size`` 1): ``[(input_ids, trained), ...]`` per sample.

    ``trained[0]`` is False for every sample (no label points at a sample's first token).
    """
    if batch["input_ids"].shape[1] != batch["padded_len"]:
        raise ValueError(
            f"unpack needs the whole row; this batch holds {batch['input_ids'].shape[1]} of "
            f"{batch['padded_len']} tokens (an SP slice)"
        )
    ids = batch["input_ids"][0].numpy()
    labels = batch["labels"][0].numpy()
    cu = batch["cu_seqlens"].tolist()
    out = []
    for start, end in zip(cu[:-1], cu[1:], strict=True):
        if start >= batch["seq_len"]:
            break  # the SP padding segment
        trained = np.zeros(end - start, dtype=bool)
        trained[1:] = labels[start : end - 1] != IGNORE_INDEX
        out.append((ids[start:end].copy(), trained))
    return out


def model_inputs(batch: dict[str, Any], device: torch.device | str | None = None) -> dict[str, Any]:
    """The keyword arguments of an HF causal-LM forward over a packed batch (labels not included).

    ``cu_seq_lens_q/k`` and ``max_length_q/k`` are how HF hands packing to the attention function (veomni's
    ``veomni_*`` attention implementations read them, Ulysses SP included); positions restart per sample.

    Returns:
        ``{"input_ids": [1, S], "position_ids": [1, S], "cu_seq_lens_q", "cu_seq_lens_k": int32 [n + 1],
        "max_length_q", "max_length_k": int}``, tensors on ``device`` (unchanged when None).
    """

    def move(t: torch.Tensor) -> torch.Tensor:
        return t if device is None else t.to(device, non_blocking=True)

    cu = move(batch["cu_seqlens"])
    return {
        "input_ids": move(batch["input_ids"]),
        "position_ids": move(batch["position_ids"]),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": batch["max_seqlen"],
        "max_length_k": batch["max_seqlen"],
    }
