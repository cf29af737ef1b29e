"""Qwen3-Omni-MoE thinker's multimodal rotary positions (mrope) and audio token counts for one sample, on the
host, without the model.

As for Qwen2.5-Omni (`veomni.models.qwen2_5_omni.positions`), `Qwen3OmniMoePositions` runs the model's own
``get_rope_index`` (with ``get_llm_pos_ids_for_vision`` / ``get_chunked_index``, taken from the generated thinker
class, i.e. transformers 5.23's code) on a holder that carries only the thinker config: audio clips take
``tokens(frames)`` consecutive positions (Qwen3's 100-frame-chunk rule), images their ``(t, h, w)`` grid with the
temporal axis scaled by ``position_id_per_seconds``, videos ``seconds_per_grid * position_id_per_seconds``. It
pickles (a config and a flag), so spawned data workers can hold it.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import Qwen3OmniMoeThinkerConfig

from veomni.models.qwen3_omni_moe.generated.patched_modeling_qwen3_omni_moe import (
    Qwen3OmniMoePreTrainedModelForConditionalGeneration as _Thinker,
)
from veomni.models.qwen3_omni_moe.towers import audio_token_count, check_audio_window


class Qwen3OmniMoePositions:
    """Picklable mrope position-id function of the Qwen3-Omni-MoE thinker (text, audio, image, video).

    Args:
        config: the thinker config (token ids, ``vision_config.spatial_merge_size``, ``position_id_per_seconds``,
            ``audio_config.n_window``).
        use_audio_in_video: whether videos' audio tracks are interleaved with their frames.
    """

    # The model's own rule: these read only self.config and self.spatial_merge_size.
    get_rope_index = _Thinker.get_rope_index
    get_llm_pos_ids_for_vision = _Thinker.get_llm_pos_ids_for_vision
    get_chunked_index = _Thinker.get_chunked_index

    def __init__(self, config: Qwen3OmniMoeThinkerConfig, *, use_audio_in_video: bool = False) -> None:
        if not isinstance(config, Qwen3OmniMoeThinkerConfig):
            raise TypeError(
                f"Qwen3OmniMoePositions needs a Qwen3OmniMoeThinkerConfig, got {type(config).__name__}"
            )
        check_audio_window(config.audio_config.n_window)
        self.config = config
        self.spatial_merge_size = config.vision_config.spatial_merge_size
        self.use_audio_in_video = use_audio_in_video

    @staticmethod
    def audio_tokens(frames: int) -> int:
        """LLM placeholder tokens of one clip of ``frames`` mel frames (what the processor expands it to)."""
        return int(audio_token_count(int(frames)))

    def __call__(
        self,
        input_ids: np.ndarray,
        image_grid_thw: np.ndarray | None = None,
        video_grid_thw: np.ndarray | None = None,
        audio_frames: np.ndarray | None = None,
        second_per_grids: np.ndarray | None = None,
    ) -> np.ndarray:
        """The sample's ``[t; h; w]`` position ids.

        Args:
            input_ids: int64 ``[n]``, placeholders already expanded.
            image_grid_thw / video_grid_thw: int64 ``[k, 3]`` per image / video, or None.
            audio_frames: int64 ``[a]`` mel frames per audio clip (``feature_attention_mask.sum(-1)``), or None.
            second_per_grids: float ``[v]`` seconds per temporal grid step per video, or None.
        Returns:
            int64 ``[3, n]``, starting at 0.
        Raises:
            ValueError: audio placeholders without ``audio_frames``, or positions that are not whole numbers
            (upstream computes them in float; a fractional video time step cannot be stored as int64).
        """
        ids = torch.as_tensor(np.asarray(input_ids, dtype=np.int64))[None]
        audio = None if audio_frames is None else torch.as_tensor(np.asarray(audio_frames, dtype=np.int64))
        if int((ids == self.config.audio_token_id).sum()) and (audio is None or audio.numel() == 0):
            raise ValueError("the sample has audio placeholders but no audio_frames were given")
        grids = [None if g is None or len(g) == 0 else torch.as_tensor(np.asarray(g, dtype=np.int64))
                 for g in (image_grid_thw, video_grid_thw)]  # fmt: skip
        seconds = (
            None if second_per_grids is None else torch.as_tensor(np.asarray(second_per_grids, np.float64))
        )
        # Without any grid upstream returns plain positions, which equal the audio rule (all three axes advance
        # together over a clip).
        positions, _ = self.get_rope_index(
            ids, grids[0], grids[1], torch.ones_like(ids), self.use_audio_in_video, audio, seconds
        )
        values = positions[:, 0].double().numpy()
        rounded = np.rint(values)
        if not np.array_equal(values, rounded):
            raise ValueError(
                "mrope positions are not whole numbers (a video's seconds_per_grid * position_id_per_seconds = "
                f"{values[0][np.flatnonzero(values[0] != rounded[0])[:1]]} is fractional); int64 position ids "
                "cannot hold them"
            )
        return rounded.astype(np.int64)
