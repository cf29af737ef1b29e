"""Write the omni quickstart assets of veomni-train: synthetic tones, conversations about them and a Qwen2.5-Omni
thinker-style processor directory.

Usage: ``uv run python tools/make_quickstart_omni_data.py [--out DIR]`` (default: the package's
``veomni/train/assets/quickstart_omni``). A seeded ``random.Random`` chooses everything, so running it again
reproduces the rows; the FLAC files are lossless encodings of seeded samples.

What is written:
    audio/*.flac             8 kHz mono tones, 0.3 to 0.9 s, of one of four pitches (low 200 Hz, middle 400 Hz,
                             high 800 Hz, very high 1600 Hz), at a random loudness and phase (the pipeline
                             resamples them to the extractor's 16 kHz).
    train.jsonl, eval.jsonl  ``{"messages": [...]}`` rows whose user content is an ``{"type": "audio", "audio":
                             "audio/NAME.flac"}`` part and a question; the answer names the pitch. Eval clips are
                             never in the training rows.
    processor/               the quickstart tokenizer plus the vision and audio special tokens (ids 1024..1030),
                             a ChatML template rendering audio parts as ``<|audio_bos|><|AUDIO|><|audio_eos|>`` (as
                             Qwen2.5-Omni's does) and one ``preprocessor_config.json`` holding a PIL image processor
                             and a 32-bin Whisper feature extractor with a 1 s window (the released thinker's file
                             also holds both).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "packages/veomni-train/src/veomni/train/assets"
DEFAULT_OUT = ASSETS / "quickstart_omni"
TEXT_TOKENIZER = ASSETS / "quickstart" / "tokenizer"
SPECIAL = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>", "<|audio_bos|>", "<|AUDIO|>",
           "<|audio_eos|>"]  # fmt: skip
TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'image' %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}{%- elif part['type'] == 'audio' %}"
    "{{- '<|audio_bos|><|AUDIO|><|audio_eos|>' }}{%- else %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
PITCHES = {"low": 200.0, "middle": 400.0, "high": 800.0, "very high": 1600.0}
QUESTIONS = ["Which tone is this?", "How high is this tone?", "Name the pitch."]
RATE, MELS = 16000, 32
FILE_RATE = 8000  # the files are 8 kHz: the pipeline resamples them to the extractor's 16 kHz


def write_processor(out: Path) -> None:
    from transformers import AutoTokenizer, WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(str(TEXT_TOKENIZER))
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    assert tokenizer.convert_tokens_to_ids(SPECIAL) == list(range(1024, 1031))
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(out)
    Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2).save_pretrained(out)
    image = json.loads((out / "preprocessor_config.json").read_text())
    audio = WhisperFeatureExtractor(
        feature_size=MELS, sampling_rate=RATE, hop_length=160, chunk_length=1
    ).to_dict()
    audio.pop("mel_filters", None)  # recomputed from the sizes on load
    (out / "preprocessor_config.json").write_text(
        json.dumps({**audio, **image}, indent=2, sort_keys=True) + "\n"
    )


def write_clip(path: Path, rng: random.Random, hz: float) -> None:
    import numpy as np
    import soundfile

    n = int(FILE_RATE * rng.uniform(0.3, 0.9))
    t = np.arange(n) / FILE_RATE
    wave = rng.uniform(0.2, 0.6) * np.sin(2 * np.pi * hz * t + rng.uniform(0, 6.28))
    soundfile.write(path, wave.astype(np.float32), FILE_RATE, format="FLAC", subtype="PCM_16")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    out = parser.parse_args(argv).out
    (out / "audio").mkdir(parents=True, exist_ok=True)
    write_processor(out / "processor")
    rng = random.Random(0)
    for split, count in (("train", 64), ("eval", 12)):
        rows = []
        for i in range(count):
            name = rng.choice(list(PITCHES))
            clip = f"audio/{split}_{i:03d}.flac"
            write_clip(out / clip, rng, PITCHES[name])
            rows.append({"messages": [
                {"role": "user", "content": [{"type": "audio", "audio": clip},
                                             {"type": "text", "text": rng.choice(QUESTIONS)}]},
                {"role": "assistant", "content": f"A {name} tone."},
            ]})  # fmt: skip
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
