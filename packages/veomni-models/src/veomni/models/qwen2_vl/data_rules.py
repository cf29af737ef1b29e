"""Qwen2-VL's and Qwen2.5-VL's data rules (`veomni.models.family.DataRules`, encoder kind
``"vision_untimed_video"``): the model's own mrope rule (Qwen2.5-VL's spaces a clip's temporal ids by time) and the
Qwen2-VL video processor's sampling rule."""

from __future__ import annotations

from typing import Any

from veomni.models.qwen2_vl.positions import Qwen2VLPositions
from veomni.models.qwen2_vl.video import Qwen2VLVideoRule


def positions(config: Any) -> Qwen2VLPositions:
    """The picklable position rule of the model ``config`` describes (a ``Qwen2VLConfig`` or
    ``Qwen2_5_VLConfig``)."""
    return Qwen2VLPositions.from_config(config)


def video_rule(
    path: str, config: Any, *, fps: float | None, max_frames: int | None, frame_pixels: tuple[int, int] | None
) -> Qwen2VLVideoRule:
    """The video rule from ``path``'s video processor config (`Qwen2VLVideoRule.from_pretrained`), with
    ``data.video_fps`` / ``data.video_max_frames`` where set (``frame_pixels`` is refused before this is called).

    Raises:
        OSError: no config at ``path``. ValueError: settings the rule does not implement.
    """
    del config, frame_pixels  # the processor files hold every setting
    return Qwen2VLVideoRule.from_pretrained(path, fps=fps, max_frames=max_frames)


__all__ = ["positions", "video_rule"]
