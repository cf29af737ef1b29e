"""Qwen3-VL's data rules (`veomni.models.family.DataRules`, encoder kind ``"vision"``): its mrope position rule and
its video sampling rule, as the data pipeline builds them for one run. Also used by Qwen3-VL-MoE, Qwen3.5 and
Qwen3.5-MoE, whose processors and ``get_rope_index`` are Qwen3-VL's."""

from __future__ import annotations

from typing import Any

from veomni.models.qwen3_vl.positions import Qwen3VLPositions
from veomni.models.qwen3_vl.video import Qwen3VLVideoRule


def positions(config: Any) -> Qwen3VLPositions:
    """The picklable position rule of the model ``config`` describes (placeholder ids, spatial merge size)."""
    return Qwen3VLPositions.from_config(config)


def video_rule(
    path: str, config: Any, *, fps: float | None, max_frames: int | None, frame_pixels: tuple[int, int] | None
) -> Qwen3VLVideoRule:
    """``Qwen3VLVideoProcessor.from_pretrained(path)``'s settings (it reads ``video_preprocessor_config.json``,
    else, as transformers does, ``preprocessor_config.json``), with ``data.video_fps`` / ``data.video_max_frames``
    where set. ``frame_pixels`` is not part of this rule (the data pipeline refuses it before calling).

    Raises:
        OSError: no config at ``path``. ValueError: settings the rule does not implement.
    """
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    del config, frame_pixels  # the processor files hold every setting
    processor = Qwen3VLVideoProcessor.from_pretrained(path)
    return Qwen3VLVideoRule.from_processor(processor, fps=fps, max_frames=max_frames)


__all__ = ["positions", "video_rule"]
