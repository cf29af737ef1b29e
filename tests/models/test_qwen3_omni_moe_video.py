"""Qwen3-Omni-MoE thinker with videos, and videos with their audio tracks (``use_audio_in_video``).

Oracles: transformers' ``Qwen3OmniMoeProcessor`` placeholder method (``replace_video_token``, which dispatches to
``replace_video_with_audio_token``; the processor's constructor needs a tokenizer and torchvision, so it is built
with just the attributes those methods read), the upstream thinker's ``get_rope_index`` and its forward/backward
(fp32) on the same inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from models.test_qwen3_omni_moe import (
    A_END,
    A_START,
    AUDIO,
    IMAGE,
    MELS,
    V_END,
    V_START,
    VIDEO,
    pair,
    tiny_config,
)

from veomni.models.qwen2_5_omni.video import VideoTokens
from veomni.models.qwen3_omni_moe.positions import Qwen3OmniMoePositions
from veomni.models.qwen3_omni_moe.towers import audio_token_count
from veomni.models.qwen3_omni_moe.video import interleaved_placeholder_ids

TOKENS = VideoTokens(VIDEO, AUDIO, A_START, A_END)
NAMES = {VIDEO: "<|video_pad|>", AUDIO: "<|audio_pad|>", A_START: "<|audio_start|>", A_END: "<|audio_end|>"}
PATCH_ROW = 3 * 2 * 2 * 2  # channels * temporal patch * patch**2 of the tiny tower
PER_SECOND = 25  # the tiny config's position_id_per_seconds (transformers' default)


def hf_processor():
    """``Qwen3OmniMoeProcessor`` with what its video placeholder methods read."""
    from types import SimpleNamespace

    from transformers import Qwen3OmniMoeProcessor

    processor = Qwen3OmniMoeProcessor.__new__(Qwen3OmniMoeProcessor)
    processor.video_processor = SimpleNamespace(merge_size=2)  # only merge_size is read
    processor.video_token, processor.audio_token = NAMES[VIDEO], NAMES[AUDIO]
    processor.audio_bos_token, processor.audio_eos_token = NAMES[A_START], NAMES[A_END]
    return processor


def processor_placeholder(grid, seconds: float, clip_tokens: int | None) -> str:
    return hf_processor().replace_video_token(
        {"video_grid_thw": [np.asarray(grid)], "video_second_per_grid": [seconds]}, 0,
        processed_audio={"num_audio_tokens": [clip_tokens]}, video_to_audio_indices=[0],
        load_audio_from_video=clip_tokens is not None, position_id_per_seconds=PER_SECOND,
    )  # fmt: skip


def expand(grid, seconds: float, clip_tokens: int | None) -> np.ndarray:
    return interleaved_placeholder_ids(
        grid, 2, TOKENS, seconds, audio_tokens=clip_tokens, position_id_per_seconds=PER_SECOND
    )


@pytest.mark.parametrize(
    ("grid", "seconds", "frames"),
    [((3, 4, 4), 1.0, None), ((3, 4, 4), 1.0, 290), ((5, 4, 6), 0.4, 120), ((2, 2, 2), 2.0, 700),
     ((4, 4, 4), 0.6667, 410), ((6, 2, 2), 0.08, 30)],
)  # fmt: skip
def test_video_placeholders_equal_the_processors(grid, seconds, frames):
    clip_tokens = None if frames is None else int(audio_token_count(frames))
    got = "".join(NAMES[int(i)] for i in expand(grid, seconds, clip_tokens))
    assert got == processor_placeholder(grid, seconds, clip_tokens)
    if frames is not None and grid[0] > 1 and clip_tokens > seconds * PER_SECOND:  # a video run after audio
        assert got.startswith("<|audio_start|><|video_pad|>") and "<|audio_pad|><|video_pad|>" in got


def video_batch(items: list[tuple], use_audio_in_video: bool, seed: int = 0) -> dict:
    """One row: text, then per item ``("video", grid, seconds, audio frames or None)``, ``("audio", frames)`` or
    ``("image", side)``; upstream's inputs (attention_mask, use_audio_in_video, video_second_per_grid)."""
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = torch.randint(0, 90, (3,), generator=gen).tolist()
    clips, videos, grids, seconds, images, image_grids = [], [], [], [], [], []
    for item in items:
        if item[0] == "video":
            _, grid, sec, frames = item
            clip = None if frames is None else int(audio_token_count(frames))
            ids += [V_START, *expand(grid, sec, clip).tolist(), V_END]
            videos.append(torch.randn(int(np.prod(grid)), PATCH_ROW, generator=gen))
            grids.append(grid)
            seconds.append(sec)
            if frames is not None:
                clips.append(torch.randn(MELS, frames, generator=gen))
        elif item[0] == "audio":
            ids += [A_START] + [AUDIO] * int(audio_token_count(item[1])) + [A_END]
            clips.append(torch.randn(MELS, item[1], generator=gen))
        else:
            ids += [V_START] + [IMAGE] * (item[1] ** 2 // 4) + [V_END]
            images.append(torch.randn(item[1] ** 2, PATCH_ROW, generator=gen))
            image_grids.append((1, item[1], item[1]))
        ids += torch.randint(0, 90, (2,), generator=gen).tolist()
    input_ids = torch.tensor([ids])
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
             "labels": input_ids.masked_fill(input_ids >= AUDIO, -100), "use_audio_in_video": use_audio_in_video,
             "pixel_values_videos": torch.cat(videos), "video_grid_thw": torch.tensor(grids),
             "video_second_per_grid": torch.tensor(seconds)}  # fmt: skip
    if images:
        batch.update(pixel_values=torch.cat(images), image_grid_thw=torch.tensor(image_grids))
    if clips:
        width = max(c.shape[1] for c in clips)
        batch["input_features"] = torch.stack(
            [torch.nn.functional.pad(c, (0, width - c.shape[1])) for c in clips]
        )
        batch["feature_attention_mask"] = torch.stack(
            [torch.arange(width) < c.shape[1] for c in clips]
        ).long()
    return batch


ROWS = {
    "video": ([("video", (3, 4, 4), 1.0, None)], False),
    "video+image+audio": ([("image", 4), ("video", (2, 4, 6), 0.4, None), ("audio", 40)], False),
    "audio_in_video": ([("video", (3, 4, 4), 1.0, 290)], True),
    "audio_in_video+audio+image": ([("audio", 130), ("video", (4, 2, 4), 0.4, 150), ("image", 4)], True),
}


def host_positions(batch: dict) -> np.ndarray:
    positions = Qwen3OmniMoePositions(tiny_config(), use_audio_in_video=batch["use_audio_in_video"])
    frames = batch.get("feature_attention_mask")
    return positions(
        batch["input_ids"][0].numpy(), batch.get("image_grid_thw"), batch["video_grid_thw"],
        None if frames is None else frames.sum(-1).numpy(), batch["video_second_per_grid"],
    )  # fmt: skip


@pytest.mark.parametrize("name", sorted(ROWS))
def test_host_positions_equal_upstream_get_rope_index(name):
    ref, _ = pair()
    batch = video_batch(*ROWS[name])
    frames = batch.get("feature_attention_mask")
    want, _ = ref.model.get_rope_index(
        batch["input_ids"], batch.get("image_grid_thw"), batch["video_grid_thw"], batch["attention_mask"],
        batch["use_audio_in_video"], None if frames is None else frames.sum(-1), batch["video_second_per_grid"],
    )  # fmt: skip
    got = host_positions(batch)
    np.testing.assert_array_equal(got, want[:, 0].numpy())
    video = (batch["input_ids"][0] == VIDEO).numpy()
    steps = len(set(got[0, video].tolist()))
    assert steps == batch["video_grid_thw"][:, 0].sum()  # one time step per grid step
    if batch["use_audio_in_video"]:  # merged by time: the track's temporal positions interleave the video's
        ids = batch["input_ids"][0].numpy()
        start = int(np.flatnonzero((ids[:-1] == V_START) & (ids[1:] == A_START))[0]) + 2
        block = slice(start, start + int(np.flatnonzero(ids[start:] == A_END)[0]))
        assert (np.diff(got[0, block]) >= 0).all()
        kinds = ids[block]
        assert kinds[0] == VIDEO and (kinds[1:] != kinds[:-1]).sum() >= 2  # video, audio, video again


@pytest.mark.parametrize("name", ["video", "audio_in_video+audio+image"])
def test_step_equals_upstream_forward_backward(name):
    ref, model = pair(seed=3)
    batch = video_batch(*ROWS[name], seed=4)
    want = ref(**batch)
    # Ours as the trainer runs it: no attention mask, the host positions.
    positions = torch.as_tensor(host_positions(batch))[:, None]
    got = model(**{**batch, "attention_mask": None}, position_ids=positions)
    want.loss.backward()
    got.loss.backward()
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=1e-6)
    theirs = dict(ref.named_parameters())
    for key, p in model.named_parameters():
        if theirs[key].grad is None:
            assert p.grad is None, key
            continue
        torch.testing.assert_close(
            p.grad, theirs[key].grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=key: f"{n}: {m}"
        )
    assert model.model.visual.patch_embed.proj.weight.grad.abs().sum() > 0
    if "audio" in name:
        assert model.model.audio_tower.conv2d1.weight.grad.abs().sum() > 0
