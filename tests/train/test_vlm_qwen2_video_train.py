"""Qwen2-VL and Qwen2.5-VL video rows through the data pipeline and the trainer.

* The encoder (`veomni.train.data.untimed_video.UntimedVideoEncoder`) writes each clip as one ``<|video_pad|>`` run of the
  Qwen2-VL video rule's grid, and its positions equal the upstream model's ``get_rope_index`` on the same ids and
  grids with ``second_per_grid_ts`` computed as the upstream processor does (``T / sampled_fps``).
* A video row changes the loss against the same row without its video.
* The trainer trains the video data of test_vlm_video_train (video files, frame lists, images, text) on one rank,
  and Ulysses SP=2 (ViT + LLM) gives the same per-step losses and grad norms.

The processor directory is test_multimodal_data's, with its video processor config replaced by a
``Qwen2VLVideoProcessor`` one of the same geometry (patch 2, merge 2, 2 fps, 2..8 frames, 16..256 pixels per frame).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from test_multimodal_data import END, IMAGE, START, VIDEO, make_processor_dir
from test_multimodal_video import write_video
from test_vlm_qwen2_train import FAMILIES, TEXT, VISION, initial_weights, recipe
from test_vlm_train import draw
from test_vlm_video_train import _video_steps, make_video_data

from veomni.models.qwen2_vl import data_rules
from veomni.models.qwen2_vl.positions import Qwen2VLPositions
from veomni.train.data import DataError, RowRef
from veomni.train.data.encode import load_tokenizer
from veomni.train.data.multimodal import load_image_processor
from veomni.train.data.untimed_video import UntimedVideoEncoder

STEPS = 2
REF = RowRef("rows.jsonl", 0, 1)
QWEN2_VIDEO = {
    "video_processor_type": "Qwen2VLVideoProcessor", "patch_size": 2, "temporal_patch_size": 2, "merge_size": 2,
    "size": {"shortest_edge": 16, "longest_edge": 256}, "do_sample_frames": True, "fps": 2.0, "min_frames": 2,
    "max_frames": 8, "cap_pixels_per_frame": False,
}  # fmt: skip


def make_qwen2_processor_dir(out: Path, **video) -> str:
    path = make_processor_dir(out)
    (out / "video_preprocessor_config.json").write_text(json.dumps({**QWEN2_VIDEO, **video}))
    return path


def tiny_config(family: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(
        family, text_config=copy.deepcopy(TEXT), vision_config=dict(VISION[family]), image_token_id=IMAGE,
        video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END, tie_word_embeddings=False,
    )  # fmt: skip


def encoder(path: str, family: str, media_root: str, max_frames: int | None = None) -> UntimedVideoEncoder:
    rule = data_rules.video_rule(path, None, fps=None, max_frames=max_frames, frame_pixels=None)
    return UntimedVideoEncoder(
        load_tokenizer(path), load_image_processor(path), "messages", "loss_mask", True, media_root=media_root,
        max_patches=None, video_rule=rule,
        positions=Qwen2VLPositions.from_config(tiny_config(family)),
    )  # fmt: skip


def row(*parts: dict, answer: str = "A moving square.") -> dict:
    user = [*parts, {"type": "text", "text": "What moves?"}]
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("qwen2_video")
    # 7 frames at 3 fps sampled at 2 fps: upstream keeps 4 frames (0, 1, 3, 5), sampled_fps 12/7.
    write_video(root / "clip.mov", frames=7, height=12, width=16, fps=3)
    frames = []
    for k in range(4):
        draw("red", ("square", "dot")[k % 2], (8, 12)).save(root / f"f{k}.png")
        frames.append(f"f{k}.png")
    draw("blue", "stripe", (12, 12)).save(root / "image.png")
    return {"root": str(root), "processor": make_qwen2_processor_dir(root / "processor"), "frames": frames}


@pytest.mark.parametrize("family", FAMILIES)
def test_expansion_and_positions_equal_the_processor_and_upstream(media, family):
    from transformers import AutoModelForImageTextToText

    enc = encoder(media["processor"], family, media["root"])
    parts = ({"type": "video", "video": "clip.mov"}, {"type": "image", "image": "image.png"},
             {"type": "video", "video": media["frames"], "fps": 4})  # fmt: skip
    ids, trained, sample = enc(row(*parts), REF)
    # Clip: 4 kept frames of 12x16 -> (2, 6, 8) -> 24 tokens; frames: 4 of 8x12 -> (2, 4, 6) -> 12 tokens.
    assert sample.video_grid_thw.tolist() == [[2, 6, 8], [2, 4, 6]]
    assert sample.pixel_values_videos.shape == (96 + 48, 3 * 2 * 2 * 2)
    runs = [len(r) for r in np.split(ids, np.flatnonzero(np.diff(ids == VIDEO)) + 1) if r[0] == VIDEO]
    assert runs == [24, 12] and not trained[ids == VIDEO].any()
    for where in np.flatnonzero(np.diff((ids == VIDEO).astype(int)) == 1):
        assert ids[where] == START  # no timestamp text: the template's vision start right before the run
    assert enc.measure(row(*parts), REF) == (len(ids), int(trained.sum()), 96 + 48 + 36)

    # Upstream: the processor's second_per_grid_ts = 2 / sampled_fps, sampled_fps = kept / total * fps.
    seconds = torch.tensor([2 / (4 / 7 * 3), 2 / 4])
    model = AutoModelForImageTextToText.from_config(tiny_config(family)).model
    input_ids = torch.from_numpy(ids)[None]
    want, _ = model.get_rope_index(
        input_ids, (input_ids == IMAGE).int() + 2 * (input_ids == VIDEO).int(),
        image_grid_thw=torch.from_numpy(sample.image_grid_thw),
        video_grid_thw=torch.from_numpy(sample.video_grid_thw),
        **({"second_per_grid_ts": seconds} if family == "qwen2_5_vl" else {}),
    )  # fmt: skip
    np.testing.assert_array_equal(sample.mrope, want[:, 0].numpy())
    if family == "qwen2_5_vl":
        # tokens_per_second 4: the clip's second temporal patch is int(4 * 7/6) = 4 ids on.
        first = int(np.flatnonzero(ids == VIDEO)[0])
        assert sample.mrope[0, first + 12] - sample.mrope[0, first] == 4

    # The collator lays the tower's tables out over the joint image-then-video grids (the model's own layout
    # function, as the trainer passes it): upstream's in-forward tables.
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_window_index

    from veomni.models.registry import MODELS
    from veomni.train.data.encode import Sample
    from veomni.train.data.multimodal_batch import collate_multimodal

    config = tiny_config(family)
    layout = MODELS.model_class(config, "image_text_to_text").cls(config).vision_collate_metadata()
    batch = collate_multimodal([Sample(ids, trained, 0, media=sample)], vision_metadata=layout)
    grids = torch.cat([batch["image_grid_thw"], batch["video_grid_thw"]])
    assert grids.tolist() == [[1, 6, 6], [2, 6, 8], [2, 4, 6]]
    tables = batch["vision_metadata"]
    assert torch.equal(tables["cu_seqlens"], get_vision_cu_seqlens(grids))
    if family == "qwen2_5_vl":
        index, cu_window = get_vision_window_index(grids, spatial_merge_size=2, window_size=8, patch_size=2)
        assert torch.equal(tables["window_index"], index) and torch.equal(
            tables["cu_window_seqlens"], cu_window
        )


def test_clips_the_rule_cannot_take_are_refused(media, tmp_path):
    path = make_qwen2_processor_dir(
        tmp_path / "p", do_sample_frames=False
    )  # no sampling rate to fall back on
    frames = row({"type": "video", "video": media["frames"]})
    ids, _, sample = encoder(path, "qwen2_vl", media["root"])(
        frames, REF
    )  # Qwen2-VL's positions need no time
    assert sample.video_grid_thw.tolist() == [[2, 4, 6]] and (ids == VIDEO).sum() == 12
    with pytest.raises(
        DataError, match=r"video 0 \(4 frame images\): a frame list without an fps; this model's positions"
    ):
        encoder(path, "qwen2_5_vl", media["root"])(frames, REF)
    # Without sampling every frame is kept: a clip above max_frames is refused (row and file named), not fed whole.
    clip = row({"type": "video", "video": "clip.mov"})
    with pytest.raises(DataError, match=r"clip.mov\): 7 frames, more than max_frames=4 .*set data.video_fps"):
        encoder(path, "qwen2_vl", media["root"], max_frames=4).measure(clip, REF)


@pytest.mark.parametrize("family", FAMILIES)
def test_video_changes_the_loss(media, family):
    from veomni.models.registry import MODELS
    from veomni.train.data.packing import shifted_labels

    enc = encoder(media["processor"], family, media["root"])
    torch.manual_seed(0)
    config = tiny_config(family)
    model = MODELS.model_class(config, "image_text_to_text").cls(config)  # the adapter
    losses = []
    for parts in (({"type": "video", "video": "clip.mov"},), ()):
        ids, trained, sample = enc(row(*parts), REF)
        out = model(
            input_ids=torch.from_numpy(ids)[None],
            position_ids=torch.from_numpy(sample.position_ids)[:, None],
            shift_labels=torch.from_numpy(shifted_labels(ids, trained))[None],
            pixel_values_videos=torch.from_numpy(sample.pixel_values_videos) if parts else None,
            video_grid_thw=torch.from_numpy(sample.video_grid_thw) if parts else None,
        )
        losses.append(float(out.loss.detach()))
    assert all(math.isfinite(x) for x in losses) and abs(losses[0] - losses[1]) > 1e-4, losses


@pytest.fixture(scope="module", params=FAMILIES)
def assets(request, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp(f"trainer_{request.param}")
    (root / "media").mkdir()
    return {
        "processor": make_qwen2_processor_dir(root / "processor"),
        "train": make_video_data(root / "media"),
        "media": str(root / "media"),
        "weights": initial_weights(root / "weights", request.param),
    }


@pytest.fixture(scope="module")
def one_rank(dist_pools, assets, tmp_path_factory) -> dict:
    raw = recipe(assets, str(tmp_path_factory.mktemp("one")))
    return dist_pools.get(1, "gloo").run(_video_steps, raw, STEPS)[0]


def test_trainer_trains_video_rows(one_rank):
    assert one_rank["videos"] > 0 and one_rank["images"] > 0
    for stats in one_rank["stats"]:
        assert math.isfinite(stats["loss"]) and math.isfinite(stats["grad_norm"]) and stats["grad_norm"] > 0


def test_video_rows_under_sp2_match_one_rank(dist_pools, assets, one_rank, tmp_path):
    raw = recipe(assets, str(tmp_path), sp=2)
    for result in dist_pools.get(2, "gloo").run(_video_steps, raw, STEPS):
        assert result["videos"] == one_rank["videos"]
        for got, want in zip(result["stats"], one_rank["stats"], strict=True):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)


def make_asymmetric_data(root: Path, rows: int = 32) -> str:
    """Runs of six short clip rows (frame lists; every third a video file), then two long text-only rows (about one
    micro-batch each run), so that under data parallelism one rank's micro-batch holds clips and the other's none."""
    lines = []
    for k in range(rows):
        if k % 8 < 6:
            if k % 3 == 0:
                write_video(root / f"{k}.mov", frames=4, height=8, width=8, fps=2)
                clip: dict = {"type": "video", "video": f"{k}.mov"}
            else:
                frames = []
                for f in range(2):
                    draw("red" if k % 2 else "blue", ("dot", "square")[f], (8, 8)).save(root / f"{k}_{f}.png")
                    frames.append(f"{k}_{f}.png")
                clip = {"type": "video", "video": frames, "fps": 2}
            user: list | str = [clip, {"type": "text", "text": "What blinks?"}]
            answer = f"A {'red' if k % 2 else 'blue'} shape."
        else:
            user, answer = "Name some colours.", " ".join(["red green blue yellow"] * 24)
        lines.append(
            json.dumps(
                {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}
            )
        )
    path = root / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _layout_steps(ctx, raw: dict) -> dict:
    from veomni.train.loop import build_run, train_step
    from veomni.train.recipe import recipe_from_dict

    run = build_run(recipe_from_dict(raw))
    it = iter(run.train_data)
    steps = [next(it) for _ in range(STEPS)]
    clips = [
        0 if b["video_grid_thw"] is None else len(b["video_grid_thw"]) for s in steps for b in s.micro_batches
    ]
    return {"stats": [train_step(run, s) for s in steps], "clips": clips}


def test_data_parallel_ranks_with_and_without_clips_match_one_rank(dist_pools, tmp_path_factory):
    """Qwen2.5-VL (the windowed tower), dp_replicate=2: at the same micro-batch one rank runs clips and the other
    only its tower's dummy forward; per-step loss and grad norm equal one process on the same data."""
    root = tmp_path_factory.mktemp("asymmetric")
    (root / "media").mkdir()
    assets = {
        "processor": make_qwen2_processor_dir(root / "processor"),
        "train": make_asymmetric_data(root / "media"),
        "media": str(root / "media"),
        "weights": initial_weights(root / "weights", "qwen2_5_vl"),
    }
    want = dist_pools.get(1, "gloo").run(_layout_steps, recipe(assets, str(root / "one")))[0]
    results = dist_pools.get(2, "gloo").run(_layout_steps, recipe(assets, str(root / "dp"), dp_replicate=2))
    assert sum(want["clips"]) > 0
    assert any(bool(a) != bool(b) for a, b in zip(results[0]["clips"], results[1]["clips"], strict=True)), [
        r["clips"] for r in results
    ]
    for result in results:
        for got, ref in zip(result["stats"], want["stats"], strict=True):
            assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
            assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)


def test_data_preview_shows_one_run_per_clip(assets, tmp_path):
    """``veomni-preview`` on a Qwen2-VL-family recipe writes that family's layout: one untrained placeholder span per
    clip inside the template's vision start/end, no timestamps."""
    import io
    import re

    from veomni.train.data.preview import preview
    from veomni.train.recipe import recipe_from_dict, save_recipe

    path = tmp_path / "vlm.yaml"
    save_recipe(recipe_from_dict(recipe(assets, str(tmp_path))), path)
    out = io.StringIO()
    preview([str(path), "--n", "4", "--samples", "0"], out)
    text = out.getvalue()
    assert " videos (grids [[2, " in text and "seconds>" not in text
    assert re.search(r"\[\[<\|im_start\|>user\n<\|vision_start\|><video x\d+><\|vision_end\|>What", text), text
