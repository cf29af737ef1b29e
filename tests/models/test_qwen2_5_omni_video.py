"""Qwen2.5-Omni thinker with videos, and videos with their audio tracks (``use_audio_in_video``).

Oracles: transformers' ``Qwen2_5OmniProcessor`` placeholder methods (``replace_video_token``, which dispatches to
``replace_video_with_audio_token``; the processor's constructor and its video processor need torchvision, so it is
built with just the attributes those methods read), the upstream thinker's ``get_rope_index`` and its
forward/backward (fp32, eager) on the same inputs. FSDP2 with a video on one rank only:
test_qwen2_5_omni_video_dist.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from models.test_qwen2_5_omni import (
    A_END,
    A_START,
    AUDIO,
    IMAGE,
    MELS,
    V_END,
    V_START,
    VIDEO,
    audio_tokens,
    pair,
    tiny_config,
)  # fmt: skip

from veomni.models.qwen2_5_omni.positions import Qwen2_5OmniPositions
from veomni.models.qwen2_5_omni.video import VideoTokens, video_placeholder_ids

TOKENS = VideoTokens(VIDEO, AUDIO, A_START, A_END)
NAMES = {VIDEO: "<|VIDEO|>", AUDIO: "<|AUDIO|>", A_START: "<|audio_bos|>", A_END: "<|audio_eos|>"}
PATCH_ROW = 3 * 2 * 2 * 2  # channels * temporal patch * patch**2 of the tiny tower


def hf_processor():
    """``Qwen2_5OmniProcessor`` with what its video placeholder methods read (its constructor needs torchvision)."""
    from transformers import Qwen2_5OmniProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    processor = Qwen2_5OmniProcessor.__new__(Qwen2_5OmniProcessor)
    processor.video_processor = Qwen3VLVideoProcessor(merge_size=2)  # only merge_size is read
    processor.video_token, processor.audio_token = NAMES[VIDEO], NAMES[AUDIO]
    processor.audio_bos_token, processor.audio_eos_token = NAMES[A_START], NAMES[A_END]
    return processor


def expand(grid, seconds: float, clip_tokens: int | None) -> np.ndarray:
    return video_placeholder_ids(grid, 2, TOKENS, seconds, audio_tokens=clip_tokens, position_id_per_seconds=25,
                                 seconds_per_chunk=2.0)  # fmt: skip


@pytest.mark.parametrize(
    ("grid", "seconds", "frames"),
    [((3, 4, 4), 1.0, None), ((3, 4, 4), 1.0, 290), ((5, 4, 6), 0.8, 120), ((2, 2, 2), 2.0, 700),
     ((4, 4, 4), 0.6667, 410)],
)  # fmt: skip
def test_video_placeholders_equal_the_processors(grid, seconds, frames):
    clip_tokens = None if frames is None else audio_tokens(frames)
    got = "".join(NAMES[int(i)] for i in expand(grid, seconds, clip_tokens))
    want = hf_processor().replace_video_token(
        {"video_grid_thw": [np.asarray(grid)], "video_second_per_grid": [seconds]}, 0,
        processed_audio={"num_audio_tokens": [clip_tokens]}, video_to_audio_indices=[0],
        load_audio_from_video=frames is not None, position_id_per_seconds=25, seconds_per_chunk=2.0,
    )  # fmt: skip
    assert got == want
    if frames is not None:  # interleaved: a video run, an audio run, then video again
        assert got.startswith("<|audio_bos|><|VIDEO|>") and "<|AUDIO|><|VIDEO|>" in got


def video_batch(items: list[tuple], use_audio_in_video: bool, seed: int = 0) -> dict:
    """One row: text, then per item ``("video", grid, seconds, audio frames or None)``, ``("audio", frames)`` or
    ``("image", side)``; upstream's inputs (attention_mask, use_audio_in_video, video_second_per_grid)."""
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = torch.randint(0, 90, (3,), generator=gen).tolist()
    clips, videos, grids, seconds, images, image_grids = [], [], [], [], [], []
    for item in items:
        if item[0] == "video":
            _, grid, sec, frames = item
            clip = None if frames is None else audio_tokens(frames)
            ids += [V_START, *expand(grid, sec, clip).tolist(), V_END]
            videos.append(torch.randn(int(np.prod(grid)), PATCH_ROW, generator=gen))
            grids.append(grid)
            seconds.append(sec)
            if frames is not None:
                clips.append(torch.randn(MELS, frames, generator=gen))
        elif item[0] == "audio":
            ids += [A_START] + [AUDIO] * audio_tokens(item[1]) + [A_END]
            clips.append(torch.randn(MELS, item[1], generator=gen))
        else:
            ids += [V_START] + [IMAGE] * (item[1] ** 2 // 4) + [V_END]
            images.append(torch.randn(item[1] ** 2, PATCH_ROW, generator=gen))
            image_grids.append((1, item[1], item[1]))
        ids += torch.randint(0, 90, (2,), generator=gen).tolist()
    input_ids = torch.tensor([ids])
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
             "labels": input_ids.masked_fill(input_ids >= AUDIO, -100), "use_audio_in_video": use_audio_in_video}  # fmt: skip
    if videos:
        batch.update(pixel_values_videos=torch.cat(videos), video_grid_thw=torch.tensor(grids),
                     video_second_per_grid=torch.tensor(seconds))  # fmt: skip
    if images:
        batch.update(pixel_values=torch.cat(images), image_grid_thw=torch.tensor(image_grids))
    if clips:
        width = max(c.shape[1] for c in clips)
        batch["input_features"] = torch.stack([torch.nn.functional.pad(c, (0, width - c.shape[1])) for c in clips])
        batch["feature_attention_mask"] = torch.stack([torch.arange(width) < c.shape[1] for c in clips]).long()
    return batch


ROWS = {
    "video": ([("video", (3, 4, 4), 1.0, None)], False),
    "video+image+audio": ([("image", 4), ("video", (2, 4, 6), 0.5, None), ("audio", 40)], False),
    "audio_in_video": ([("video", (3, 4, 4), 1.0, 290)], True),
    "audio_in_video+audio+image": ([("audio", 30), ("video", (4, 2, 4), 0.8, 150), ("image", 4)], True),
}


def host_positions(batch: dict) -> np.ndarray:
    positions = Qwen2_5OmniPositions(tiny_config(), use_audio_in_video=batch["use_audio_in_video"])
    frames = batch.get("feature_attention_mask")
    return positions(
        batch["input_ids"][0].numpy(), batch.get("image_grid_thw"), batch.get("video_grid_thw"),
        None if frames is None else frames.sum(-1).numpy(), batch.get("video_second_per_grid"),
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
    assert len(set(got[0, video].tolist())) == batch["video_grid_thw"][:, 0].sum()  # one time step per grid step
    if batch["use_audio_in_video"]:  # the track's tokens sit between the video's, time-aligned
        audio = np.flatnonzero((batch["input_ids"][0] == AUDIO).numpy())
        assert audio[0] < np.flatnonzero(video)[-1]


@pytest.mark.parametrize("name", sorted(ROWS))
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
        torch.testing.assert_close(p.grad, theirs[key].grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=key: f"{n}: {m}")
    assert model.model.visual.patch_embed.proj.weight.grad.abs().sum() > 0
    if "audio" in name:
        assert model.model.audio_tower.conv1.weight.grad.abs().sum() > 0


def test_video_changes_the_loss_and_its_audio_track_too():
    _, model = pair()
    batch = video_batch(*ROWS["audio_in_video"])
    base = model(**batch).loss
    assert not torch.allclose(model(**{**batch, "pixel_values_videos": batch["pixel_values_videos"] * 2}).loss, base)
    assert not torch.allclose(model(**{**batch, "input_features": batch["input_features"] * 2}).loss, base)


@pytest.mark.cuda
def test_gpu_default_ops_match_upstream_on_audio_in_video_rows():
    """On a GPU: the default OpsConfig (veomni attention in the LM and both towers, fused linear cross-entropy) on
    an audio-in-video + image + audio row with host positions, against upstream eager, fp32 with TF32 off."""
    from veomni.kernels import OpsConfig
    from veomni.models.hf.kernel_hooks import apply_ops

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ref, model = pair(seed=5)
    ref, model = ref.cuda(), model.cuda()
    apply_ops(model, OpsConfig(attention="sdpa", cross_entropy="triton"))
    batch = video_batch(*ROWS["audio_in_video+audio+image"], seed=6)
    positions = torch.as_tensor(host_positions(batch))[:, None]
    batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    want = ref(**batch)
    got = model(**{**batch, "attention_mask": None}, position_ids=positions.cuda())
    want.loss.backward()
    got.loss.backward()
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-5)
    theirs = dict(ref.named_parameters())
    for key, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, theirs[key].grad, rtol=1e-3, atol=1e-5, msg=lambda m, n=key: f"{n}: {m}")
