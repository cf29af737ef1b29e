"""The token ids of an audio-visual video placeholder's layout, shared by the omni thinkers' video rules and the
data pipeline (which reads them from the thinker config and the tokenizer)."""

from __future__ import annotations

import attrs
import numpy as np


@attrs.frozen
class VideoTokens:
    """Token ids of the video placeholder layout (from the thinker config; ``audio_end`` may come from the
    tokenizer, and is None where neither names it: only a video with its audio track needs it)."""

    video: int
    audio: int
    audio_start: int
    audio_end: int | None

    def with_audio(self, pieces: list[np.ndarray]) -> np.ndarray:
        """``pieces`` (the interleaved video and audio tokens of one clip) between the audio start and end tokens,
        int64 ``[L]``."""
        if self.audio_end is None:
            raise ValueError(
                "a video with its audio track needs the audio end token id, but neither the thinker config "
                "(audio_end_token_id) nor the tokenizer (audio_eos_token) gives one"
            )
        return np.concatenate([[self.audio_start], *pieces, [self.audio_end]]).astype(np.int64)


__all__ = ["VideoTokens"]
