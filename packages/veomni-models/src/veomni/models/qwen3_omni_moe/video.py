"""Qwen3-Omni-MoE's video rule, without torchvision: frame sampling, resizing and the placeholder layout of a video,
with and without its audio track (``use_audio_in_video``).

``Qwen3OmniMoeProcessor`` (transformers 5.23) sends videos through the same ``Qwen2VLVideoProcessor`` as
Qwen2.5-Omni, so frame sampling, resizing and patchifying are `veomni.models.qwen2_5_omni.video`'s steps 1 and 2.
What differs is the processor's own part:

1. **Per-frame pixel bounds**: the processor's ``videos_kwargs["size"]`` is 128 to 768 patches of 32 x 32 (the
   Qwen3 vision tower's 16-pixel patches merged 2 x 2), passed to the video processor on every call.
2. **Seconds per grid**: ``video_second_per_grid = temporal_patch_size / fps`` with the fps passed to the processor,
   1.0 when none is (``_process_videos``; Qwen2.5-Omni's processor assumes 2.0). The sampling fps is
   ``data.video_fps``, else the video processor config's, else that 1.0, so the seconds describe the frames kept.
3. **Placeholders** (`interleaved_placeholder_ids`): without the audio track, ``t * h * w / merge**2`` video
   tokens. With it, ``<|audio_start|>``, then the video and audio tokens merged by time -- no chunks (Qwen2.5-Omni
   cuts ``seconds_per_chunk`` chunks): video token ``i`` sits at ``t_i * second_per_grid *
   position_id_per_seconds``, audio token ``j`` at ``j``, and at equal times the video token comes first
   (``replace_video_with_audio_token``; ``get_rope_index`` merges the positions by the same comparison) -- then
   ``<|audio_end|>``. ``position_id_per_seconds`` is the thinker config's, the value its ``get_rope_index`` reads
   (the processor's own default, 13, must be passed equal to it). Times are float64 as in the processor.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from veomni.models.multimodal.video_tokens import VideoTokens
from veomni.models.qwen2_5_omni.video import Qwen2_5OmniVideoRule, video_token_times

# ``Qwen3OmniMoeProcessor._process_videos``: ``fps if fps is not None else 1.0``.
QWEN3_OMNI_DEFAULT_FPS = 1.0


@attrs.frozen
class Qwen3OmniMoeVideoRule(Qwen2_5OmniVideoRule):
    """Qwen2.5-Omni's video rule (`Qwen2_5OmniVideoRule`) with Qwen3-Omni-MoE's processor defaults (steps 1, 2) and
    placeholder layout (step 3)."""

    @classmethod
    def processor_defaults(cls) -> tuple[dict[str, int], float]:
        """``Qwen3OmniMoeProcessor.videos_kwargs["size"]`` and its 1.0 fps default (steps 1, 2)."""
        from transformers import Qwen3OmniMoeProcessor

        return dict(Qwen3OmniMoeProcessor.videos_kwargs["size"]), QWEN3_OMNI_DEFAULT_FPS

    def placeholder_ids(
        self, grid: tuple[int, int, int], tokens: VideoTokens, second_per_grid: float, *, audio_tokens: int | None,
        thinker_config: Any,
    ) -> np.ndarray:  # fmt: skip
        """`interleaved_placeholder_ids` with the thinker config's ``position_id_per_seconds``; int64 ``[L]``."""
        return interleaved_placeholder_ids(
            grid, self.merge_size, tokens, second_per_grid, audio_tokens=audio_tokens,
            position_id_per_seconds=float(thinker_config.position_id_per_seconds),
        )  # fmt: skip


def interleaved_placeholder_ids(
    grid: tuple[int, int, int],
    merge_size: int,
    tokens: VideoTokens,
    second_per_grid: float,
    *,
    audio_tokens: int | None,
    position_id_per_seconds: float,
) -> np.ndarray:
    """What one video placeholder expands to (step 3).

    Args:
        grid: the video's ``(t, h, w)`` patch grid.
        merge_size: the vision tower's spatial merge size.
        tokens: the token ids.
        second_per_grid: the video's ``video_second_per_grid``.
        audio_tokens: LLM tokens of the video's audio track (``use_audio_in_video``), or None: video tokens only.
        position_id_per_seconds: the thinker config's.
    Returns:
        int64 ``[L]``: ``t * h * w / merge**2`` video tokens, plus with the track its ``audio_tokens`` audio tokens
        merged by time between the audio start and end tokens.
    """
    times = video_token_times(grid, merge_size, second_per_grid, position_id_per_seconds)
    if audio_tokens is None:
        return np.full(times.size, tokens.video, dtype=np.int64)
    # The processor's merge, closed form: audio token j follows every video token whose time is <= j.
    before = np.searchsorted(times, np.arange(audio_tokens), side="right")
    merged = np.full(times.size + audio_tokens, tokens.video, dtype=np.int64)
    merged[np.arange(audio_tokens) + before] = tokens.audio
    return tokens.with_audio([merged])
