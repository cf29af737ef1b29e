"""Audio parts of multimodal rows (``{"type": "audio", "audio": <path>}``) for audio-visual models (the omni
thinkers).

Decoding needs the ``veomni-train[audio]`` extra: soundfile reads the file (any channel count, averaged to mono),
scipy's polyphase filter resamples it to the feature extractor's ``sampling_rate``. The model's feature extractor
(Whisper-style log-mel) then gives ``[num_mel_bins, frames]`` per clip, computed exactly as
``Qwen2_5OmniProcessor`` does (padded to the extractor's window, then cut to the clip's valid frames, so the
last frames match the processor bit for bit), and each clip's placeholder expands to the model's
``audio_tokens(frames)`` audio tokens (its family's ``DataRules.audio_tokens``; Qwen2.5-Omni's is transformers'
``_get_feat_extract_output_lengths``).

The audio track of a video file (``data.use_audio_in_video``, `load_video_audio`) is decoded with PyAV (the
``veomni-train[video]`` extra) and then averaged and resampled the same way.

Bad input is an error naming the file and the row: an unreadable file, a missing extra, a clip longer than the
extractor's window (``chunk_length`` seconds: the processor would silently truncate it, and the tokens after the
cut would train on audio the model never heard).

Collate rule (`collate_audio`): clips of a micro-batch are stacked along a new clip axis, frames right-padded to
the longest clip with ``feature_attention_mask`` 0 there; a micro-batch without any clip gives ``None`` for both,
and the model runs its audio tower's dummy forward instead (never a silently skipped tower).
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from veomni.train.data.media import check_finite_values
from veomni.train.data.sources import DataError, RowRef


def audio_path(value: Any, media_root: str | None, ref: RowRef, number: int) -> str | bytes:
    """Audio part ``number`` of row ``ref``: its absolute path (relative paths are joined to ``media_root``), or
    its inline bytes (an encoded file, e.g. an OpenAI ``input_audio`` part's decoded base64)."""
    if isinstance(value, bytes | bytearray) and value:
        return bytes(value)
    if not isinstance(value, str) or not value:
        raise DataError(f"{ref}: audio {number} must be a file path (str) or bytes, found {value!r:.80}")
    if os.path.isabs(value):
        return value
    if media_root is None:
        raise DataError(
            f"{ref}: audio {number} has the relative path {value!r} but data.media_root is not set"
        )
    return os.path.join(media_root, value)


def audio_name(source: str | bytes) -> str:
    """How messages name an audio part's source: its path, or ``inline bytes (N B)``."""
    return source if isinstance(source, str) else f"inline bytes ({len(source)} B)"


def load_audio(source: str | bytes, sampling_rate: int, ref: RowRef, number: int) -> np.ndarray:
    """Decode ``source`` to mono float32 samples at ``sampling_rate`` Hz.

    Args:
        source: an audio file soundfile can read (wav, flac, ogg, ...), as a path or its bytes.
        sampling_rate: the feature extractor's rate; other rates are resampled (polyphase, scipy).
        ref, number: the row and the part's index among the row's audio parts (for errors).
    Returns:
        float32 ``[samples]``.
    Raises:
        DataError: naming the row and the file: a missing file, one that does not decode, or samples that are
            not finite (NaN or Inf, which would reach the loss as a diverged step naming no file).
    """
    name = audio_name(source)
    try:
        import soundfile
        from scipy.signal import resample_poly
    except ImportError as err:
        raise DataError(
            f"{ref}: audio {number} ({name}) needs the audio extra (pip install 'veomni-train[audio]'): {err}"
        ) from None
    if isinstance(source, str) and not os.path.isfile(source):
        raise DataError(f"{ref}: audio {number}: no such audio file: {source}")
    try:
        samples, rate = soundfile.read(
            source if isinstance(source, str) else io.BytesIO(source), dtype="float32", always_2d=True
        )
    except (OSError, RuntimeError, soundfile.LibsndfileError) as err:
        raise DataError(f"{ref}: audio {number} ({name}) cannot be decoded: {err}") from None
    return _mono_at(samples, int(rate), sampling_rate, resample_poly, f"{ref}: audio {number} ({name})")


def _mono_at(samples: np.ndarray, rate: int, sampling_rate: int, resample_poly: Any, what: str) -> np.ndarray:
    """float32 ``[samples]``: ``samples`` ``[n, channels]`` averaged to mono and resampled to ``sampling_rate``."""
    check_finite_values(samples, what, "samples")
    mono = samples.mean(axis=1)
    if rate != sampling_rate:
        # Exact rational ratio (44100 -> 16000 is 160/441): no drift in length, anti-aliased by the filter.
        g = math.gcd(rate, int(sampling_rate))
        mono = resample_poly(mono, sampling_rate // g, rate // g)
    if mono.size == 0:
        raise DataError(f"{what} holds no samples")
    return mono.astype(np.float32, copy=False)


def load_video_audio(path: str, sampling_rate: int, what: str) -> np.ndarray:
    """Decode the audio track of the video file ``path`` to mono float32 samples at ``sampling_rate`` Hz (the
    processor's ``load_audio_from_video``; its first audio stream, as ffmpeg picks it).

    Needs PyAV (``veomni-train[video]``) and scipy (``veomni-train[audio]``) for the resampling.

    Args:
        path: a video container with an audio stream (mp4, mkv, mov, ...).
        sampling_rate: the feature extractor's rate; other rates are resampled (polyphase, as `load_audio`).
        what: how errors name the video, e.g. ``rows.jsonl line 4: video 0 (clip.mp4)``.
    Returns:
        float32 ``[samples]``.
    Raises:
        DataError: a missing extra, an unreadable file, or no audio stream (audio-in-video was asked for).
    """
    try:
        import av
        from scipy.signal import resample_poly
    except ImportError as err:
        raise DataError(
            f"{what}: its audio track needs PyAV and scipy (pip install 'veomni-train[video,audio]'): {err}"
        ) from None
    try:
        with av.open(path) as container:
            if not container.streams.audio:
                raise DataError(
                    f"{what}: the file holds no audio stream, but data.use_audio_in_video is on (every video's "
                    "audio track is interleaved with its frames); give a video with sound or turn it off"
                )
            stream = container.streams.audio[0]
            rate = int(stream.rate or stream.codec_context.sample_rate or 0)
            # Planar float, [channels, n] per frame: the decoder's own samples, converted only to float32.
            resampler = av.AudioResampler(format="fltp", layout=stream.layout.name, rate=rate)
            chunks = [
                out.to_ndarray() for frame in container.decode(stream) for out in resampler.resample(frame)
            ]
            chunks += [out.to_ndarray() for out in resampler.resample(None)]
    except (av.FFmpegError, OSError) as err:
        raise DataError(f"{what}: its audio track cannot be decoded ({err})") from None
    if rate <= 0 or not chunks:
        raise DataError(f"{what}: the audio track holds no samples (rate {rate})")
    samples = np.concatenate(chunks, axis=1).T.astype(np.float32, copy=False)  # [n, channels]
    return _mono_at(samples, rate, sampling_rate, resample_poly, f"{what}: the audio track")


def audio_features(
    clips: Sequence[np.ndarray],
    feature_extractor: Any,
    ref: RowRef,
    paths: Sequence[str],
    audio_tokens: Callable[[int], int],
) -> tuple[list[np.ndarray], list[int]]:
    """Log-mel features and LLM token counts of a row's clips, as ``Qwen2_5OmniProcessor`` computes them.

    Args:
        clips: float32 ``[samples]`` per clip at ``feature_extractor.sampling_rate`` (`load_audio`).
        feature_extractor: the model's feature extractor (``WhisperFeatureExtractor``: ``n_samples``,
            ``chunk_length``, ``sampling_rate``).
        ref, paths: the row and each clip's file (for errors).
        audio_tokens: the model's LLM tokens of one clip of ``frames`` mel frames (``DataRules.audio_tokens``).
    Returns:
        ``(features, tokens)``: float32 ``[num_mel_bins, frames]`` per clip, and its number of audio tokens.
    """
    limit = int(feature_extractor.n_samples)
    features, tokens = [], []
    for number, (clip, path) in enumerate(zip(clips, paths, strict=True)):
        if clip.shape[0] > limit:
            rate = feature_extractor.sampling_rate
            raise DataError(
                f"{ref}: audio {number} ({path}) lasts {clip.shape[0] / rate:.2f} s, longer than the audio "
                f"encoder's input window of {limit / rate:.2f} s (feature extractor chunk_length); split or trim it"
            )
        out = feature_extractor(
            clip,
            sampling_rate=feature_extractor.sampling_rate,
            padding="max_length",
            return_attention_mask=True,
            return_tensors="np",
        )
        frames = int(out["attention_mask"][0].sum())
        check_finite_values(
            out["input_features"][0, :, :frames], f"{ref}: audio {number} ({path})", "features"
        )
        features.append(np.asarray(out["input_features"][0, :, :frames], dtype=np.float32))
        tokens.append(int(audio_tokens(frames)))
    return features, tokens


def collate_audio(features: Sequence[np.ndarray]) -> dict[str, torch.Tensor | None]:
    """The micro-batch's audio tensors from every clip of its samples, in order.

    Args:
        features: float32 ``[num_mel_bins, frames_i]`` per clip (any number, also 0).
    Returns:
        ``input_features`` float32 ``[clips, num_mel_bins, max frames]`` (zero-padded) and
        ``feature_attention_mask`` int64 ``[clips, max frames]``; both None without any clip.
    """
    if not features:
        return {"input_features": None, "feature_attention_mask": None}
    bins = {f.shape[0] for f in features}
    if len(bins) != 1:
        raise ValueError(f"collate_audio: clips disagree on the mel bins: {sorted(bins)}")
    width = max(f.shape[1] for f in features)
    stacked = np.zeros((len(features), bins.pop(), width), dtype=np.float32)
    mask = np.zeros((len(features), width), dtype=np.int64)
    for i, f in enumerate(features):
        stacked[i, :, : f.shape[1]] = f
        mask[i, : f.shape[1]] = 1
    return {"input_features": torch.from_numpy(stacked), "feature_attention_mask": torch.from_numpy(mask)}
