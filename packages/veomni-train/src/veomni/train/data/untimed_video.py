"""Multimodal rows whose videos are one untimed placeholder run each (encoder kind ``vision_untimed_video``, the
layout of Qwen2-VL and Qwen2.5-VL): `MultimodalEncoder` with that video layout.

Images are encoded as for the ``vision`` kind (same image processor and placeholder rule). Videos follow the model's
video rule (its family's ``DataRules.video_rule``, settings from the model's video processor config with
``data.video_fps`` / ``data.video_max_frames`` where set): each ``<|video_pad|>`` becomes one run of
``t * h * w / merge**2`` ``<|video_pad|>`` (no timestamps, unlike the ``vision`` kind), and the mrope positions come
from the model's own rule (``DataRules.positions``). A rule with ``tokens_per_second`` (Qwen2.5-VL's) spaces a
clip's temporal ids by time, ``tokens_per_second * second_per_grid_ts`` with ``second_per_grid_ts = T /
sampled_fps`` as the processor computes it (the video rule's ``second_per_grid``). A frame-list video has the rate
of its part's ``fps``, else the sampling rate; such a rule refuses a frame list with neither (upstream would silently
assume 24 fps).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from veomni.train.data.multimodal import MultimodalEncoder
from veomni.train.data.sources import DataError


class UntimedVideoEncoder(MultimodalEncoder):
    """Encodes multimodal conversations whose videos are one placeholder run each (module docstring).

    Args: as for `MultimodalEncoder`; ``positions`` is called as ``positions(ids, image_grid_thw, video_grid_thw,
    second_per_grid)`` (``second_per_grid`` float64 ``[v]`` or None), and ``video_rule`` has ``tokens(grid)`` and
    ``second_per_grid(kept_frames, total_frames, source_fps)``.
    """

    def _video_plan(self, video: Any) -> tuple[Any, np.ndarray, tuple[int, int, int]]:
        try:
            return super()._video_plan(video)
        except DataError:
            raise
        except ValueError as err:  # the rule refuses the clip (too many frames unsampled, too few to sample)
            raise DataError(f"{video}: {err}") from None

    def _video_tokens(self, grid: tuple[int, int, int], indices: np.ndarray, fps: float) -> np.ndarray:
        """One run of the clip's ``<|video_pad|>`` tokens (the template's vision start/end stay around it)."""
        assert self.video_rule is not None and self.video_ids is not None
        return np.full(self.video_rule.tokens(grid), self.video_ids[0], dtype=np.int64)

    def _positions(
        self, ids: np.ndarray, grids: np.ndarray, video_grid_thw: np.ndarray, plans: list[tuple[Any, ...]]
    ) -> np.ndarray:
        seconds = None
        # Only a rule that spaces clips by time reads the seconds (None: one temporal id per temporal patch).
        if getattr(self.positions, "tokens_per_second", None) is not None and plans:
            assert self.video_rule is not None
            values = []
            for video, header, indices in plans:
                if not header.fps > 0:
                    raise DataError(
                        f"{video}: a frame list without an fps; this model's positions space a clip's frames by "
                        "time, so give the part an 'fps' or set data.video_fps"
                    )
                values.append(self.video_rule.second_per_grid(len(indices), header.total_frames, header.fps))
            seconds = np.asarray(values, dtype=np.float64)
        return self.positions(ids, grids, video_grid_thw, seconds)


__all__ = ["UntimedVideoEncoder"]
