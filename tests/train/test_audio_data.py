"""Audio parts of omni rows: decoding + resampling (real soundfile / scipy), the processor's log-mel features,
placeholder expansion lengths, the collate rule, clear errors naming file and row, and that audio reaches the
loss of a real (tiny) Qwen2.5-Omni thinker."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from models.test_qwen2_5_omni import A_END, A_START, AUDIO, MELS, tiny_config
from transformers import WhisperFeatureExtractor
from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import _get_feat_extract_output_lengths

from veomni.models.qwen2_5_omni.data_rules import audio_tokens
from veomni.models.qwen2_5_omni.generated import patched_modeling_qwen2_5_omni as ours
from veomni.train.data.audio import audio_features, audio_path, collate_audio, load_audio
from veomni.train.data.sources import DataError, RowRef, bad_row_kind

# soundfile comes with the [audio] extra (in the dev group): without it these tests skip instead of failing collection.
soundfile = pytest.importorskip("soundfile")
REF = RowRef("rows.jsonl", 3, 4)
RATE = 16000


def tone(path, hz: float, seconds: float, rate: int, channels: int = 1) -> str:
    t = np.arange(int(seconds * rate)) / rate
    wave = (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)
    soundfile.write(str(path), np.stack([wave] * channels, axis=1), rate)
    return str(path)


def extractor(chunk_seconds: int = 2) -> WhisperFeatureExtractor:
    return WhisperFeatureExtractor(feature_size=MELS, sampling_rate=RATE, chunk_length=chunk_seconds)


def test_decoding_resamples_to_the_extractor_rate_and_keeps_the_pitch(tmp_path):
    path = tone(tmp_path / "a.wav", 440.0, 0.5, 44100, channels=2)
    samples = load_audio(path, RATE, REF, 0)
    assert samples.dtype == np.float32 and samples.shape == (8000,)
    spectrum = np.abs(np.fft.rfft(samples))
    assert abs(np.argmax(spectrum) * RATE / samples.size - 440.0) < 3.0


def test_features_match_the_processor_and_expand_to_its_token_count(tmp_path):
    fe = extractor()
    clip = load_audio(tone(tmp_path / "b.wav", 300.0, 0.73, RATE), RATE, REF, 0)
    (features,), (tokens,) = audio_features([clip], fe, REF, ["b.wav"], audio_tokens)
    ref = fe(clip, sampling_rate=RATE, padding="max_length", return_attention_mask=True, return_tensors="np")
    frames = int(ref["attention_mask"].sum())
    assert features.shape == (MELS, frames) and frames == 73
    np.testing.assert_array_equal(features, ref["input_features"][0, :, :frames])
    assert tokens == int(_get_feat_extract_output_lengths(frames)) == 18


def test_collate_pads_frames_and_masks_them():
    a, b = np.ones((MELS, 5), np.float32), np.full((MELS, 9), 2.0, np.float32)
    out = collate_audio([a, b])
    assert (
        out["input_features"].shape == (2, MELS, 9)
        and out["feature_attention_mask"].tolist()[0] == [1] * 5 + [0] * 4
    )
    assert float(out["input_features"][0, :, 5:].abs().sum()) == 0.0
    assert collate_audio([]) == {"input_features": None, "feature_attention_mask": None}
    with pytest.raises(ValueError, match=r"disagree on the mel bins: \[4, 16\]"):
        collate_audio([a, np.ones((4, 3), np.float32)])


def test_bad_audio_names_file_and_row(tmp_path):
    broken = tmp_path / "broken.wav"
    broken.write_bytes(b"RIFF not really a wave file")
    with pytest.raises(DataError, match=r"rows.jsonl line 4: audio 1 \(.*broken.wav\) cannot be decoded"):
        load_audio(str(broken), RATE, REF, 1)
    long = load_audio(tone(tmp_path / "long.wav", 200.0, 2.5, RATE), RATE, REF, 0)
    with pytest.raises(DataError, match=r"line 4: audio 0 \(long.wav\) lasts 2.50 s, longer than .* 2.00 s"):
        audio_features([long], extractor(), REF, ["long.wav"], audio_tokens)
    with pytest.raises(DataError, match="relative path 'x.wav' but data.media_root is not set"):
        audio_path("x.wav", None, REF, 0)
    assert audio_path("x.wav", "/media", REF, 0) == "/media/x.wav"


def test_a_row_with_audio_changes_the_thinker_loss(tmp_path):
    """Same token ids, a 440 Hz tone vs silence of the same length: the audio reaches the loss."""
    fe = extractor()
    torch.manual_seed(0)
    model = ours.Qwen2_5OmniThinkerForConditionalGeneration(tiny_config()).eval()
    losses = []
    for name, hz in (("tone.wav", 440.0), ("quiet.wav", 0.0)):
        clip = load_audio(tone(tmp_path / name, hz, 0.4, RATE), RATE, REF, 0)
        features, tokens = audio_features([clip], fe, REF, [name], audio_tokens)
        ids = torch.tensor([[5, 6, A_START] + [AUDIO] * tokens[0] + [A_END, 7, 8, 9]])
        batch = collate_audio(features)
        labels = ids.masked_fill(ids >= AUDIO, -100)
        losses.append(model(input_ids=ids, labels=labels, **batch).loss)
    assert not torch.allclose(losses[0], losses[1])


def test_a_missing_audio_file_is_named_not_a_system_error(tmp_path):
    gone = str(tmp_path / "gone.wav")
    with pytest.raises(DataError, match=f"^rows.jsonl line 4: audio 2: no such audio file: {gone}$") as info:
        load_audio(gone, RATE, REF, 2)
    assert bad_row_kind(str(info.value)) == "missing audio file"


def test_non_finite_samples_are_a_bad_row_naming_the_file(tmp_path):
    wave = np.full(800, 0.25, dtype=np.float32)
    wave[17], wave[40] = np.nan, np.inf
    path = tmp_path / "nan.wav"
    soundfile.write(str(path), wave, RATE, subtype="FLOAT")
    pattern = rf"rows.jsonl line 4: audio 0 \({path}\): 2 of its 800 samples are not finite \(NaN or Inf\)"
    with pytest.raises(DataError, match=pattern) as info:
        load_audio(str(path), RATE, REF, 0)
    assert bad_row_kind(str(info.value)) == "non-finite media values"


def test_inline_audio_bytes_decode_as_the_file_does(tmp_path):
    path = tone(tmp_path / "c.wav", 330.0, 0.3, 8000)
    data = (tmp_path / "c.wav").read_bytes()
    assert audio_path(data, None, REF, 0) == data
    np.testing.assert_array_equal(load_audio(data, RATE, REF, 0), load_audio(path, RATE, REF, 0))
    with pytest.raises(DataError, match=r"audio 0 \(inline bytes \(3 B\)\) cannot be decoded"):
        load_audio(b"abc", RATE, REF, 0)
