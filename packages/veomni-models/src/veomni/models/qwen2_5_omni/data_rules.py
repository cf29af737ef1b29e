"""The Qwen2.5-Omni thinker's data rules (`veomni.models.family.DataRules`, encoder kind ``"audio_visual"``):
its mrope rule, its video rule, its audio tower's token count per clip and its host-side audio chunk layout."""

from __future__ import annotations

from typing import Any

from veomni.models.qwen2_5_omni.audio_layout import AudioChunks
from veomni.models.qwen2_5_omni.positions import Qwen2_5OmniPositions
from veomni.models.qwen2_5_omni.video import Qwen2_5OmniVideoRule


def positions(config: Any, *, use_audio_in_video: bool = False) -> Qwen2_5OmniPositions:
    """The picklable position rule of the thinker ``config`` describes (``use_audio_in_video``: videos carry their
    audio tracks interleaved)."""
    return Qwen2_5OmniPositions(config, use_audio_in_video=use_audio_in_video)


def video_rule(
    path: str, config: Any, *, fps: float | None, max_frames: int | None, frame_pixels: tuple[int, int] | None
) -> Qwen2_5OmniVideoRule:
    """The thinker's video rule from ``path``'s video processor config, with ``data.video_fps`` /
    ``data.video_max_frames`` / ``data.video_frame_pixels`` (`Qwen2_5OmniVideoRule.from_pretrained`).

    Raises:
        OSError: no config at ``path``. ValueError: settings the rule does not implement.
    """
    del config  # the processor files and the processor class hold every setting
    return Qwen2_5OmniVideoRule.from_pretrained(
        path, fps=fps, max_frames=max_frames, frame_pixels=frame_pixels
    )


def audio_tokens(frames: int) -> int:
    """LLM placeholder tokens of one clip of ``frames`` mel frames, as ``Qwen2_5OmniProcessor`` expands it
    (transformers' ``_get_feat_extract_output_lengths``)."""
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import _get_feat_extract_output_lengths

    return int(_get_feat_extract_output_lengths(int(frames)))


def audio_layout(config: Any) -> AudioChunks:
    """The audio tower's host-side chunk layout (`AudioChunks`), whose tables the collator hands the thinker as
    ``audio_metadata``."""
    return AudioChunks.from_config(config.audio_config)


__all__ = ["audio_layout", "audio_tokens", "positions", "video_rule"]
