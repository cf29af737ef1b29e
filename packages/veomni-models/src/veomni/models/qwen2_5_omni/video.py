"""Qwen2.5-Omni's video rule, without torchvision: frame sampling, resizing and the placeholder layout of a video,
with and without its audio track interleaved (``use_audio_in_video``).

``Qwen2_5OmniProcessor`` (transformers 5.23) sends videos through ``Qwen2VLVideoProcessor``, whose module imports
torchvision, which this framework does not require; the rule is restated here step by step:

1. **Frame sampling** (``Qwen2VLVideoProcessor.sample_frames`` with ``fps``): a clip of ``N`` frames at ``F`` fps
   keeps ``n = floor(min(max(N / F * fps, min_frames), floor(min(max_frames, N) / T) * T, N) / T) * T`` frames
   (``T`` the temporal patch size) at ``arange(0, N, N / n).int()``. ``fps`` is ``data.video_fps``, else the video
   processor config's, else 2.0: the processor hard-codes 2.0 for ``video_second_per_grid`` when none is given
   (and qwen-omni-utils samples at 2 fps before calling it).
2. **Resize**: every frame to one ``(H', W')`` by the image ``smart_resize`` (transformers' own function) with the
   per-frame pixel bounds ``size`` -- the processor's own ``videos_kwargs["size"]`` (128 to 768 patches of 28 x 28),
   which override the video processor config's at call time; ``cap_pixels_per_frame`` lowers the ceiling as
   upstream does. Interpolation, rescale/normalise and patchify are Qwen2-VL's, the same steps as Qwen3-VL's
   (`veomni.models.qwen3_vl.video.Qwen3VLVideoRule.pixel_rows`).
3. **Seconds per grid**: ``video_second_per_grid = T / fps`` per video, as the processor writes it (also where
   ``min_frames`` / ``max_frames`` changed the real spacing of the sampled frames: the model was trained so).
4. **Placeholders** (`video_placeholder_ids`): the template's ``<|VIDEO|>`` becomes ``t * h * w / merge**2`` video
   tokens; with the audio track, ``<|audio_bos|>``, then per time chunk (``seconds_per_chunk`` seconds, i.e.
   ``position_id_per_seconds * seconds_per_chunk`` temporal positions) the chunk's video tokens followed by the
   chunk's audio tokens, then ``<|audio_eos|>``. Chunks are cut by the model's own ``get_chunked_index`` -- the
   rule ``get_rope_index`` applies to the same tokens -- so placeholders and positions cannot disagree.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np
import torch
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from veomni.models.multimodal.video_tokens import VideoTokens
from veomni.models.qwen2_5_omni.generated.patched_modeling_qwen2_5_omni import (
    Qwen2_5OmniPreTrainedModelForConditionalGeneration as _Thinker,
)
from veomni.models.qwen3_vl.video import _RESAMPLE, Qwen3VLVideoRule

# transformers 5.23's ``Qwen2VLVideoProcessor`` class attributes (its module cannot be imported here), the values a
# config file does not set.
QWEN2_VL_VIDEO_DEFAULTS: dict[str, Any] = {
    "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "min_frames": 4, "max_frames": 768,
    "resample": 3, "image_mean": OPENAI_CLIP_MEAN, "image_std": OPENAI_CLIP_STD, "do_resize": True,
    "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "cap_pixels_per_frame": None,
    "max_video_tokens": 128000, "fps": None,
}  # fmt: skip
# ``Qwen2_5OmniProcessor._process_videos``: "default fps not saved in official ckpt, hardcode".
OMNI_DEFAULT_FPS = 2.0


@attrs.frozen
class Qwen2_5OmniVideoRule(Qwen3VLVideoRule):
    """The settings of Qwen2.5-Omni's video processing and the steps of the module docstring.

    Fields are `Qwen3VLVideoRule`'s; ``min_pixels`` / ``max_pixels`` bound the pixels of ONE frame here (Qwen2-VL's
    meaning), and ``fps`` is the sampling rate that also gives ``second_per_grid``.
    """

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        fps: float | None = None,
        max_frames: int | None = None,
        frame_pixels: tuple[int, int] | None = None,
    ) -> Qwen2_5OmniVideoRule:
        """From the model directory's ``video_preprocessor_config.json`` (else ``preprocessor_config.json``, as
        transformers resolves it) over `QWEN2_VL_VIDEO_DEFAULTS`, with the processor's call-time ``size``.

        Args:
            path: the model (or tokenizer) directory.
            fps, max_frames: ``data.video_fps`` / ``data.video_max_frames`` (None: the config's, else the defaults).
            frame_pixels: ``(min, max)`` pixels per resized frame, what a processor call's ``videos_kwargs`` size
                sets (None: the processor's default).
        Raises:
            ValueError: a fixed ``num_frames``, an unsupported interpolation, ``max_frames`` below the temporal
                patch size, or ``fps <= 0``.
            OSError: no config file at ``path``.
        """
        from transformers.video_processing_utils import BaseVideoProcessor

        found, _ = BaseVideoProcessor.get_video_processor_dict(path)
        settings = {**QWEN2_VL_VIDEO_DEFAULTS, **{k: v for k, v in found.items() if v is not None}}
        if settings.get("num_frames") is not None:
            raise ValueError(
                f"the video processor config fixes num_frames={settings['num_frames']}; only fps sampling is "
                "supported (cap the frame count with data.video_max_frames)"
            )
        resample = int(settings["resample"])
        if resample not in _RESAMPLE:
            raise ValueError(
                f"the video processor's resample={resample} is not supported; expected one of {sorted(_RESAMPLE)} "
                "(PIL codes of nearest, bilinear, bicubic)"
            )
        # The processor passes its own size to the video processor on every call (its videos_kwargs default).
        size, default_fps = cls.processor_defaults()
        if frame_pixels is not None:
            size = {"shortest_edge": frame_pixels[0], "longest_edge": frame_pixels[1]}
        rule = cls(
            patch_size=int(settings["patch_size"]),
            temporal_patch_size=int(settings["temporal_patch_size"]),
            merge_size=int(settings["merge_size"]),
            min_pixels=int(size["shortest_edge"]),
            max_pixels=int(size["longest_edge"]),
            fps=float(fps if fps is not None else settings["fps"] or default_fps),
            min_frames=int(settings["min_frames"]),
            max_frames=int(max_frames if max_frames is not None else settings["max_frames"]),
            # Upstream treats None as False (with a warning that the default will change).
            cap_pixels_per_frame=bool(settings["cap_pixels_per_frame"]),
            max_video_tokens=int(settings["max_video_tokens"]),
            do_resize=bool(settings["do_resize"]),
            resample=_RESAMPLE[resample],
            do_rescale=bool(settings["do_rescale"]),
            rescale_factor=float(settings["rescale_factor"]),
            do_normalize=bool(settings["do_normalize"]),
            image_mean=tuple(float(v) for v in settings["image_mean"]),
            image_std=tuple(float(v) for v in settings["image_std"]),
        )
        if rule.max_frames < rule.temporal_patch_size:
            raise ValueError(
                f"max_frames={rule.max_frames} is below the temporal patch size {rule.temporal_patch_size}: every "
                "clip would be refused"
            )
        if rule.fps <= 0:
            raise ValueError(f"the sampling fps must be > 0, found {rule.fps}")
        return rule

    @classmethod
    def processor_defaults(cls) -> tuple[dict[str, int], float]:
        """The processor's call-time ``videos_kwargs["size"]`` (per-frame pixel bounds) and the fps its
        ``video_second_per_grid`` assumes when none is passed: Qwen2.5-Omni's (a subclass names its processor's)."""
        from transformers import Qwen2_5OmniProcessor

        return dict(Qwen2_5OmniProcessor.videos_kwargs["size"]), OMNI_DEFAULT_FPS

    def placeholder_ids(
        self, grid: tuple[int, int, int], tokens: VideoTokens, second_per_grid: float, *, audio_tokens: int | None,
        thinker_config: Any,
    ) -> np.ndarray:  # fmt: skip
        """What one video placeholder expands to in this thinker's layout: `video_placeholder_ids` with the
        thinker config's ``position_id_per_seconds`` and ``seconds_per_chunk``; int64 ``[L]``."""
        return video_placeholder_ids(
            grid, self.merge_size, tokens, second_per_grid, audio_tokens=audio_tokens,
            position_id_per_seconds=float(thinker_config.position_id_per_seconds),
            seconds_per_chunk=float(thinker_config.seconds_per_chunk),
        )  # fmt: skip

    @property
    def second_per_grid(self) -> float:
        """``video_second_per_grid`` of every sampled video: ``temporal_patch_size / fps`` (step 3)."""
        return self.temporal_patch_size / self.fps

    def sample_indices(self, total_frames: int, source_fps: float) -> np.ndarray:
        """Indices of the frames kept from a clip of ``total_frames`` frames at ``source_fps`` (step 1).

        Returns:
            int64 ``[n]``, ascending, ``n`` a multiple of the temporal patch size.
        Raises:
            ValueError: the clip has fewer frames than one temporal patch.
        """
        tps = self.temporal_patch_size
        cap = math.floor(min(self.max_frames, total_frames) / tps) * tps
        n = min(max(total_frames / source_fps * self.fps, self.min_frames), cap, total_frames)
        n = math.floor(n / tps) * tps
        if n < tps:
            raise ValueError(f"{total_frames} frame(s), fewer than the temporal patch size {tps}")
        # torch's float32 arange, as upstream computes it: the same rounding of the steps.
        return torch.arange(0, total_frames, total_frames / n).int().numpy().astype(np.int64)

    def resized_size(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """``(H', W')`` of every frame of a clip of ``num_frames`` sampled frames (step 2)."""
        if not self.do_resize:
            return height, width
        factor = self.patch_size * self.merge_size
        max_pixels = self.max_pixels
        if self.cap_pixels_per_frame:
            total = int(self.max_video_tokens * factor * factor * 0.9)
            max_pixels = max(
                min(max_pixels, total * self.temporal_patch_size // num_frames), int(self.min_pixels * 1.05)
            )
        return smart_resize(height, width, factor=factor, min_pixels=self.min_pixels, max_pixels=max_pixels)


def video_token_times(
    grid: tuple[int, int, int], merge_size: int, second_per_grid: float, position_id_per_seconds: float
) -> np.ndarray:
    """Temporal position (before the clip's start offset) of every LLM video token of a ``(t, h, w)`` grid, in
    token order: ``t_index * second_per_grid * position_id_per_seconds``, one value per merged patch; float64
    ``[t * h * w / merge**2]`` (the processors' numpy arithmetic)."""
    t, h, w = (int(v) for v in grid)
    per_frame = h * w // merge_size**2
    return np.repeat(np.arange(t) * float(second_per_grid) * float(position_id_per_seconds), per_frame)


def video_placeholder_ids(
    grid: tuple[int, int, int],
    merge_size: int,
    tokens: VideoTokens,
    second_per_grid: float,
    *,
    audio_tokens: int | None,
    position_id_per_seconds: float,
    seconds_per_chunk: float,
) -> np.ndarray:
    """What one ``<|VIDEO|>`` placeholder expands to (step 4).

    Args:
        grid: the video's ``(t, h, w)`` patch grid.
        merge_size: the vision tower's spatial merge size.
        tokens: the token ids.
        second_per_grid: the video's ``video_second_per_grid``.
        audio_tokens: LLM tokens of the video's audio track (``use_audio_in_video``), or None: video tokens only.
        position_id_per_seconds, seconds_per_chunk: the thinker config's (the chunking of `get_rope_index`).
    Returns:
        int64 ``[L]``.
    """
    t, h, w = (int(v) for v in grid)
    per_frame = h * w // merge_size**2
    if audio_tokens is None:
        return np.full(t * per_frame, tokens.video, dtype=np.int64)
    # Temporal position of every video token, as the processor and get_rope_index compute it (cast to int there,
    # which cuts at the same integer chunk bounds).
    times = video_token_times(grid, merge_size, second_per_grid, position_id_per_seconds)
    video_times = times.astype(np.int64)
    per_chunk = int(position_id_per_seconds * seconds_per_chunk)
    video_chunks = _Thinker.get_chunked_index(None, video_times, per_chunk, 0)
    audio_chunks = _Thinker.get_chunked_index(None, np.arange(audio_tokens), per_chunk, 0)
    pieces = []
    for j in range(max(len(video_chunks), len(audio_chunks))):
        if j < len(video_chunks):
            pieces.append(np.full(video_chunks[j][1] - video_chunks[j][0], tokens.video))
        if j < len(audio_chunks):
            pieces.append(np.full(audio_chunks[j][1] - audio_chunks[j][0], tokens.audio))
    return tokens.with_audio(pieces)
