"""The Qwen3-Omni-MoE thinker's data rules (`veomni.models.family.DataRules`, encoder kind ``"audio_visual"``):
its mrope rule, its video rule and its audio tower's token count per clip (13 tokens per 100 mel frames). It has
no host-side audio layout: the tower derives its chunks on the device."""

from __future__ import annotations

from typing import Any

from veomni.models.qwen3_omni_moe.positions import Qwen3OmniMoePositions
from veomni.models.qwen3_omni_moe.towers import audio_token_count
from veomni.models.qwen3_omni_moe.video import Qwen3OmniMoeVideoRule


def positions(config: Any, *, use_audio_in_video: bool = False) -> Qwen3OmniMoePositions:
    """The picklable position rule of the thinker ``config`` describes (``use_audio_in_video``: videos carry their
    audio tracks interleaved)."""
    return Qwen3OmniMoePositions(config, use_audio_in_video=use_audio_in_video)


def video_rule(
    path: str, config: Any, *, fps: float | None, max_frames: int | None, frame_pixels: tuple[int, int] | None
) -> Qwen3OmniMoeVideoRule:
    """The thinker's video rule from ``path``'s video processor config, with ``data.video_fps`` /
    ``data.video_max_frames`` / ``data.video_frame_pixels`` (`Qwen3OmniMoeVideoRule.from_pretrained`).

    Raises:
        OSError: no config at ``path``. ValueError: settings the rule does not implement.
    """
    del config  # the processor files and the processor class hold every setting
    return Qwen3OmniMoeVideoRule.from_pretrained(
        path, fps=fps, max_frames=max_frames, frame_pixels=frame_pixels
    )


def audio_tokens(frames: int) -> int:
    """LLM placeholder tokens of one clip of ``frames`` mel frames (the tower's 100-frame-chunk rule)."""
    return int(audio_token_count(int(frames)))


__all__ = ["audio_tokens", "positions", "video_rule"]
