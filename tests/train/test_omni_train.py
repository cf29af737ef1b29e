"""Qwen2.5-Omni thinker through the trainer (task omni): audio parts of multimodal rows are decoded, expanded to
the feature extractor's token counts and collated per micro-batch (None without audio); a row's audio changes the
loss; one gloo rank trains on tones, images and text, and the export loads in plain transformers.

Assets: the quickstart tokenizer plus the vision and audio special tokens and a chat template rendering audio
parts as ``<|audio_bos|><|AUDIO|><|audio_eos|>``; one ``preprocessor_config.json`` holding the PIL image
processor and a 16-bin Whisper feature extractor with a 1 s window (as the released thinker's holds both); a
tiny thinker (the towers of tests/models/test_qwen2_5_omni.py at the trainer's vocabulary); 8 kHz tones (the
extractor resamples to 16 kHz).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from test_multimodal_data import IMAGE, QUICKSTART, REF, START, VIDEO, VISION_TOKENS, model_data, png
from test_vlm_train import vlm_recipe

from veomni.train.data.encode import Sample
from veomni.train.data.multimodal_batch import collate_multimodal
from veomni.train.data.sources import DataError

AUDIO_TOKENS = ["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]
A_START, AUDIO, A_END = 1028, 1029, 1030
TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'image' %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}{%- elif part['type'] == 'audio' %}"
    "{{- '<|audio_bos|><|AUDIO|><|audio_eos|>' }}{%- else %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MELS = 16


def thinker_config():
    from transformers import Qwen2_5OmniThinkerConfig

    return Qwen2_5OmniThinkerConfig(
        text_config={
            "vocab_size": 1032, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        },
        vision_config={
            "depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "patch_size": 2,
            "temporal_patch_size": 2, "spatial_merge_size": 2, "window_size": 8, "out_hidden_size": 64,
            "fullatt_block_indexes": [1],
        },
        audio_config={
            "num_mel_bins": MELS, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 48,
            "d_model": 32, "max_source_positions": 64, "n_window": 8, "output_dim": 64,
        },
        audio_token_index=AUDIO, image_token_index=IMAGE, video_token_index=VIDEO, audio_start_token_id=A_START,
        audio_end_token_id=A_END, vision_start_token_id=START,
        tie_word_embeddings=False,
    )  # fmt: skip


def make_omni_dir(out: Path) -> str:
    from transformers import AutoTokenizer, WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(str(QUICKSTART))
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS + AUDIO_TOKENS})
    assert tokenizer.convert_tokens_to_ids(AUDIO_TOKENS) == [A_START, AUDIO, A_END]
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(out)
    Qwen2VLImageProcessorPil(
        patch_size=2, merge_size=2, temporal_patch_size=2, size={"shortest_edge": 16, "longest_edge": 1024}
    ).save_pretrained(out)
    image = json.loads((out / "preprocessor_config.json").read_text())
    audio = WhisperFeatureExtractor(feature_size=MELS, sampling_rate=16000, hop_length=160, chunk_length=1)
    merged = {**audio.to_dict(), **image}  # one file for both, as the released thinker ships it
    merged.pop("mel_filters", None)  # recomputed from the sizes on load
    (out / "preprocessor_config.json").write_text(json.dumps(merged))
    return str(out)


def tone(path: Path, hz: float, seconds: float = 0.5, rate: int = 8000) -> str:
    import soundfile

    t = np.arange(int(seconds * rate)) / rate
    soundfile.write(path, (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32), rate)
    return path.name


def row(*parts: dict, answer: str = "A tone.") -> dict:
    return {
        "messages": [
            {"role": "user", "content": [*parts, {"type": "text", "text": "What is this?"}]},
            {"role": "assistant", "content": answer},
        ]
    }


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    root = tmp_path_factory.mktemp("omni")
    media = root / "media"
    media.mkdir()
    (media / "a.png").write_bytes(png(16, 16))
    rows = []
    for i in range(12):
        name = tone(media / f"t{i}.wav", 220 * (1 + i % 4), 0.3 + 0.05 * (i % 3))
        parts = [{"type": "audio", "audio": name}]
        if i % 3 == 0:
            parts.append({"type": "image", "image": "a.png"})
        rows.append(row(*parts, answer=f"A tone of {220 * (1 + i % 4)} hertz."))
        rows.append(row(answer="Nothing to hear."))
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    torch.manual_seed(0)
    weights = root / "weights"
    Qwen2_5OmniThinkerForConditionalGeneration(thinker_config()).save_pretrained(weights)
    return {
        "processor": make_omni_dir(root / "processor"), "media": str(media), "train": str(root / "train.jsonl"),
        "weights": str(weights),
    }  # fmt: skip


def encoder(assets: dict):
    from veomni.train.data.build import encoder_for
    from veomni.train.data.encode import load_tokenizer
    from veomni.train.recipe import recipe_from_dict

    data = recipe_from_dict(omni_recipe(assets, "/tmp/unused")).data
    return encoder_for(data, load_tokenizer(assets["processor"]), **model_data(thinker_config()))


def omni_recipe(assets: dict, out: str, **train) -> dict:
    raw = vlm_recipe(assets, out, **train)
    raw["model"]["task"] = "omni"
    raw["data"]["shuffle"] = False
    raw["data"]["max_seq_len"] = 512
    raw["train"].update({"tokens_per_step": 1024, "tokens_per_micro_batch": 512})
    return raw


def _sample(enc, r: dict, index: int) -> Sample:
    ids, trained, media = enc(r, REF)
    return Sample(ids, trained, index, media=media)


def test_audio_expands_to_the_extractors_tokens_and_collates(assets):
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import _get_feat_extract_output_lengths

    enc = encoder(assets)
    media = Path(assets["media"])
    with_audio = row({"type": "audio", "audio": "t1.wav"}, {"type": "image", "image": "a.png"})
    ids, trained, sample = enc(with_audio, REF)
    # 0.35 s at 8 kHz resampled to 16 kHz: 5600 samples, 35 mel frames (hop 160), Whisper's conv + pool rule.
    assert sample.audio_features[0].shape == (MELS, 35)
    assert int((ids == AUDIO).sum()) == int(_get_feat_extract_output_lengths(35)) == 9
    assert not trained[ids == AUDIO].any() and not trained[ids == IMAGE].any() and trained.any()
    assert enc.measure(with_audio, REF)[:2] == (len(ids), int(trained.sum()))
    # Audio advances all three mrope axes together; positions start at 0.
    run = np.flatnonzero(ids == AUDIO)
    assert (sample.mrope[:, run] == sample.mrope[0, run]).all() and sample.mrope[:, 0].tolist() == [0, 0, 0]

    text = _sample(enc, row(), 1)
    batch = collate_multimodal([_sample(enc, with_audio, 0), text, _sample(enc, row({"type": "audio",
                               "audio": "t0.wav"}), 2)])  # fmt: skip
    assert batch["input_features"].shape == (2, MELS, 35)
    assert batch["feature_attention_mask"].sum(-1).tolist() == [35, 30]
    assert batch["position_ids"].shape[:2] == (4, 1)
    # The audio tower's chunk tables, laid out on the host from the clips' frame counts (`AudioChunks`).
    from veomni.models.qwen2_5_omni.audio_layout import AudioChunks

    want = AudioChunks.from_config(thinker_config().audio_config)([35, 30], 35)
    got = batch["audio_metadata"]
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value) if torch.is_tensor(value) else got[name] == value, name
    alone = collate_multimodal([text])
    assert alone["input_features"] is None and alone["feature_attention_mask"] is None
    assert alone["audio_metadata"] is None

    bad = row({"type": "audio", "audio": str(media / "missing.wav")})
    with pytest.raises(DataError, match="missing.wav"):
        enc(bad, REF)
    with pytest.raises(DataError, match="audio part"):
        enc(row({"type": "text", "text": "<|AUDIO|>"}), REF)


def test_a_clip_too_short_for_one_audio_token_is_a_data_error(assets):
    # 0.015 s at 8 kHz: 2 mel frames at 16 kHz, which Qwen2.5-Omni's convolution and pooling turn into 0 tokens.
    enc = encoder(assets)
    name = tone(Path(assets["media"]) / "blip.wav", 440.0, seconds=0.015)
    short = row({"type": "audio", "audio": name}, {"type": "image", "image": "a.png"})
    for call in (enc, enc.measure):
        with pytest.raises(
            DataError, match=r"blip.wav is too short for the audio tower \(2 feature frames give 0"
        ):
            call(short, REF)


def test_a_rows_audio_changes_the_loss(assets):
    from veomni.models.qwen2_5_omni.generated.patched_modeling_qwen2_5_omni import (
        Qwen2_5OmniThinkerForConditionalGeneration,
    )
    from veomni.train.tasks.vision import OmniTask

    torch.manual_seed(0)
    model = Qwen2_5OmniThinkerForConditionalGeneration(thinker_config()).eval()
    task = OmniTask.for_model(model)
    assert task.name == "omni" and task.model_task == "any_to_any"
    enc = encoder(assets)

    def loss(*rows: dict) -> float:
        batch = collate_multimodal([_sample(enc, r, i) for i, r in enumerate(rows)])
        n = (batch["labels"] != -100).sum().float()
        with torch.no_grad():
            return float(task.forward(model, batch, torch.device("cpu"), n).loss)

    # The task hands the model the collator's tables; the loss equals the model's own device-side layout.
    rows = [row({"type": "audio", "audio": "t1.wav"}, {"type": "image", "image": "a.png"}), row()]
    assert task.collate_metadata is not None  # the thinker's WindowIndex, which the loader's collate runs
    samples = [_sample(enc, r, i) for i, r in enumerate(rows)]
    batch = collate_multimodal(samples, vision_metadata=task.collate_metadata)
    n = (batch["labels"] != -100).sum().float()
    kwargs = task.model_kwargs(batch, torch.device("cpu"), n)
    assert (
        kwargs["audio_metadata"]["audio_tokens"] == 9
        and kwargs["vision_metadata"]["cu_window_seqlens"].numel()
    )
    with torch.no_grad():
        derived = model(**{k: v for k, v in kwargs.items() if k not in ("audio_metadata", "vision_metadata")})
        torch.testing.assert_close(model(**kwargs).loss, derived.loss, rtol=1e-6, atol=1e-6)
    low = loss(row({"type": "audio", "audio": "t0.wav"}), row())
    high = loss(row({"type": "audio", "audio": "t3.wav"}), row())  # same length, another pitch
    assert math.isfinite(low) and math.isfinite(high) and abs(low - high) > 1e-4
    assert math.isfinite(loss(row(), row({"type": "image", "image": "a.png"})))  # audio tower's dummy forward


def _steps(ctx, raw: dict, n: int, export: str) -> dict:
    from veomni.train.loop import build_run, train_step
    from veomni.train.recipe import recipe_from_dict

    run = build_run(recipe_from_dict(raw))
    it = iter(run.train_data)
    steps = [next(it) for _ in range(n)]
    clips = sum(
        int(b["input_features"].shape[0])
        for s in steps
        for b in s.micro_batches
        if b.get("input_features") is not None
    )
    stats = [train_step(run, s) for s in steps]
    run.task.export(run.model, Path(export), run.tokenizer, run.state)
    return {"losses": [float(s["loss"]) for s in stats], "clips": clips}


@pytest.fixture(scope="module")
def one_rank(dist_pools, assets, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("one")
    raw = omni_recipe(assets, str(tmp / "run"), steps=3)
    export = tmp / "export"
    return {**dist_pools.get(1, "gloo").run(_steps, copy.deepcopy(raw), 3, str(export))[0], "export": export}


def test_one_rank_trains_and_exports(one_rank, assets):
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration, WhisperFeatureExtractor

    got, export = one_rank, one_rank["export"]
    assert got["clips"] > 0
    assert all(math.isfinite(x) for x in got["losses"]), got
    assert got["losses"][-1] < got["losses"][0], got
    model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(export)
    trained = model.state_dict()
    start = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(assets["weights"]).state_dict()
    assert trained.keys() == start.keys()
    assert not torch.equal(trained["model.audio_tower.conv1.weight"], start["model.audio_tower.conv1.weight"])
    assert WhisperFeatureExtractor.from_pretrained(export).feature_size == MELS


def _clips_per_rank(ctx, raw: dict, n: int) -> dict:
    import torch.distributed as dist

    from veomni.train.loop import build_run, train_step
    from veomni.train.recipe import recipe_from_dict

    run = build_run(recipe_from_dict(raw))
    it = iter(run.train_data)
    steps = [next(it) for _ in range(n)]
    clips = [
        sum(int(b["input_features"].shape[0]) for b in s.micro_batches if b.get("input_features") is not None)
        for s in steps
    ]
    losses = [float(train_step(run, s)["loss"]) for s in steps]
    return {"rank": dist.get_rank(), "clips": clips, "losses": losses}


def test_two_ranks_with_audio_on_one_rank_only(dist_pools, assets, tmp_path):
    """FSDP over 2 gloo ranks: the rank without audio runs the audio tower's dummy forward, so the step neither
    hangs nor diverges between ranks."""
    rows = [row({"type": "audio", "audio": f"t{i}.wav"}) for i in range(3)] + [row() for _ in range(40)]
    train = tmp_path / "mixed.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = omni_recipe({**assets, "train": str(train)}, str(tmp_path / "run"), steps=2)
    got = dist_pools.get(2, "gloo").run(_clips_per_rank, raw, 2)
    per_step = list(zip(*(g["clips"] for g in got), strict=True))
    assert any(min(c) == 0 < max(c) for c in per_step), per_step  # one rank with audio, one without
    for g in got:
        assert g["losses"] == got[0]["losses"] and all(math.isfinite(x) for x in g["losses"]), got


def test_sp2_matches_one_rank(dist_pools, assets, one_rank, tmp_path):
    """Ulysses SP=2: the language model and the audio tower run on slices; per-step losses equal one rank's."""
    raw = omni_recipe(assets, str(tmp_path / "run"), steps=3)
    raw["parallel"] = {"sp": 2}
    got = dist_pools.get(2, "gloo").run(_steps, raw, 3, str(tmp_path / "export"))
    for g in got:
        assert g["losses"] == pytest.approx(one_rank["losses"], rel=1e-4, abs=1e-5), (g, one_rank)


OMNI_TOKENS = ["<|vision_bos|>", "<|IMAGE|>", "<|vision_eos|>", "<|VIDEO|>", "<|audio_bos|>", "<|AUDIO|>",
               "<|audio_eos|>"]  # fmt: skip
OMNI_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'image' %}"
    "{{- '<|vision_bos|><|IMAGE|><|vision_eos|>' }}{%- elif part['type'] == 'audio' %}"
    "{{- '<|audio_bos|><|AUDIO|><|audio_eos|>' }}{%- else %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
)


def test_the_tokenizers_declared_image_token_is_the_placeholder(tmp_path):
    # Qwen2.5-Omni's tokenizer declares image_token <|IMAGE|> (what its processor reads), not Qwen-VL's
    # <|image_pad|>: the encoder must take the declared one.
    from transformers import AutoTokenizer, Qwen2_5OmniThinkerConfig, WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from veomni.models.qwen2_5_omni import data_rules
    from veomni.train.data.audio_visual import AudioVisualEncoder

    declared = {"image_token": "<|IMAGE|>", "video_token": "<|VIDEO|>", "audio_token": "<|AUDIO|>"}
    tokenizer = AutoTokenizer.from_pretrained(str(QUICKSTART), extra_special_tokens=declared)
    tokenizer.add_special_tokens({"additional_special_tokens": OMNI_TOKENS})
    tokenizer.chat_template = OMNI_TEMPLATE
    tokenizer.save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    assert tokenizer.image_token == "<|IMAGE|>"
    ids = dict(zip(OMNI_TOKENS, tokenizer.convert_tokens_to_ids(OMNI_TOKENS), strict=True))
    config = Qwen2_5OmniThinkerConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 96,
                     "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}},
        vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "patch_size": 2,
                       "temporal_patch_size": 2, "spatial_merge_size": 2, "window_size": 8, "out_hidden_size": 64},
        audio_config={"num_mel_bins": 16, "encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 48,
                      "d_model": 32, "max_source_positions": 64, "n_window": 8, "output_dim": 64},
        audio_token_index=ids["<|AUDIO|>"], image_token_index=ids["<|IMAGE|>"], video_token_index=ids["<|VIDEO|>"],
        audio_start_token_id=ids["<|audio_bos|>"], audio_end_token_id=ids["<|audio_eos|>"],
        vision_start_token_id=ids["<|vision_bos|>"], vision_end_token_id=ids["<|vision_eos|>"],
    )  # fmt: skip
    images = Qwen2VLImageProcessorPil(
        patch_size=2, merge_size=2, temporal_patch_size=2, size={"shortest_edge": 16, "longest_edge": 1024}
    )
    extractor = WhisperFeatureExtractor(feature_size=16, sampling_rate=16000, hop_length=160, chunk_length=1)
    enc = AudioVisualEncoder(
        tokenizer, images, "messages", None, True, media_root=None, max_patches=None, feature_extractor=extractor,
        config=config, positions=data_rules.positions(config), audio_tokens=data_rules.audio_tokens,
    )  # fmt: skip
    picture = {
        "role": "user",
        "content": [{"type": "image", "image": png(16, 16)}, {"type": "text", "text": "What?"}],
    }
    out_ids, trained, media = enc({"messages": [picture, {"role": "assistant", "content": "A square."}]}, REF)
    # 16 x 16 pixels in 2-pixel patches merged 2 x 2: 16 image tokens.
    assert int((out_ids == ids["<|IMAGE|>"]).sum()) == 16
    assert media.image_grid_thw.tolist() == [[1, 8, 8]]
    assert not trained[out_ids == ids["<|IMAGE|>"]].any()
    assert np.asarray(media.mrope).shape == (3, len(out_ids))


@pytest.mark.parametrize("world_size", [1, 2])
def test_resumes_exactly_from_its_own_checkpoint(dist_pools, assets, tmp_path, world_size):
    # The thinker's audio_bos_eos_token never gets a gradient, so AdamW never holds state for it: the checkpoint is
    # complete all the same and resumes (issue 42). Two ranks: FSDP2 shards over gloo.
    from resume_helpers import check_exact_resume, resume_before_gradients

    raw = omni_recipe(assets, str(tmp_path / "run"), steps=2)
    for result in dist_pools.get(world_size, "gloo").run(resume_before_gradients, raw, 1, 2):
        check_exact_resume(result, some="audio_bos_eos_token")
