"""Qwen3-VL's multimodal rotary positions (mrope) for one sample, computed on the host without the model.

Data loaders need the positions before the model sees the batch: under Ulysses SP every rank receives only its
slice of the sequence, and mrope ids cannot be rebuilt from a slice (an image's rows/columns reach back to where
the image started). `Qwen3VLPositions` is the model's rule (transformers 5.23's ``Qwen3VLModel.get_rope_index``)
as a small picklable object, so it runs in spawned DataLoader workers: it holds integers and no model, config or
tokenizer.

The rule, per sample: text tokens advance one position on all three axes; an image of grid ``(t, h, w)`` patches
occupies ``t * (h / m) * (w / m)`` placeholder tokens (``m`` the spatial merge size) whose temporal / height / width
ids are ``start + (frame, row, column)``, and the text after it resumes at ``start + max(h, w) / m``.

Videos: Qwen3-VL's processor writes each temporal patch of a clip as its own run
``<t seconds><|vision_start|><|video_pad|> * (h / m) * (w / m)<|vision_end|>``, and ``get_rope_index`` splits a
clip's grid ``(t, h, w)`` into ``t`` grids ``(1, h, w)``, one per run: every frame run is positioned like a
one-frame image (temporal id = its start), and the timestamp text between runs advances the positions as text.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

TEXT, IMAGE, VIDEO = 0, 1, 2


@attrs.frozen
class Qwen3VLPositions:
    """Picklable mrope position-id function of Qwen3-VL (images and videos).

    Attributes:
        image_token_id: the ``<|image_pad|>`` placeholder id.
        spatial_merge_size: the vision tower's spatial merge size ``m`` (patches per merged token per axis).
        video_token_id: the ``<|video_pad|>`` placeholder id (None: the samples hold no video).
    """

    image_token_id: int
    spatial_merge_size: int
    video_token_id: int | None = None

    @classmethod
    def from_config(cls, config: Any) -> Qwen3VLPositions:
        """From a ``Qwen3VLConfig`` (placeholder ids and ``vision_config.spatial_merge_size``)."""
        return cls(
            int(config.image_token_id),
            int(config.vision_config.spatial_merge_size),
            int(config.video_token_id),
        )

    def __call__(
        self, input_ids: np.ndarray, image_grid_thw: np.ndarray, video_grid_thw: np.ndarray | None = None
    ) -> np.ndarray:
        """The ``[t; h; w]`` position ids of one sample.

        Args:
            input_ids: int ``[n]``, the sample with its image/video placeholders already expanded.
            image_grid_thw: int ``[k, 3]``, the patch grid of each of the sample's k images, in order.
            video_grid_thw: int ``[v, 3]``, the patch grid of each of its v clips, in order (None: no clip).
        Returns:
            int64 ``[3, n]``; equal to transformers' ``get_rope_index(...)[0][:, 0]`` for the same sample.
        Raises:
            ValueError: the placeholder runs do not match the grids (count or size), or a clip without a
                ``video_token_id``.
        """
        ids = np.asarray(input_ids)
        m = self.spatial_merge_size
        grids = {
            IMAGE: np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3),
            VIDEO: _frame_grids(video_grid_thw),
        }
        if len(grids[VIDEO]) and self.video_token_id is None:
            raise ValueError("video grids were given but the position function has no video_token_id")
        names = {IMAGE: "image", VIDEO: "video frame"}
        kind = np.where(ids == self.image_token_id, IMAGE, TEXT)
        if self.video_token_id is not None:
            kind = np.where(ids == self.video_token_id, VIDEO, kind)
        n = len(ids)
        out = np.empty((3, n), dtype=np.int64)
        edges = np.flatnonzero(np.diff(kind)) + 1
        starts = np.concatenate([[0], edges]).tolist() if n else []
        ends = np.concatenate([edges, [n]]).tolist() if n else []
        current, used = 0, {IMAGE: 0, VIDEO: 0}
        for start, end in zip(starts, ends, strict=True):
            modality = int(kind[start])
            if modality == TEXT:
                out[:, start:end] = np.arange(end - start, dtype=np.int64) + current
                current += end - start
                continue
            # One run may hold several images (frames) back to back: each takes exactly its grid's token count.
            j, table, name = start, grids[modality], names[modality]
            while j < end:
                k = used[modality]
                if k >= len(table):
                    raise ValueError(
                        f"more {name} placeholder tokens than the {len(table)} {name} grid(s) account for"
                    )
                t, h, w = (int(v) for v in table[k])
                gh, gw = h // m, w // m
                count = t * gh * gw
                if j + count > end:
                    raise ValueError(
                        f"{name} {k} has grid {(t, h, w)}, i.e. {count} placeholder tokens, but its run holds "
                        f"only {end - j}"
                    )
                frame, row, col = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
                out[0, j : j + count] = frame.reshape(-1) + current
                out[1, j : j + count] = row.reshape(-1) + current
                out[2, j : j + count] = col.reshape(-1) + current
                current += max(h, w) // m
                j += count
                used[modality] = k + 1
        for modality, table in grids.items():
            if used[modality] != len(table):
                raise ValueError(
                    f"{len(table)} {names[modality]} grid(s) but placeholder tokens for only {used[modality]}"
                )
        return out


def _frame_grids(video_grid_thw: np.ndarray | None) -> np.ndarray:
    """``[v, 3]`` clip grids -> ``[sum(t), 3]`` grids ``(1, h, w)``, one per temporal patch (upstream's split)."""
    if video_grid_thw is None:
        return np.zeros((0, 3), dtype=np.int64)
    grids = np.asarray(video_grid_thw, dtype=np.int64).reshape(-1, 3)
    frames = np.repeat(grids, grids[:, 0], axis=0)
    frames[:, 0] = 1
    return frames
