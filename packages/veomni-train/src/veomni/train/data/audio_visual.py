"""Audio-visual conversations (encoder kind ``audio_visual``: the omni thinkers, ``model.task: omni``): the
multimodal rows of `veomni.train.data.multimodal` plus audio parts ``{"type": "audio", "audio": <path>}`` and video
parts (files or frame lists, optionally with their audio tracks). Every model-specific rule comes from the model's
family declaration (`veomni.models.family.DataRules`): positions, video rule, audio token count, audio layout.

`AudioVisualEncoder` extends `MultimodalEncoder`:

1. The chat template renders each audio part as ``<|audio_bos|><|AUDIO|><|audio_eos|>`` and each video part as
   ``<|vision_bos|><|VIDEO|><|vision_eos|>`` (token names may differ: the audio placeholder is the tokenizer's
   declared ``audio_token``, else ``<|AUDIO|>``; the ids must be the model config's); the placeholder counts must
   equal the row's parts (an error names the row).
2. Each clip is decoded, resampled and turned into log-mel features by `veomni.train.data.audio` (the model's
   ``WhisperFeatureExtractor``, read from the tokenizer's directory), and its ``<|AUDIO|>`` expands to the model's
   ``audio_tokens(frames)`` untrained tokens (``DataRules.audio_tokens``: Qwen2.5-Omni's processor rule, or
   Qwen3-Omni-MoE's 13 tokens per 100 mel frames). Images expand exactly as for the other vision kinds.
3. Videos follow the model's video rule (``DataRules.video_rule``): frames sampled at ``data.video_fps``, else the
   video processor config's, else the processor's default, ``video_second_per_grid = temporal_patch_size / fps``,
   and each video placeholder becomes what the rule's ``placeholder_ids`` writes: ``t * h * w / merge**2`` video
   tokens, or with ``data.use_audio_in_video`` (every video's audio track decoded with PyAV, a video without one
   an error naming the file) the audio start token, the video and audio tokens interleaved by time, the audio end
   token -- the processor's ``load_audio_from_video`` layout (per ``seconds_per_chunk`` chunk for Qwen2.5-Omni,
   token by token for Qwen3-Omni-MoE, whose config names no audio end token: the tokenizer's ``audio_eos_token``
   is read). Clips are ordered as their tokens appear.
4. The mrope positions come from the model's own rule (``DataRules.positions``), with every clip's frame count, the
   video grids, seconds per grid and the audio-in-video flag; a rule that refuses a row (Qwen3-Omni-MoE's
   positions must be whole numbers) is an error naming it.
5. `AudioVisualMediaSample.collate_extra` (called by `collate_multimodal`) stacks the micro-batch's clips with
   `veomni.train.data.audio.collate_audio`: ``input_features`` / ``feature_attention_mask``, None without audio
   (the model then runs its audio tower's dummy forward), the audio tower's host-side tables (``audio_metadata``,
   where the model declares a ``DataRules.audio_layout``) and concatenates ``video_second_per_grid``.

The index (`measure`) decodes the audio (also the tracks of videos) to count its tokens; image and video sizes
come from headers: the length is exact, at the cost of reading every clip once more than the training pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from veomni.models.multimodal.video_tokens import VideoTokens
from veomni.train.data.audio import (
    audio_features,
    audio_name,
    audio_path,
    collate_audio,
    load_audio,
    load_video_audio,
)
from veomni.train.data.media import ImageRef, VideoRef, check_finite_values, load_video_frames
from veomni.train.data.multimodal import MediaSample, MultimodalEncoder, _expand
from veomni.train.data.sources import DataError, RowRef

AUDIO_TOKEN = "<|AUDIO|>"
"""The audio placeholder where the tokenizer declares no ``audio_token`` (Qwen2.5-Omni's name)."""


@attrs.frozen(eq=False)
class AudioVisualMediaSample(MediaSample):
    """`MediaSample` plus the row's audio clips and its videos' seconds per temporal grid step.

    Attributes:
        audio_features: float32 ``[num_mel_bins, frames_i]`` per clip, in text order (empty without audio).
        video_second_per_grid: float64 ``[v]``, one per video (the processor's ``video_second_per_grid``).
        audio_layout: the model's host-side audio chunk layout (``DataRules.audio_layout``), or None.
    """

    audio_features: tuple[np.ndarray, ...] = ()
    video_second_per_grid: np.ndarray = attrs.field(factory=lambda: np.zeros(0, dtype=np.float64))
    audio_layout: Any = None

    @staticmethod
    def collate_extra(media: Sequence[AudioVisualMediaSample]) -> dict[str, Any]:
        """``input_features`` float32 ``[clips, mels, frames]`` and ``feature_attention_mask`` int64 ``[clips,
        frames]`` of every clip of the micro-batch (`collate_audio`), ``audio_metadata`` (the tower's chunk tables
        from the samples' ``audio_layout``; None without a layout or a clip), and ``video_second_per_grid``
        float32 ``[videos]`` in ``video_grid_thw``'s order; each None without any clip / video. Nothing is sliced
        under SP (the audio tower slices its frames itself; the seconds only matter where positions are not
        given)."""
        seconds = np.concatenate([m.video_second_per_grid for m in media])
        clips = [f for m in media for f in m.audio_features]
        audio = collate_audio(clips)
        layout = media[0].audio_layout
        audio["audio_metadata"] = (
            None if layout is None or not clips
            else layout([f.shape[1] for f in clips], audio["input_features"].shape[2])
        )  # fmt: skip
        return {
            **audio,
            "video_second_per_grid": torch.from_numpy(seconds.astype(np.float32)) if seconds.size else None,
        }


def load_feature_extractor(path: str) -> Any:
    """The thinker's ``WhisperFeatureExtractor`` from ``path`` (``preprocessor_config.json``)."""
    from transformers import WhisperFeatureExtractor

    try:
        return WhisperFeatureExtractor.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise DataError(
            f"the model reads audio but {path} holds no loadable audio feature extractor (preprocessor_config.json): "
            f"{err}"
        ) from None


class AudioVisualEncoder(MultimodalEncoder):
    """Encodes audio-visual conversations (module docstring).

    Args:
        tokenizer, image_processor, field, loss_mask_field, assistant_only, media_root, max_patches,
            vision_metadata: as for `MultimodalEncoder`.
        feature_extractor: the model's audio feature extractor (`load_feature_extractor`).
        config: the model's config (token ids; the video rule's placeholder layout reads its timing).
        positions: the model's mrope rule, ``positions(ids, image_grid_thw, video_grid_thw, audio_frames,
            second_per_grid)`` -> int64 ``[3, n]``, built with ``use_audio_in_video``.
        audio_tokens: LLM tokens of one clip of ``frames`` mel frames.
        audio_layout: the audio tower's host-side chunk layout (``layout(frames, padded_frames)``), or None.
        video_rule: the model's video rule (``placeholder_ids``, ``temporal_patch_size``, ...), or why there is none
            (rows with videos are then refused with it).
        use_audio_in_video: interleave every video's audio track with its frames (``data.use_audio_in_video``).
    """

    extra_parts = ("audio",)

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        image_processor: Any,
        field: str,
        loss_mask_field: str | None,
        assistant_only: bool,
        *,
        feature_extractor: Any,
        config: Any,
        positions: Callable[..., np.ndarray],
        audio_tokens: Callable[[int], int],
        audio_layout: Callable[..., dict[str, Any]] | None = None,
        video_rule: Any = "no video processor was given",
        use_audio_in_video: bool = False,
        **kwargs: Any,
    ) -> None:
        # The base class sets up the timestamped video layout only; this one is set up below.
        super().__init__(
            tokenizer, image_processor, field, loss_mask_field, assistant_only, positions=positions, video_rule="",
            **kwargs,
        )  # fmt: skip
        # The processors read the tokenizer's declared audio token (Qwen3-Omni's is <|audio_pad|>); <|AUDIO|> is
        # Qwen2.5-Omni's name where the tokenizer declares none.
        self.audio_token = str(getattr(tokenizer, "audio_token", None) or AUDIO_TOKEN)
        self.audio_token_id = self._token_id(self.audio_token, "the model reads audio")
        for name, token_id in (
            ("audio_token_id", self.audio_token_id),
            ("image_token_id", self.image_token_id),
        ):
            if getattr(config, name) != token_id:
                raise DataError(
                    f"the model config's {name} is {getattr(config, name)} but the tokenizer gives "
                    f"{token_id}; they must be the same token"
                )
        self.feature_extractor = feature_extractor
        self.use_audio_in_video = use_audio_in_video
        self.audio_tokens, self.audio_layout = audio_tokens, audio_layout
        # The audio paths of the row being parsed: `_parse` collects them through `_extra_part` (one row at a
        # time; an encoder is used by one worker thread).
        self._audio_paths: list[str | bytes] = []
        # Placeholders are counted by the config's video token (the tokenizer may call it <|VIDEO|>).
        self.video_token_id = int(config.video_token_id)
        self.config = config
        self.video_rule, self.no_video = None, video_rule if isinstance(video_rule, str) else ""
        self.video_tokens = VideoTokens(
            self.video_token_id, self.audio_token_id, int(config.audio_start_token_id), self._audio_end_id(config),
        )  # fmt: skip
        if use_audio_in_video and self.video_tokens.audio_end is None:
            raise DataError(
                f"data.use_audio_in_video: a video's audio track ends with the audio end token, but the "
                f"{config.model_type} config has no audio_end_token_id and the tokenizer declares no "
                "audio_eos_token"
            )
        if not isinstance(video_rule, str):
            if (video_rule.merge_size, video_rule.patch_width) != (self.merge, self.width):
                self.no_video = (
                    f"the video processor (merge {video_rule.merge_size}, pixel rows of {video_rule.patch_width}) "
                    f"disagrees with the image processor (merge {self.merge}, pixel rows of {self.width}); both "
                    "feed one vision tower"
                )
            else:
                self.video_rule = video_rule

    def _audio_end_id(self, config: Any) -> int | None:
        """The audio end token id: the model config's (Qwen2.5-Omni), else the tokenizer's ``audio_eos_token``
        (Qwen3-Omni-MoE's config names none; its processor reads the tokenizer's), else None."""
        end = getattr(config, "audio_end_token_id", None)
        if end is not None:
            return int(end)
        name = getattr(self.tokenizer, "audio_eos_token", None)
        return None if name is None else self._token_id(str(name), "the tokenizer's audio_eos_token is set")

    def _extra_part(self, kind: str, part: dict[str, Any], ref: RowRef) -> None:
        self._audio_paths.append(audio_path(part["audio"], self.media_root, ref, len(self._audio_paths)))

    def _layout(self, row: dict[str, Any], ref: RowRef) -> _Layout:
        """The row's tokens, its images, and its audio and video expanded (audio decoded; no pixels)."""
        self._audio_paths = []
        ids, trained, images, videos = self._text(row, ref)
        paths = self._audio_paths
        audio_at = np.flatnonzero(ids == self.audio_token_id).tolist()
        if len(audio_at) != len(paths):
            raise DataError(
                f"{ref}: {len(audio_at)} {self.audio_token} placeholder(s) in the rendered conversation but {len(paths)} "
                "audio part(s) in the row; they must match one to one"
            )
        plans = [self._video_plan(video) for video in videos]
        video_at = np.flatnonzero(ids == self.video_token_id).tolist()
        rate = int(self.feature_extractor.sampling_rate)
        # Clips in text order (the order of the audio tower's outputs over the audio tokens, and of get_rope_index's
        # audio lengths): standalone parts and, with audio-in-video, each video's track at its placeholder.
        sources = [(at, "audio", k) for k, at in enumerate(audio_at)]
        if self.use_audio_in_video:
            sources += [(at, "video", k) for k, at in enumerate(video_at)]
        sources.sort()
        clips, names = [], []
        for _, kind, k in sources:
            if kind == "audio":
                clips.append(load_audio(paths[k], rate, ref, k))
                names.append(audio_name(paths[k]))
            else:
                clips.append(self._video_audio(videos[k], rate))
                names.append(f"the audio track of video {k} ({videos[k].path})")
        features, tokens = audio_features(clips, self.feature_extractor, ref, names, self.audio_tokens)
        for name, n, clip in zip(names, tokens, features, strict=True):
            if n < 1:
                # The tower's convolutions and pooling leave nothing of it: it cannot be placed in the sequence.
                raise DataError(
                    f"{ref}: {name} is too short for the audio tower ({clip.shape[1]} feature frames give {n} audio "
                    "tokens; at least 1 is needed)"
                )
        clip_tokens = {(kind, k): n for (_, kind, k), n in zip(sources, tokens, strict=True)}
        seconds = [self._second_per_grid(video) for video in videos]
        replacements = [(at, np.full(clip_tokens["audio", k], self.audio_token_id, np.int64))
                        for k, at in enumerate(audio_at)]  # fmt: skip
        assert self.video_rule is not None or not video_at  # _video_ref refused the row otherwise
        for k, at in enumerate(video_at):
            block = self.video_rule.placeholder_ids(
                plans[k][2], self.video_tokens, seconds[k], audio_tokens=clip_tokens.get(("video", k)),
                thinker_config=self.config,
            )  # fmt: skip
            replacements.append((at, block))
        trained = trained & (ids != self.audio_token_id)
        return _Layout(ids, trained, images, videos, plans, replacements, features, seconds)

    def _video_plan(self, video: VideoRef) -> tuple[Any, np.ndarray, tuple[int, int, int]]:
        try:
            return super()._video_plan(video)
        except DataError:
            raise
        except ValueError as err:  # the sampling rule refuses the clip (fewer frames than one temporal patch)
            raise DataError(f"{video}: {err}") from None

    def _video_audio(self, video: VideoRef, rate: int) -> np.ndarray:
        if video.path is None:
            raise DataError(
                f"{video}: data.use_audio_in_video is on but the video is a list of frame images, which has no "
                "audio track; give a video file or turn it off"
            )
        return load_video_audio(video.path, rate, str(video))

    def _second_per_grid(self, video: VideoRef) -> float:
        """The processor's ``video_second_per_grid``: temporal patch over the sampling fps (a frame list's own)."""
        assert self.video_rule is not None  # _video_ref refused the row otherwise
        return self.video_rule.temporal_patch_size / (video.fps or self.video_rule.fps)

    def measure(self, row: dict[str, Any], ref: RowRef) -> tuple[int, int, int]:
        """``(tokens, trained tokens, vision patches)`` of the expanded row (audio decoded, images and videos from
        headers)."""
        layout = self._layout(row, ref)
        patches = [self._patches(image) for image in layout.images]
        patches += [int(np.prod(grid)) for _, _, grid in layout.plans]
        self._check_patches(ref, patches, [*layout.images, *layout.videos])
        extra = sum(p // self.merge**2 - 1 for p in patches[: len(layout.images)])
        extra += sum(len(block) - 1 for _, block in layout.replacements)
        return len(layout.ids) + extra, int(layout.trained.sum()), sum(patches)

    def __call__(
        self, row: dict[str, Any], ref: RowRef
    ) -> tuple[np.ndarray, np.ndarray, AudioVisualMediaSample]:
        layout = self._layout(row, ref)
        pixels, grids = self._image_rows(ref, layout.images)
        video_rows, video_grids = [], []
        for video, (header, indices, grid) in zip(layout.videos, layout.plans, strict=True):
            assert self.video_rule is not None
            rows, got = self.video_rule.pixel_rows(load_video_frames(video, indices, header))
            check_finite_values(np.asarray(rows), str(video), "pixel values")
            if got != grid:  # the plan and the processing share one rule; a mismatch is a bug, not bad data
                raise RuntimeError(f"{video}: processed grid {got} differs from the planned grid {grid}")
            video_rows.append(rows)
            video_grids.append(grid)
        self._check_patches(
            ref, [int(g.prod()) for g in grids] + [int(np.prod(g)) for g in video_grids],
            [*layout.images, *layout.videos],
        )  # fmt: skip
        blocks = [np.full(int(g.prod()) // self.merge**2, self.image_token_id, np.int64) for g in grids]
        where = np.flatnonzero(layout.ids == self.image_token_id).tolist()
        replacements = sorted([*zip(where, blocks, strict=True), *layout.replacements], key=lambda r: r[0])
        ids, trained = _expand(layout.ids, layout.trained, replacements)
        video_grid_thw = np.asarray(video_grids, dtype=np.int64).reshape(-1, 3)
        seconds = np.asarray(layout.seconds, dtype=np.float64)
        frames = np.asarray([f.shape[1] for f in layout.features], dtype=np.int64)
        try:
            mrope = self.positions(ids, grids, video_grid_thw, frames, seconds)
        except ValueError as err:
            raise DataError(f"{ref}: {err}") from None
        video_pixels = np.concatenate(video_rows) if video_rows else np.zeros((0, self.width), np.float32)
        return ids, trained, AudioVisualMediaSample(
            pixels, grids, mrope, video_pixels, video_grid_thw, audio_features=tuple(layout.features),
            video_second_per_grid=seconds, audio_layout=self.audio_layout,
        )  # fmt: skip


@attrs.frozen(eq=False)
class _Layout:
    """One row before image expansion (`AudioVisualEncoder._layout`): ``replacements`` are ``(position in ids, block)``
    for every audio and video placeholder; ``plans`` ``(header, frame indices, grid)`` per video; ``features`` the
    clips' log-mel features in text order; ``seconds`` each video's ``video_second_per_grid``."""

    ids: np.ndarray
    trained: np.ndarray
    images: list[ImageRef]
    videos: list[VideoRef]
    plans: list[tuple[Any, np.ndarray, tuple[int, int, int]]]
    replacements: list[tuple[int, np.ndarray]]
    features: list[np.ndarray]
    seconds: list[float]
