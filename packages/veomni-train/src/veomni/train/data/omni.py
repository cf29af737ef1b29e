"""Omni conversations (``data.kind: multimodal`` with ``model.task: omni``): the multimodal rows of
`veomni.train.data.multimodal` plus audio parts ``{"type": "audio", "audio": <path>}`` for the Qwen2.5-Omni thinker.

`OmniEncoder` extends `MultimodalEncoder`:

1. The chat template renders each audio part as ``<|audio_bos|><|AUDIO|><|audio_eos|>``; the ``<|AUDIO|>`` count
   must equal the row's audio parts (an error names the row).
2. Each clip is decoded, resampled and turned into log-mel features by `veomni.train.data.audio` (the model's
   ``WhisperFeatureExtractor``, read from the tokenizer's directory), and its ``<|AUDIO|>`` expands to
   ``_get_feat_extract_output_lengths(frames)`` untrained tokens, as ``Qwen2_5OmniProcessor`` does. Images then
   expand exactly as for Qwen3-VL / Qwen2.5-VL rows; videos are refused (`veomni.train.tasks.VlmTask.no_video`).
3. The mrope positions come from the thinker's own rule (`veomni.models.qwen2_5_omni.positions`, or
   `veomni.models.qwen3_omni_moe.positions` for the Qwen3-Omni-MoE thinker, whose audio tower also has its own
   token rule: 13 tokens per 100 mel frames), with every clip's frame count.
4. `OmniMediaSample.collate_extra` (called by `collate_multimodal`) stacks the micro-batch's clips with
   `veomni.train.data.audio.collate_audio`: ``input_features`` / ``feature_attention_mask``, None without audio
   (the thinker then runs its audio tower's dummy forward).

The index (`measure`) decodes the audio to count its tokens (image sizes still come from headers): the length
is exact, at the cost of reading every clip once more than the training pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
from transformers import PreTrainedTokenizerBase

from veomni.models.qwen2_5_omni.positions import Qwen2_5OmniPositions
from veomni.models.qwen3_omni_moe.positions import Qwen3OmniMoePositions
from veomni.train.data.audio import audio_features, audio_path, collate_audio, load_audio
from veomni.train.data.multimodal import MediaSample, MultimodalEncoder, _expand
from veomni.train.data.sources import DataError, RowRef

AUDIO_TOKEN = "<|AUDIO|>"

POSITIONS = {"qwen2_5_omni_thinker": Qwen2_5OmniPositions, "qwen3_omni_moe_thinker": Qwen3OmniMoePositions}
"""Thinker ``model_type`` -> its picklable host-side rules: mrope positions (``__call__``) and, where the audio
tower's token rule is not Qwen2.5-Omni's (`veomni.train.data.audio.audio_features`), ``audio_tokens(frames)``."""


def thinker_positions(thinker_config: Any) -> Any:
    """The position-id function of the thinker ``thinker_config`` describes (an error lists the known ones)."""
    model_type = getattr(thinker_config, "model_type", None)
    if model_type not in POSITIONS:
        raise DataError(f"model.task is omni: expected a thinker of {sorted(POSITIONS)}, found {model_type!r}")
    return POSITIONS[model_type](thinker_config)


@attrs.frozen(eq=False)
class OmniMediaSample(MediaSample):
    """`MediaSample` plus the row's audio clips.

    Attributes:
        audio_features: float32 ``[num_mel_bins, frames_i]`` per clip, in row order (empty without audio).
    """

    audio_features: tuple[np.ndarray, ...] = ()

    @staticmethod
    def collate_extra(media: Sequence[OmniMediaSample]) -> dict[str, Any]:
        """``input_features`` float32 ``[clips, mels, frames]`` and ``feature_attention_mask`` int64 ``[clips,
        frames]`` of every clip of the micro-batch (`collate_audio`), both None without any clip; not sliced
        under SP (the audio tower slices its frames itself)."""
        return collate_audio([f for m in media for f in m.audio_features])


def load_feature_extractor(path: str) -> Any:
    """The thinker's ``WhisperFeatureExtractor`` from ``path`` (``preprocessor_config.json``)."""
    from transformers import WhisperFeatureExtractor

    try:
        return WhisperFeatureExtractor.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise DataError(
            f"model.task is omni but {path} holds no loadable audio feature extractor (preprocessor_config.json): "
            f"{err}"
        ) from None


class OmniEncoder(MultimodalEncoder):
    """Encodes omni conversations (module docstring).

    Args:
        tokenizer, image_processor, field, loss_mask_field, assistant_only, media_root, max_patches, video_rule,
            vision_metadata: as for `MultimodalEncoder`.
        feature_extractor: the thinker's audio feature extractor (`load_feature_extractor`).
        thinker_config: the ``Qwen2_5OmniThinkerConfig`` (token ids and the position rule).
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
        thinker_config: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__(tokenizer, image_processor, field, loss_mask_field, assistant_only, **kwargs)
        self.audio_token_id = self._token_id(AUDIO_TOKEN, "model.task is omni")
        for name, token_id in (("audio_token_id", self.audio_token_id), ("image_token_id", self.image_token_id)):
            if getattr(thinker_config, name) != token_id:
                raise DataError(
                    f"the thinker config's {name} is {getattr(thinker_config, name)} but the tokenizer gives "
                    f"{token_id}; they must be the same token"
                )
        self.feature_extractor = feature_extractor
        self.positions = thinker_positions(thinker_config)
        # The audio paths of the row being parsed: `_parse` collects them through `_extra_part` (one row at a
        # time; an encoder is used by one worker thread).
        self._audio_paths: list[str] = []

    def _extra_part(self, kind: str, part: dict[str, Any], ref: RowRef) -> None:
        self._audio_paths.append(audio_path(part["audio"], self.media_root, ref, len(self._audio_paths)))

    def _audio_text(self, row: dict[str, Any], ref: RowRef) -> tuple[np.ndarray, np.ndarray, list, list, list]:
        """``(ids, trained, images, videos, clip features)`` with every ``<|AUDIO|>`` already expanded."""
        self._audio_paths = []
        ids, trained, images, videos = self._text(row, ref)
        paths = self._audio_paths
        where = np.flatnonzero(ids == self.audio_token_id)
        if len(where) != len(paths):
            raise DataError(
                f"{ref}: {len(where)} {AUDIO_TOKEN} placeholder(s) in the rendered conversation but {len(paths)} "
                "audio part(s) in the row; they must match one to one"
            )
        rate = int(self.feature_extractor.sampling_rate)
        clips = [load_audio(p, rate, ref, k) for k, p in enumerate(paths)]
        features, tokens = audio_features(clips, self.feature_extractor, ref, paths)
        if hasattr(self.positions, "audio_tokens"):  # Qwen3-Omni: 13 tokens per 100-frame chunk
            tokens = [self.positions.audio_tokens(f.shape[1]) for f in features]
        blocks = [np.full(n, self.audio_token_id, np.int64) for n in tokens]
        ids, trained = _expand(ids, trained & (ids != self.audio_token_id), list(zip(where.tolist(), blocks, strict=True)))
        return ids, trained, images, videos, features

    def measure(self, row: dict[str, Any], ref: RowRef) -> tuple[int, int, int]:
        """``(tokens, trained tokens, vision patches)`` of the expanded row (audio decoded, images from headers)."""
        ids, trained, images, videos, _ = self._audio_text(row, ref)
        if videos:
            raise DataError(f"{ref}: video parts cannot be encoded for the omni thinker: {self.no_video}")
        patches = [self._patches(image) for image in images]
        self._check_patches(ref, patches, images)
        return len(ids) + sum(p // self.merge**2 - 1 for p in patches), int(trained.sum()), sum(patches)

    def __call__(self, row: dict[str, Any], ref: RowRef) -> tuple[np.ndarray, np.ndarray, OmniMediaSample]:
        ids, trained, images, videos, features = self._audio_text(row, ref)
        if videos:
            raise DataError(f"{ref}: video parts cannot be encoded for the omni thinker: {self.no_video}")
        pixels, grids = self._image_rows(ref, images)
        self._check_patches(ref, [int(g.prod()) for g in grids], images)
        blocks = [np.full(int(g.prod()) // self.merge**2, self.image_token_id, np.int64) for g in grids]
        where = np.flatnonzero(ids == self.image_token_id).tolist()
        ids, trained = _expand(ids, trained, list(zip(where, blocks, strict=True)))
        frames = np.asarray([f.shape[1] for f in features], dtype=np.int64)
        try:
            mrope = self.positions(ids, grids, None, frames)
        except ValueError as err:
            raise DataError(f"{ref}: {err}") from None
        return ids, trained, OmniMediaSample(pixels, grids, mrope, audio_features=tuple(features))
