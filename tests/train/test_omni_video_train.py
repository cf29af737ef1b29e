"""Video parts of omni rows for the Qwen2.5-Omni thinker, with and without their audio tracks
(``data.use_audio_in_video``): the expansion against ``Qwen2_5OmniProcessor``'s placeholder method, mrope against
the upstream thinker's ``get_rope_index``, the collate keys, bad input naming the file, a video changing the loss,
and the trainer on such rows (one rank; Ulysses SP=2 equals it).

Assets: those of tests/train/test_omni_train.py (tokenizer, image processor + Whisper extractor, tiny thinker)
with a chat template rendering video parts as ``<|vision_start|><|video_pad|><|vision_end|>`` and a 3 s audio
window; videos written here with PyAV: 2.5 s of 16 x 16 PNG frames at 4 fps plus an 8 kHz tone track (``.mov``),
and the same frames without a track.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from test_multimodal_data import REF, START, VIDEO, model_data, png
from test_omni_train import AUDIO, MELS, TEMPLATE, _sample, make_omni_dir, omni_recipe, thinker_config, tone

from veomni.train.data.encode import Sample
from veomni.train.data.multimodal_batch import collate_multimodal
from veomni.train.data.sources import DataError

VIDEO_TEMPLATE = TEMPLATE.replace(
    "{%- else %}{{- part['text'] }}",
    "{%- elif part['type'] == 'video' %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- else %}{{- part['text'] }}",
)
SECONDS, FPS, SIDE = 2.5, 4, 16


def write_clip(path: Path, hz: float | None, seed: int, seconds: float = SECONDS) -> str:
    """``seconds`` of random ``SIDE`` x ``SIDE`` frames at ``FPS`` (lossless PNG), plus a ``hz`` tone at 8 kHz
    (None: no audio stream)."""
    import av

    frames = np.random.default_rng(seed).integers(0, 255, (int(seconds * FPS), SIDE, SIDE, 3), dtype=np.uint8)
    with av.open(str(path), "w") as container:
        video = container.add_stream("png", rate=FPS)
        video.width = video.height = SIDE
        video.pix_fmt = "rgb24"
        audio = None if hz is None else container.add_stream("pcm_s16le", rate=8000)
        for frame in frames:
            container.mux(video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(video.encode())
        if audio is not None:
            t = np.arange(int(seconds * 8000)) / 8000
            wave = (0.5 * np.sin(2 * np.pi * hz * t) * 32767).astype(np.int16)
            for start in range(0, wave.size, 1000):
                frame = av.AudioFrame.from_ndarray(wave[None, start : start + 1000], format="s16", layout="mono")
                frame.sample_rate, frame.pts = 8000, start
                container.mux(audio.encode(frame))
            container.mux(audio.encode())
    return path.name


def row(*parts: dict, answer: str = "A clip.") -> dict:
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "What is this?"}]},
                         {"role": "assistant", "content": answer}]}  # fmt: skip


def video(name: str) -> dict:
    return {"type": "video", "video": name}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    from transformers import AutoTokenizer, Qwen2_5OmniThinkerForConditionalGeneration

    root = tmp_path_factory.mktemp("omni_video")
    processor = Path(make_omni_dir(root / "processor"))
    tokenizer = AutoTokenizer.from_pretrained(str(processor))
    tokenizer.chat_template = VIDEO_TEMPLATE
    tokenizer.save_pretrained(processor)
    config = json.loads((processor / "preprocessor_config.json").read_text())
    config.update(chunk_length=3, n_samples=48000, nb_max_frames=300)  # a 3 s audio window: the 2.5 s tracks fit
    (processor / "preprocessor_config.json").write_text(json.dumps(config))
    media = root / "media"
    media.mkdir()
    (media / "a.png").write_bytes(png(SIDE, SIDE))
    for i in range(3):
        write_clip(media / f"v{i}.mov", 220.0 * (i + 1), seed=i)
    write_clip(media / "silent.mov", None, seed=7)
    write_clip(media / "one_frame.mov", None, seed=8, seconds=1 / FPS)
    tone(media / "t0.wav", 330.0)
    rows = []
    for i in range(6):
        rows.append(row(video(f"v{i % 3}.mov"), answer=f"A clip with a {220 * (i % 3 + 1)} hertz tone."))
        rows.append(row({"type": "audio", "audio": "t0.wav"}, {"type": "image", "image": "a.png"}))
        rows.append(row(answer="Nothing."))
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    torch.manual_seed(0)
    Qwen2_5OmniThinkerForConditionalGeneration(thinker_config()).save_pretrained(root / "weights")
    return {"processor": str(processor), "media": str(media), "train": str(root / "train.jsonl"),
            "weights": str(root / "weights")}  # fmt: skip


def video_recipe(assets: dict, out: str, audio_in_video: bool = True, **train) -> dict:
    raw = omni_recipe(assets, out, **train)
    raw["data"].update(use_audio_in_video=audio_in_video, video_fps=1.0, video_frame_pixels=[64, SIDE * SIDE])
    return raw


def encoder(assets: dict, audio_in_video: bool = True):
    from veomni.train.data.build import encoder_for
    from veomni.train.data.encode import load_tokenizer
    from veomni.train.recipe import recipe_from_dict

    data = recipe_from_dict(video_recipe(assets, "/tmp/unused", audio_in_video)).data
    return encoder_for(data, load_tokenizer(assets["processor"]), **model_data(thinker_config()))


def test_audio_in_video_expands_like_the_processor_with_upstream_positions(assets):
    from models.test_qwen2_5_omni_video import hf_processor
    from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as upstream
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import _get_feat_extract_output_lengths

    enc = encoder(assets)
    r = row({"type": "audio", "audio": "t0.wav"}, video("v0.mov"), {"type": "image", "image": "a.png"})
    ids, trained, sample = enc(r, REF)
    # 10 frames at 4 fps sampled at 1 fps: min_frames keeps 4 ([0, 2, 5, 7]), 2 temporal patches of 8 x 8.
    assert sample.video_grid_thw.tolist() == [[2, 8, 8]] and sample.pixel_values_videos.shape == (128, 24)
    assert sample.video_second_per_grid.tolist() == [2.0]
    # Clips in text order: the standalone tone (0.5 s), then the video's 2.5 s track.
    frames = [f.shape[1] for f in sample.audio_features]
    assert frames == [50, 250]
    tokens = [int(_get_feat_extract_output_lengths(n)) for n in frames]
    names = {VIDEO: "<|VIDEO|>", AUDIO: "<|AUDIO|>", 1028: "<|audio_bos|>", 1030: "<|audio_eos|>"}
    start = int(np.flatnonzero(ids == START)[0]) + 1  # the video's <|vision_start|> (the image's follows)
    stop = start + 2 * 8 * 8 // 4 + tokens[1] + 2
    want = hf_processor().replace_video_token(
        {"video_grid_thw": sample.video_grid_thw, "video_second_per_grid": [2.0]}, 0,
        processed_audio={"num_audio_tokens": tokens}, video_to_audio_indices=[1], load_audio_from_video=True,
        position_id_per_seconds=25, seconds_per_chunk=2.0,
    )  # fmt: skip
    assert "".join(names[int(i)] for i in ids[start:stop]) == want
    assert "<|AUDIO|><|VIDEO|>" in want  # 2 s chunks: video, audio, video, audio
    assert not trained[ids == VIDEO].any() and not trained[ids == AUDIO].any() and trained.any()
    assert enc.measure(r, REF)[:2] == (len(ids), int(trained.sum()))
    ref = upstream.Qwen2_5OmniThinkerForConditionalGeneration(thinker_config())
    t = torch.as_tensor(ids)[None]
    want_pos, _ = ref.model.get_rope_index(
        t, torch.as_tensor(sample.image_grid_thw), torch.as_tensor(sample.video_grid_thw), torch.ones_like(t), True,
        torch.as_tensor(frames), torch.as_tensor(sample.video_second_per_grid),
    )  # fmt: skip
    np.testing.assert_array_equal(sample.mrope, want_pos[:, 0].numpy())

    batch = collate_multimodal([Sample(ids, trained, 0, media=sample), _sample(enc, row(), 1)])
    assert batch["video_grid_thw"].tolist() == [[2, 8, 8]] and batch["pixel_values_videos"].shape == (128, 24)
    assert batch["video_second_per_grid"].tolist() == [2.0] and batch["input_features"].shape == (2, MELS, 250)
    alone = collate_multimodal([_sample(enc, row(), 0)])
    assert alone["video_second_per_grid"] is None and alone["pixel_values_videos"] is None


def test_video_without_its_track_and_bad_input(assets):
    plain = encoder(assets, audio_in_video=False)
    ids, _, sample = plain(row(video("silent.mov")), REF)
    assert int((ids == VIDEO).sum()) == 32 and not (ids == AUDIO).any() and sample.audio_features == ()
    with pytest.raises(DataError, match=r"video 0 \(.*silent.mov\): the file holds no audio stream"):
        encoder(assets)(row(video("silent.mov")), REF)
    with pytest.raises(DataError, match=r"one_frame.mov\): 1 frame\(s\), fewer than the temporal patch size 2"):
        plain(row(video("one_frame.mov")), REF)
    frames = {"type": "video", "video": ["a.png"] * 4, "fps": 2}
    with pytest.raises(DataError, match="a list of frame images, which has no audio track"):
        encoder(assets)(row(frames), REF)
    assert plain(row(frames), REF)[2].video_second_per_grid.tolist() == [1.0]  # 2 / the list's fps
    from veomni.train.recipe import recipe_from_dict

    raw = video_recipe(assets, "/tmp/unused")
    raw["model"]["task"] = "vlm"
    from test_multimodal_data import tiny_vlm_config

    from veomni.train.data.build import encoder_for
    from veomni.train.data.encode import load_tokenizer

    # A vision-language model reads no audio: its rules use the vision encoder, which refuses the audio options.
    with pytest.raises(DataError, match="data.use_audio_in_video is set, but only an audio-visual model"):
        data = recipe_from_dict(raw).data
        encoder_for(data, load_tokenizer(assets["processor"]), **model_data(tiny_vlm_config()))
    from veomni.train.recipe import RecipeError

    raw = video_recipe(assets, "/tmp/unused")
    with pytest.raises(RecipeError, match=r"data.video_frame_pixels: expected \[min, max\] .* found \[300, 100\]"):
        recipe_from_dict({**raw, "data": {**raw["data"], "video_frame_pixels": [300, 100]}})
    with pytest.raises(RecipeError, match="data.use_audio_in_video: .* but data.kind is 'conversation'"):
        recipe_from_dict({**raw, "data": {**raw["data"], "kind": "conversation"}})


def test_a_rows_video_changes_the_loss(assets):
    from veomni.models.qwen2_5_omni.generated.patched_modeling_qwen2_5_omni import (
        Qwen2_5OmniThinkerForConditionalGeneration,
    )
    from veomni.train.tasks.vision import OmniTask

    torch.manual_seed(0)
    model = Qwen2_5OmniThinkerForConditionalGeneration(thinker_config()).eval()
    task = OmniTask.for_model(model)
    assert task.data_rules is not None and task.data_rules.encoder == "audio_visual" and task.data_rules.video_rule
    enc = encoder(assets, audio_in_video=False)

    def loss(name: str) -> float:
        batch = collate_multimodal([_sample(enc, row(video(name)), 0)])
        with torch.no_grad():
            return float(task.forward(model, batch, torch.device("cpu"), (batch["labels"] != -100).sum()).loss)

    assert abs(loss("v0.mov") - loss("v1.mov")) > 1e-4  # same length, other frames


def _steps(ctx, raw: dict, n: int) -> dict:
    from veomni.train.loop import build_run, train_step
    from veomni.train.recipe import recipe_from_dict

    run = build_run(recipe_from_dict(raw))
    it = iter(run.train_data)
    steps = [next(it) for _ in range(n)]
    videos = sum(int(b["video_grid_thw"].shape[0]) for s in steps for b in s.micro_batches
                 if b.get("video_grid_thw") is not None)  # fmt: skip
    return {"losses": [float(train_step(run, s)["loss"]) for s in steps], "videos": videos}


@pytest.fixture(scope="module")
def one_rank(dist_pools, assets, tmp_path_factory) -> dict:
    raw = video_recipe(assets, str(tmp_path_factory.mktemp("one") / "run"), steps=3)
    return dist_pools.get(1, "gloo").run(_steps, copy.deepcopy(raw), 3)[0]


def test_trainer_runs_audio_in_video_rows(one_rank):
    assert one_rank["videos"] > 0
    losses = one_rank["losses"]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], one_rank


def test_sp2_matches_one_rank(dist_pools, assets, one_rank, tmp_path):
    """Ulysses SP=2 on audio-in-video rows: the interleaved audio and video features land in each rank's token
    range (`scatter_visual_sp`); per-step losses equal one rank's."""
    raw = video_recipe(assets, str(tmp_path / "run"), steps=3)
    raw["parallel"] = {"sp": 2}
    for got in dist_pools.get(2, "gloo").run(_steps, raw, 3):
        assert got["videos"] == one_rank["videos"]
        assert got["losses"] == pytest.approx(one_rank["losses"], rel=1e-4, abs=1e-5), (got, one_rank)
