"""Video parts of omni rows for the Qwen3-Omni-MoE thinker, with their audio tracks (``data.use_audio_in_video``):
the expansion against ``Qwen3OmniMoeProcessor``'s placeholder method (video and audio tokens merged by time), mrope
against the upstream thinker's ``get_rope_index``, a video's frames and its audio track each changing the loss, and
the trainer on such rows: one gloo rank trains, a resume from a mid-run checkpoint continues with bitwise-equal
losses, and Ulysses SP=2 equals one rank.

Assets: test_omni_video_train's clips (2.5 s of 16 x 16 frames at 4 fps with an 8 kHz tone track) and tokenizer
(video parts rendered ``<|vision_start|><|video_pad|><|vision_end|>``, a 3 s audio window), plus the tokenizer's
``audio_eos_token`` (Qwen3-Omni-MoE's config names no audio end token; its processor reads the tokenizer's), and
test_omni_moe_train's tiny thinker (``position_id_per_seconds`` 25: at 1 fps a temporal patch spans 50 positions).
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
from test_omni_moe_train import thinker_config
from test_omni_train import A_END, A_START, AUDIO, make_omni_dir, tone
from test_omni_video_train import SIDE, VIDEO_TEMPLATE, row, video, video_recipe, write_clip

from veomni.train.data.encode import Sample
from veomni.train.data.multimodal import collate_multimodal
from veomni.train.data.sources import DataError

STEPS = 2


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    from transformers import AutoTokenizer, Qwen3OmniMoeThinkerForConditionalGeneration

    root = tmp_path_factory.mktemp("omni_moe_video")
    processor = Path(make_omni_dir(root / "processor"))
    tokenizer = AutoTokenizer.from_pretrained(
        str(processor),
        extra_special_tokens={"audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"},
    )
    tokenizer.chat_template = VIDEO_TEMPLATE
    tokenizer.save_pretrained(processor)
    config = json.loads((processor / "preprocessor_config.json").read_text())
    # A 3 s audio window: the 2.5 s tracks fit.
    config.update(chunk_length=3, n_samples=48000, nb_max_frames=300)
    (processor / "preprocessor_config.json").write_text(json.dumps(config))
    media = root / "media"
    media.mkdir()
    (media / "a.png").write_bytes(png(SIDE, SIDE))
    for i in range(2):
        write_clip(media / f"v{i}.mov", 220.0 * (i + 1), seed=i)
    write_clip(media / "v0_high.mov", 880.0, seed=0)  # v0's frames, another track
    tone(media / "t0.wav", 330.0)
    rows = []
    for i in range(4):
        rows.append(row(video(f"v{i % 2}.mov"), answer=f"A clip with a {220 * (i % 2 + 1)} hertz tone."))
        rows.append(row({"type": "audio", "audio": "t0.wav"}, {"type": "image", "image": "a.png"}))
        rows.append(row(answer="Nothing."))
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    torch.manual_seed(0)
    Qwen3OmniMoeThinkerForConditionalGeneration(thinker_config()).save_pretrained(root / "weights")
    return {"processor": str(processor), "media": str(media), "train": str(root / "train.jsonl"),
            "weights": str(root / "weights")}  # fmt: skip


def moe_video_recipe(assets: dict, out: str, *, sp: int = 1) -> dict:
    raw = video_recipe(assets, out, steps=STEPS)
    raw["train"]["tokens_per_step"] = 512  # one micro-batch per step: ~3 rows, a video among them
    raw["parallel"] = {"sp": sp}
    raw["ops"] = {"moe_experts": "torch"}
    return raw


def encoder(assets: dict, audio_in_video: bool = True):
    from veomni.train.data.build import encoder_for
    from veomni.train.data.encode import load_tokenizer
    from veomni.train.recipe import recipe_from_dict

    raw = moe_video_recipe(assets, "/tmp/unused")
    raw["data"]["use_audio_in_video"] = audio_in_video
    return encoder_for(
        recipe_from_dict(raw).data, load_tokenizer(assets["processor"]), **model_data(thinker_config())
    )


def test_audio_in_video_expands_like_the_processor_with_upstream_positions(assets):
    from models.test_qwen3_omni_moe_video import hf_processor
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as upstream
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

    enc = encoder(assets)
    r = row({"type": "audio", "audio": "t0.wav"}, video("v0.mov"), {"type": "image", "image": "a.png"})
    ids, trained, sample = enc(r, REF)
    # 10 frames at 4 fps sampled at 1 fps: min_frames keeps 4, 2 temporal patches of 8 x 8; 2 / 1 fps per grid.
    assert sample.video_grid_thw.tolist() == [[2, 8, 8]] and sample.video_second_per_grid.tolist() == [2.0]
    frames = [f.shape[1] for f in sample.audio_features]
    assert frames == [50, 250]  # in text order: the 0.5 s tone, then the video's 2.5 s track
    tokens = [int(_get_feat_extract_output_lengths(torch.tensor(n))) for n in frames]
    names = {
        VIDEO: "<|video_pad|>",
        AUDIO: "<|audio_pad|>",
        A_START: "<|audio_start|>",
        A_END: "<|audio_end|>",
    }
    start = int(np.flatnonzero(ids == START)[0]) + 1  # the video's <|vision_start|> (the image's follows)
    stop = start + 2 * 8 * 8 // 4 + tokens[1] + 2
    want = hf_processor().replace_video_token(
        {"video_grid_thw": sample.video_grid_thw, "video_second_per_grid": [2.0]}, 0,
        processed_audio={"num_audio_tokens": tokens}, video_to_audio_indices=[1], load_audio_from_video=True,
        position_id_per_seconds=25,
    )  # fmt: skip
    assert "".join(names[int(i)] for i in ids[start:stop]) == want
    # Merged by time: frame 0's 16 tokens, the track's 33 (positions 0..32 < 50), frame 1's 16.
    assert want == "<|audio_start|>" + "<|video_pad|>" * 16 + "<|audio_pad|>" * 33 + "<|video_pad|>" * 16 + (
        "<|audio_end|>"
    )
    assert not trained[ids == VIDEO].any() and not trained[ids == AUDIO].any() and trained.any()
    assert enc.measure(r, REF)[:2] == (len(ids), int(trained.sum()))
    ref = upstream.Qwen3OmniMoeThinkerForConditionalGeneration(thinker_config())
    t = torch.as_tensor(ids)[None]
    want_pos, _ = ref.model.get_rope_index(
        t, torch.as_tensor(sample.image_grid_thw), torch.as_tensor(sample.video_grid_thw), torch.ones_like(t), True,
        torch.as_tensor(frames), torch.as_tensor(sample.video_second_per_grid),
    )  # fmt: skip
    np.testing.assert_array_equal(sample.mrope, want_pos[:, 0].numpy())

    plain = encoder(assets, audio_in_video=False)
    ids, _, sample = plain(row(video("v0.mov")), REF)
    assert int((ids == VIDEO).sum()) == 32 and not (ids == AUDIO).any() and sample.audio_features == ()


def test_special_tokens_come_from_the_tokenizers_declarations(assets):
    """The audio end token and the audio placeholder are the tokenizer's declared ``audio_eos_token`` /
    ``audio_token`` (as the processor reads them); without an end token audio-in-video is refused."""
    from transformers import AutoTokenizer

    from veomni.train.data.build import encoder_for
    from veomni.train.recipe import recipe_from_dict

    tokenizer = AutoTokenizer.from_pretrained(assets["processor"])
    tokenizer.audio_eos_token = None
    data = recipe_from_dict(moe_video_recipe(assets, "/tmp/unused")).data
    with pytest.raises(
        DataError, match="config has no audio_end_token_id and the tokenizer declares no audio_eos"
    ):
        encoder_for(data, tokenizer, **model_data(thinker_config()))
    tokenizer.audio_token = "<|audio_pad|>"  # Qwen3-Omni's placeholder name, which this tokenizer lacks
    with pytest.raises(DataError, match=r"the tokenizer has no <\|audio_pad\|> token"):
        encoder_for(data, tokenizer, **model_data(thinker_config()))


def test_a_videos_frames_and_its_audio_track_change_the_loss(assets):
    from veomni.models.qwen3_omni_moe.generated.patched_modeling_qwen3_omni_moe import (
        Qwen3OmniMoeThinkerForConditionalGeneration,
    )
    from veomni.train.tasks.vision import OmniTask

    torch.manual_seed(0)
    model = Qwen3OmniMoeThinkerForConditionalGeneration(thinker_config()).eval()
    # At the 0.02 init the clips' content barely reaches the LM (see test_qwen3_omni_moe).
    with torch.no_grad():
        tower = model.model.audio_tower
        for conv in (tower.conv2d1, tower.conv2d2, tower.conv2d3, tower.conv_out):
            conv.weight.normal_(0.0, 0.2)
    task = OmniTask.for_model(model)
    assert task.data_rules is not None and task.data_rules.encoder == "audio_visual" and task.data_rules.video_rule
    enc = encoder(assets)

    def loss(name: str) -> float:
        ids, trained, media = enc(row(video(name), answer="A clip."), REF)
        batch = collate_multimodal([Sample(ids, trained, 0, media=media)])
        with torch.no_grad():
            return float(
                task.forward(model, batch, torch.device("cpu"), (batch["labels"] != -100).sum()).loss
            )

    base = loss("v0.mov")
    assert math.isfinite(base)
    assert abs(base - loss("v1.mov")) > 1e-4  # other frames, other track
    assert abs(base - loss("v0_high.mov")) > 1e-4  # the same frames, another track


def _plain(value):
    """A DTensor as its full tensor, a tensor as a copy (one rank: the values to compare across runs)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor().detach().clone()
    return value.detach().clone() if torch.is_tensor(value) else value


def _trainer_state(run) -> dict:
    """What a resume must restore besides the weights: AdamW's per-parameter moments and step counts, and the
    schedule's step with the groups' learning rates (a lost one shows only in the update after the resume)."""
    return {
        "optimizer": {
            k: {n: _plain(v) for n, v in s.items()} for k, s in run.optimizer.state_dict()["state"].items()
        },
        "schedule": (run.scheduler.last_epoch, [group["lr"] for group in run.optimizer.param_groups]),
    }


def _resume(ctx, raw: dict, split: int) -> dict:
    """``STEPS`` steps with a checkpoint saved after ``split`` (as `train` saves mid-run), then a run resumed from
    that checkpoint for the remaining steps; the optimizer and schedule state at the save and right after the resume,
    and both runs' final weights."""
    from veomni.train.loop import _save, build_run, train_step
    from veomni.train.recipe import recipe_from_dict

    run = build_run(recipe_from_dict(raw))
    it = iter(run.train_data)
    losses, videos = [], 0
    for k in range(STEPS):
        step = next(it)  # drawn one at a time: the checkpoint records the loader's position
        videos += sum(int(b["video_grid_thw"].shape[0]) for b in step.micro_batches
                      if b.get("video_grid_thw") is not None)  # fmt: skip
        losses.append(float(train_step(run, step)["loss"]))
        if k + 1 == split:
            _save(run)
            saved = _trainer_state(run)
    resumed = copy.deepcopy(raw)
    resumed["checkpoint"]["resume"] = "auto"
    second = build_run(recipe_from_dict(resumed))
    assert second.step == split
    restored = _trainer_state(second)
    it = iter(second.train_data)
    tail = [float(train_step(second, next(it))["loss"]) for _ in range(STEPS - split)]
    weights = [{n: _plain(p) for n, p in r.model.named_parameters()} for r in (run, second)]
    return {"losses": losses, "resumed": tail, "videos": videos, "saved": saved, "restored": restored,
            "weights": weights}  # fmt: skip


def _same(want, got) -> bool:
    """Nested dicts / lists / tuples of tensors and numbers equal bit for bit."""
    if torch.is_tensor(want):
        return torch.is_tensor(got) and want.dtype == got.dtype and torch.equal(want, got)
    if isinstance(want, dict):
        return (
            isinstance(got, dict) and want.keys() == got.keys() and all(_same(want[k], got[k]) for k in want)
        )
    if isinstance(want, list | tuple):
        return len(want) == len(got) and all(_same(a, b) for a, b in zip(want, got, strict=True))
    return want == got


def _steps(ctx, raw: dict) -> list[float]:
    from veomni.train.loop import build_run, train_step
    from veomni.train.recipe import recipe_from_dict

    run = build_run(recipe_from_dict(raw))
    it = iter(run.train_data)
    return [float(train_step(run, next(it))["loss"]) for _ in range(STEPS)]


@pytest.fixture(scope="module")
def one_rank(dist_pools, assets, tmp_path_factory) -> dict:
    raw = moe_video_recipe(assets, str(tmp_path_factory.mktemp("one") / "run"))
    return dist_pools.get(1, "gloo").run(_resume, raw, 1)[0]


def test_trainer_runs_audio_in_video_rows_and_resumes_exactly(one_rank):
    assert one_rank["videos"] > 0
    losses = one_rank["losses"]
    assert all(math.isfinite(x) for x in losses), one_rank
    assert one_rank["resumed"] == losses[1:]  # bitwise: same data position, RNG and weights
    # The step after the resume reads only the weights; the optimizer and schedule shape its update.
    saved, restored = one_rank["saved"], one_rank["restored"]
    assert saved["optimizer"] and _same(saved["optimizer"], restored["optimizer"]), (
        "optimizer state not restored"
    )
    assert saved["schedule"] == restored["schedule"], (saved["schedule"], restored["schedule"])
    straight, resumed = one_rank["weights"]
    assert _same(straight, resumed), [n for n in straight if not torch.equal(straight[n], resumed[n])]


def test_sp2_matches_one_rank(dist_pools, assets, one_rank, tmp_path):
    """Ulysses SP=2 on audio-in-video rows (the merged video and audio features land in each rank's token range);
    per-step losses equal one rank's."""
    for got in dist_pools.get(2, "gloo").run(_steps, moe_video_recipe(assets, str(tmp_path / "run"), sp=2)):
        assert got == pytest.approx(one_rank["losses"], rel=1e-5, abs=1e-6), (got, one_rank)
