"""Multimodal rows for Qwen2-VL and Qwen2.5-VL: `MultimodalEncoder` with these families' video layout.

Images are encoded exactly as for Qwen3-VL (same image processor and placeholder rule). Videos follow the Qwen2-VL
video processor's rule (`veomni.models.qwen2_vl.video.Qwen2VLVideoRule`, settings from the model's video processor
config with ``data.video_fps`` / ``data.video_max_frames`` where set): each ``<|video_pad|>`` becomes one run of
``t * h * w / merge**2`` ``<|video_pad|>`` (no timestamps, unlike Qwen3-VL), and the mrope positions come from the
model's own rule (`veomni.models.qwen2_vl.positions.Qwen2VLPositions`), which for Qwen2.5-VL spaces a clip's
temporal ids by ``tokens_per_second * second_per_grid_ts`` with ``second_per_grid_ts = T / sampled_fps`` as the
processor computes it. A frame-list video has the rate of its part's ``fps``, else the sampling rate; Qwen2.5-VL
refuses a frame list with neither (upstream would silently assume 24 fps).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from veomni.models.qwen2_vl.positions import Qwen2VLPositions
from veomni.models.qwen2_vl.video import Qwen2VLVideoRule
from veomni.train.data.multimodal import MultimodalEncoder
from veomni.train.data.sources import DataError


def load_qwen2_vl_video_rule(
    path: str, *, fps: float | None, max_frames: int | None
) -> Qwen2VLVideoRule | str:
    """The Qwen2-VL video rule of the model at ``path`` (`Qwen2VLVideoRule.from_pretrained`), or why there is none
    as a string: data without videos does not need one, and a video row reports it."""
    try:
        return Qwen2VLVideoRule.from_pretrained(path, fps=fps, max_frames=max_frames)
    except (OSError, ValueError) as err:
        return f"{path} holds no usable Qwen2-VL video processor config ({err})"


class Qwen2VLEncoder(MultimodalEncoder):
    """Encodes multimodal conversations for Qwen2-VL / Qwen2.5-VL (module docstring).

    Args:
        tokenizer, image_processor, field, loss_mask_field, assistant_only, media_root, max_patches,
            vision_metadata: as for `MultimodalEncoder`.
        video_rule: `load_qwen2_vl_video_rule`'s result (or why videos are refused).
        positions: the model's position rule (`veomni.train.tasks.VlmTask.positions`); its placeholder ids must
            be the tokenizer's.
    """

    def __init__(self, *args: Any, positions: Qwen2VLPositions, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if positions.image_token_id != self.image_token_id:
            raise DataError(
                f"the model's image_token_id is {positions.image_token_id} but the tokenizer's <|image_pad|> is "
                f"{self.image_token_id}; they must be the same token"
            )
        if self.video_token_id is not None and positions.video_token_id != self.video_token_id:
            raise DataError(
                f"the model's video_token_id is {positions.video_token_id} but the tokenizer's <|video_pad|> is "
                f"{self.video_token_id}; they must be the same token"
            )
        if positions.spatial_merge_size != self.merge:
            raise DataError(
                f"the model's spatial_merge_size is {positions.spatial_merge_size} but the image processor's "
                f"merge_size is {self.merge}"
            )
        self.positions = positions

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
        if self.positions.tokens_per_second is not None and plans:
            assert isinstance(self.video_rule, Qwen2VLVideoRule)
            values = []
            for video, header, indices in plans:
                if not header.fps > 0:
                    raise DataError(
                        f"{video}: a frame list without an fps; Qwen2.5-VL's positions space a clip's frames by "
                        "time, so give the part an 'fps' or set data.video_fps"
                    )
                values.append(self.video_rule.second_per_grid(len(indices), header.total_frames, header.fps))
            seconds = np.asarray(values, dtype=np.float64)
        return self.positions(ids, grids, video_grid_thw, seconds)


__all__ = ["Qwen2VLEncoder", "load_qwen2_vl_video_rule"]
