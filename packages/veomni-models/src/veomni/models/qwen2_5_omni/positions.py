"""Qwen2.5-Omni thinker's multimodal rotary positions (mrope) for one sample, on the host, without the model.

Data loaders need positions before the model sees the batch (packed rows have no attention mask, and under SP a
rank sees only a slice). Rather than re-deriving the rule, `Qwen2_5OmniPositions` runs the model's own
``get_rope_index`` (with its helpers ``get_llm_pos_ids_for_vision`` / ``get_chunked_index``, taken from the
generated thinker class, i.e. transformers 5.23's code) on a holder that carries only the thinker config: audio
clips take ``(frames -> tokens)`` consecutive positions, images/videos their ``(t, h, w)`` grid, video time axes
``seconds_per_grid * position_id_per_seconds``, and with ``use_audio_in_video`` the audio and video tokens of a
clip interleave by ``seconds_per_chunk``. It pickles (a config and two flags), so spawned workers can hold it.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import Qwen2_5OmniThinkerConfig

from veomni.models.qwen2_5_omni.generated.patched_modeling_qwen2_5_omni import (
    Qwen2_5OmniPreTrainedModelForConditionalGeneration as _Thinker,
)


class Qwen2_5OmniPositions:
    """Picklable mrope position-id function of the Qwen2.5-Omni thinker (text, audio, image, video).

    Args:
        config: the thinker config (token ids, ``vision_config.spatial_merge_size``, ``position_id_per_seconds``,
            ``seconds_per_chunk``).
        use_audio_in_video: whether videos' audio tracks are interleaved with their frames (the processor's
            ``load_audio_from_video``).
    """

    # The model's own rule: these read only self.config and self.spatial_merge_size.
    get_rope_index = _Thinker.get_rope_index
    get_llm_pos_ids_for_vision = _Thinker.get_llm_pos_ids_for_vision
    get_chunked_index = _Thinker.get_chunked_index

    def __init__(self, config: Qwen2_5OmniThinkerConfig, *, use_audio_in_video: bool = False) -> None:
        if not isinstance(config, Qwen2_5OmniThinkerConfig):
            raise TypeError(
                f"Qwen2_5OmniPositions needs a Qwen2_5OmniThinkerConfig, got {type(config).__name__}"
            )
        self.config = config
        self.spatial_merge_size = config.vision_config.spatial_merge_size
        self.use_audio_in_video = use_audio_in_video

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
        """
        ids = torch.as_tensor(np.asarray(input_ids, dtype=np.int64))[None]
        audio = None if audio_frames is None else torch.as_tensor(np.asarray(audio_frames, dtype=np.int64))
        if audio is not None and int((ids == self.config.audio_token_id).sum()) and audio.numel() == 0:
            raise ValueError("the sample has audio placeholders but no audio_frames were given")
        # Upstream computes 3-D positions only when some image or video grid is given; an audio-only row gets
        # plain positions there, which equal the audio rule (audio advances all three axes together).
        grids = [None if g is None or len(g) == 0 else torch.as_tensor(np.asarray(g, dtype=np.int64))
                 for g in (image_grid_thw, video_grid_thw)]  # fmt: skip
        seconds = (
            None if second_per_grids is None else torch.as_tensor(np.asarray(second_per_grids, np.float64))
        )
        if grids[0] is None and grids[1] is None:
            n = ids.shape[1]
            return np.broadcast_to(np.arange(n, dtype=np.int64), (3, n)).copy()
        positions, _ = self.get_rope_index(
            ids, grids[0], grids[1], torch.ones_like(ids), self.use_audio_in_video, audio, seconds
        )
        return positions[:, 0].numpy().astype(np.int64)
