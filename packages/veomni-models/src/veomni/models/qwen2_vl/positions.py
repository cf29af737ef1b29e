"""Qwen2-VL / Qwen2.5-VL multimodal rotary positions (mrope) for one sample, on the host, without the model.

The data loader needs every sample's positions before the model sees the batch (packed rows have no attention mask,
and under Ulysses SP a rank sees only its slice, from which an image's rows and columns cannot be rebuilt).
`Qwen2VLPositions` is transformers 5.23's ``Qwen2VLModel.get_rope_index`` / ``Qwen2_5_VLModel.get_rope_index`` as a
small picklable object (integers and one float, no model or config), so spawned DataLoader workers can hold it.

The rule, per sample and ``m`` the spatial merge size: text advances one position on all three axes; each
placeholder run is ONE image or clip of grid ``(t, h, w)`` patches (``t * (h / m) * (w / m)`` tokens) whose height
and width ids are ``start + row`` / ``start + column``, and whose temporal id is ``start + frame`` for images and
Qwen2-VL clips, ``start + trunc(frame * tokens_per_second * second_per_grid)`` for Qwen2.5-VL clips (computed in
float32 as upstream does with the processor's float32 ``second_per_grid_ts``); the text after it resumes at
``start + max(h, w) / m``. Unlike Qwen3-VL, a clip is one run (no per-frame timestamps).
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

TEXT, IMAGE, VIDEO = 0, 1, 2


@attrs.frozen
class Qwen2VLPositions:
    """Picklable mrope position-id function of Qwen2-VL and Qwen2.5-VL (images and videos).

    Attributes:
        image_token_id, video_token_id: the ``<|image_pad|>`` / ``<|video_pad|>`` placeholder ids.
        spatial_merge_size: patches per merged token along each axis (``m``).
        tokens_per_second: Qwen2.5-VL's ``vision_config.tokens_per_second`` (temporal ids per second of video);
            None for Qwen2-VL, whose clips advance one temporal id per temporal patch.
    """

    image_token_id: int
    video_token_id: int
    spatial_merge_size: int
    tokens_per_second: float | None = None

    @classmethod
    def from_config(cls, config: Any) -> Qwen2VLPositions:
        """From a ``Qwen2VLConfig`` or ``Qwen2_5_VLConfig`` (placeholder ids, ``vision_config``)."""
        tokens_per_second = getattr(config.vision_config, "tokens_per_second", None)
        return cls(
            int(config.image_token_id),
            int(config.video_token_id),
            int(config.vision_config.spatial_merge_size),
            None if tokens_per_second is None else float(tokens_per_second),
        )

    def __call__(
        self,
        input_ids: np.ndarray,
        image_grid_thw: np.ndarray,
        video_grid_thw: np.ndarray | None = None,
        second_per_grid_ts: np.ndarray | None = None,
    ) -> np.ndarray:
        """The ``[t; h; w]`` position ids of one sample.

        Args:
            input_ids: int ``[n]``, the sample with its image/video placeholders already expanded.
            image_grid_thw: int ``[k, 3]``, the patch grid of each image, in order.
            video_grid_thw: int ``[v, 3]``, the patch grid of each clip, in order (None: no clip).
            second_per_grid_ts: float ``[v]``, seconds per temporal patch of each clip (the processor's
                ``temporal_patch_size / sampled_fps``); read only with ``tokens_per_second`` (Qwen2.5-VL), where
                None means 1 second as upstream.
        Returns:
            int64 ``[3, n]``; equal to transformers' ``get_rope_index(...)[0][:, 0]`` for the same sample.
        Raises:
            ValueError: a placeholder run whose length is not its grid's token count, more or fewer runs than
                grids, or a ``second_per_grid_ts`` of another length than the clips.
        """
        ids = np.asarray(input_ids).reshape(-1)
        m = self.spatial_merge_size
        grids = {
            IMAGE: np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3),
            VIDEO: np.zeros((0, 3), np.int64)
            if video_grid_thw is None
            else np.asarray(video_grid_thw, dtype=np.int64).reshape(-1, 3),
        }
        seconds = np.ones(len(grids[VIDEO]), dtype=np.float32)
        if second_per_grid_ts is not None:
            seconds = np.asarray(second_per_grid_ts, dtype=np.float32).reshape(-1)
            if len(seconds) != len(grids[VIDEO]):
                raise ValueError(
                    f"second_per_grid_ts has {len(seconds)} value(s) but there are {len(grids[VIDEO])} video grid(s)"
                )
        names = {IMAGE: "image", VIDEO: "video"}
        kind = np.where(ids == self.image_token_id, IMAGE, np.where(ids == self.video_token_id, VIDEO, TEXT))
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
            k, table, name = used[modality], grids[modality], names[modality]
            if k >= len(table):
                raise ValueError(f"more {name} placeholder runs than the {len(table)} {name} grid(s)")
            t, h, w = (int(v) for v in table[k])
            gh, gw = h // m, w // m
            if t * gh * gw != end - start:
                # Upstream takes one grid per run of same-type tokens: each image/clip must be its own run.
                raise ValueError(
                    f"{name} {k} has grid {(t, h, w)}, i.e. {t * gh * gw} placeholder tokens, but its run holds "
                    f"{end - start}; every {name} must be one run of exactly its tokens"
                )
            frames = np.arange(t, dtype=np.int64)
            if modality == VIDEO and self.tokens_per_second is not None:
                # float32 as upstream: tokens_per_second * second_per_grid_ts[k], then frame * interval, truncated.
                interval = np.float32(self.tokens_per_second) * seconds[k]
                frames = (np.arange(t, dtype=np.float32) * interval).astype(np.int64)
            frame, row, col = np.meshgrid(frames, np.arange(gh), np.arange(gw), indexing="ij")
            out[0, start:end] = frame.reshape(-1) + current
            out[1, start:end] = row.reshape(-1) + current
            out[2, start:end] = col.reshape(-1) + current
            current += max(h, w) // m
            used[modality] = k + 1
        for modality, table in grids.items():
            if used[modality] != len(table):
                raise ValueError(
                    f"{len(table)} {names[modality]} grid(s) but placeholder runs for only {used[modality]}"
                )
        return out


__all__ = ["Qwen2VLPositions"]
