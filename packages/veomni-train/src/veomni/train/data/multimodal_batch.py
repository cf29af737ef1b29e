"""The multimodal sample (`MediaSample`, what `veomni.train.data.multimodal.MultimodalEncoder` yields besides the
token ids) and how samples become one packed batch (`collate_multimodal`, `multimodal_padding_batch`).

The collator holds no per-key code: it interprets the collate table
(`veomni.models.multimodal.collate.VISION_COLLATE`), whose keys are `MediaSample`'s attribute names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from veomni.core.sp.padding import slice_for_rank
from veomni.models.multimodal.collate import VISION_COLLATE, SequenceSplit, TensorRule
from veomni.train.data.encode import Sample
from veomni.train.data.packing import _finish, shifted_labels

__all__ = ["MediaSample", "collate_multimodal", "empty_rows", "multimodal_padding_batch"]


def empty_rows(width: int) -> tuple[np.ndarray, np.ndarray]:
    """``(float32 [0, width] pixel rows, int64 [0, 3] grids)``: a row's media when it has none of a kind."""
    return np.zeros((0, width), dtype=np.float32), np.zeros((0, 3), dtype=np.int64)


@attrs.frozen(eq=False)
class MediaSample:
    """The vision side of one encoded row; attribute names are the collate table's keys.

    Attributes:
        pixel_values: float32 ``[patches, C * T * P * P]`` (``[0, D]`` for a row without images).
        image_grid_thw: int64 ``[k, 3]``, one ``(t, h, w)`` patch grid per image.
        mrope: int64 ``[3, n]``, the sample's ``[t; h; w]`` position ids (from 0).
        pixel_values_videos: float32 ``[video patches, D]`` (``[0, D]`` without videos).
        video_grid_thw: int64 ``[v, 3]``, one grid per video.
    """

    pixel_values: np.ndarray
    image_grid_thw: np.ndarray
    mrope: np.ndarray
    pixel_values_videos: np.ndarray = attrs.field(
        default=attrs.Factory(lambda self: empty_rows(self.pixel_values.shape[1])[0], takes_self=True)
    )
    video_grid_thw: np.ndarray = attrs.field(factory=lambda: np.zeros((0, 3), dtype=np.int64))

    @property
    def position_ids(self) -> np.ndarray:
        """int64 ``[4, n]``: ``[text; t; h; w]``, the text row the plain index (transformers 5.23's layout)."""
        text = np.arange(self.mrope.shape[1], dtype=np.int64)[None]
        return np.concatenate([text, self.mrope])

    @property
    def num_patches(self) -> int:
        """Vision patches of the row, images and videos (what the tower runs on)."""
        return int(self.pixel_values.shape[0] + self.pixel_values_videos.shape[0])


def _pack(rule: TensorRule, arrays: list[np.ndarray]) -> np.ndarray | None:
    if rule.pack == "stack":
        return np.stack(arrays, axis=rule.dim)
    present = [a for a in arrays if a.shape[rule.dim]]
    if not present and rule.none_when_empty:
        return None
    return np.concatenate(present or arrays[:1], axis=rule.dim)


def collate_multimodal(
    samples: Sequence[Sample],
    *,
    sp_rank: int = 0,
    sp_size: int = 1,
    pad_id: int = 0,
    table: tuple[TensorRule, ...] = VISION_COLLATE,
    vision_metadata: Callable[[torch.Tensor], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Pack multimodal samples into one row: the text batch of `veomni.train.data.packing.collate`, plus one key
    per rule of the model's collate ``table`` (`veomni.models.multimodal.collate.VISION_COLLATE`):

    * ``position_ids`` int64 ``[4, 1, S]``: ``[text; t; h; w]`` (transformers 5.23's 4-row mrope layout), each
      packed sample restarting at 0, the SP padding ``0, 1, ...`` on all rows; this rank's slice of the full row;
    * ``pixel_values`` / ``pixel_values_videos`` float32 ``[patches, D]`` (all samples' rows concatenated) and
      ``image_grid_thw`` / ``video_grid_thw`` int64 ``[n, 3]``, NOT sliced under SP (the model slices the tower's
      input itself); None when the micro-batch holds none;
    * ``num_patches`` int: image and video patches;
    * ``vision_metadata``: ``vision_metadata(grids)`` of the joint image-then-video grids (the order the model's
      tower runs them), the tower's precomputed layout, or None without a function or without media.
    """
    if not samples or any(s.media is None for s in samples):
        raise ValueError("collate_multimodal needs at least one sample, each with media")
    input_ids = torch.from_numpy(np.concatenate([s.input_ids for s in samples]).astype(np.int64))
    labels = torch.from_numpy(np.concatenate([shifted_labels(s.input_ids, s.trained) for s in samples]))
    text = torch.from_numpy(np.concatenate([np.arange(len(s.input_ids), dtype=np.int64) for s in samples]))
    batch = _finish(input_ids, labels, text, sp_rank, sp_size, pad_id)
    for rule in table:
        packed = _pack(rule, [getattr(s.media, rule.key) for s in samples])
        if packed is None:
            batch[rule.key] = None
            continue
        tensor = torch.from_numpy(packed)
        if isinstance(rule.split, SequenceSplit):
            tensor = _pad_sequence(tensor, rule.dim, batch["padded_len"], rule.split.pad)
            tensor = slice_for_rank(tensor, rule.dim, sp_rank, sp_size)
        if rule.batch_axis is not None:
            tensor = tensor.unsqueeze(rule.batch_axis)
        batch[rule.key] = tensor.contiguous()
    grids = [batch[k] for k in ("image_grid_thw", "video_grid_thw") if batch.get(k) is not None]
    batch["vision_metadata"] = (
        None if vision_metadata is None or not grids else vision_metadata(torch.cat(grids))
    )
    extra = [s.media for s in samples if hasattr(s.media, "collate_extra")]  # e.g. omni's audio clips
    if extra:
        batch.update(extra[0].collate_extra(extra))
    batch["num_patches"] = sum(s.media.num_patches for s in samples)
    batch["sample_index"] = [s.index for s in samples]
    return batch


def _pad_sequence(tensor: torch.Tensor, dim: int, length: int, pad: str | int) -> torch.Tensor:
    """``tensor`` padded along ``dim`` to ``length``: ``0, 1, ...`` (broadcast over the other axes) or ``pad``."""
    missing = length - tensor.shape[dim]
    if not missing:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    if pad == "arange":
        view = [1] * tensor.dim()
        view[dim] = missing
        filler = torch.arange(missing, dtype=tensor.dtype).reshape(view).expand(shape)
    else:
        filler = torch.full(shape, pad, dtype=tensor.dtype)
    return torch.cat([tensor, filler], dim=dim)


def multimodal_padding_batch(*, sp_rank: int = 0, sp_size: int = 1, pad_id: int = 0) -> dict[str, Any]:
    """The one-token filler batch of evaluation (`veomni.train.data.packing.padding_batch`) in multimodal form."""
    media = MediaSample(np.zeros((0, 1), np.float32), np.zeros((0, 3), np.int64), np.zeros((3, 1), np.int64))
    sample = Sample(np.asarray([pad_id], np.int64), np.zeros(1, bool), -1, media=media)
    batch = collate_multimodal([sample], sp_rank=sp_rank, sp_size=sp_size, pad_id=pad_id)
    batch["sample_index"], batch["is_padding"] = [], True
    return batch
