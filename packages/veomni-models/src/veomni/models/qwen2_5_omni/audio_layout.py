"""The Qwen2.5-Omni audio tower's chunk layout, computed on the host from the clips' frame counts.

Upstream derives it on the device from ``feature_attention_mask`` (a boolean-mask gather, ``.tolist()`` split
sizes, ``.max().item()``, ``repeat_interleave``): about ten host syncs per forward before the first encoder
layer, plus one per layer for ``max_seqlen`` with varlen backends. The data loader knows every clip's length, so
`AudioChunks` lays the same tables out there (picklable, for spawned workers) and the thinker's forward gathers
the frames with index tensors whose shapes the host already knows: no sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch


def _after_conv(lengths: np.ndarray) -> np.ndarray:
    # conv2 of the tower (kernel 3, stride 2, padding 1): frames -> ceil(frames / 2).
    return (lengths - 1) // 2 + 1


@attrs.frozen
class AudioChunks:
    """Host-side layout of the audio tower's input for one micro-batch.

    Attributes:
        n_window: the tower's ``config.n_window``; clips are cut into chunks of ``2 * n_window`` mel frames.
    """

    n_window: int

    @classmethod
    def from_config(cls, audio_config: Any) -> AudioChunks:
        """The layout of the tower configured by ``audio_config`` (``Qwen2_5OmniAudioEncoderConfig``)."""
        return cls(n_window=int(audio_config.n_window))

    def __call__(self, frames: Sequence[int], padded_frames: int) -> dict[str, Any]:
        """The tables of clips with ``frames[i]`` mel frames each, stored ``[clips, mels, padded_frames]``.

        Args:
            frames: valid mel frames per clip (``feature_attention_mask.sum(1)``), each in ``[1, padded_frames]``.
            padded_frames: the frame axis of the collated ``input_features``.
        Returns:
            ``frame_index`` int64 ``[total]``: rows of ``input_features.permute(0, 2, 1).reshape(-1, mels)`` holding
            the valid frames, clip by clip (upstream's boolean-mask gather); ``chunk_rows`` int64 ``[chunks *
            longest_chunk]``: for each padded chunk position the row of those ``total`` frames, ``total`` meaning the
            zero padding row; ``chunk_lengths`` int64 ``[chunks]``; ``cu_seqlens`` int32 ``[chunks + 1]`` after the
            stride-2 convolution; ``valid_indices`` int64 (non-padding rows of the ``[chunks * longest_after_conv]``
            convolution output); ``pool_indices`` int64 ``[audio_tokens]`` (first row of each stride-2 pooling pair);
            ``max_seqlen`` int; ``audio_tokens`` int (the placeholder count of the micro-batch's clips).
        """
        lengths = np.asarray(frames, dtype=np.int64)
        if lengths.ndim != 1 or not lengths.size or lengths.min() < 1 or lengths.max() > padded_frames:
            raise ValueError(
                f"AudioChunks needs one frame count per clip in [1, {padded_frames}], got {lengths.tolist()}"
            )
        window = 2 * self.n_window
        chunk_lengths = np.concatenate(
            [np.minimum(window, n - np.arange(0, n, window)) for n in lengths.tolist()]
        )
        longest = int(chunk_lengths.max())
        starts = np.concatenate([[0], np.cumsum(chunk_lengths)[:-1]])
        positions = np.arange(longest)
        total = int(lengths.sum())
        chunk_rows = np.where(
            positions[None] < chunk_lengths[:, None], starts[:, None] + positions[None], total
        ).reshape(-1)
        frame_index = np.concatenate(
            [c * padded_frames + np.arange(n) for c, n in enumerate(lengths.tolist())]
        )

        after_chunk = _after_conv(chunk_lengths)
        longest_after = int(after_chunk.max())
        valid = np.arange(longest_after)[None] < after_chunk[:, None]
        valid_indices = np.flatnonzero(valid.reshape(-1))
        cu_seqlens = np.concatenate([[0], np.cumsum(after_chunk)])

        after_clip = _after_conv(lengths)
        pooled = (after_clip - 2) // 2 + 1
        clip_starts = np.concatenate([[0], np.cumsum(after_clip)[:-1]])
        pool_indices = np.concatenate(
            [s + 2 * np.arange(p) for s, p in zip(clip_starts, pooled, strict=True)]
        )
        return {
            "frame_index": torch.from_numpy(frame_index.astype(np.int64)),
            "chunk_rows": torch.from_numpy(chunk_rows.astype(np.int64)),
            "chunk_lengths": torch.from_numpy(chunk_lengths.astype(np.int64)),
            "cu_seqlens": torch.from_numpy(cu_seqlens.astype(np.int32)),
            "valid_indices": torch.from_numpy(valid_indices.astype(np.int64)),
            "pool_indices": torch.from_numpy(pool_indices.astype(np.int64)),
            "max_seqlen": longest_after,
            "audio_tokens": int(pooled.sum()),
        }
