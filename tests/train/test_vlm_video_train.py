"""The vlm task on rows with videos: `build_run` + `train_step` of the tiny Qwen3-VL of `test_vlm_train` on a mix of
video files (written with PyAV), frame-list videos, images and text-only rows; on one rank and with ViT+LLM Ulysses
SP=2 on gloo (same losses and gradient norms).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from test_multimodal_data import make_processor_dir
from test_multimodal_video import write_video
from test_vlm_train import draw, initial_weights, vlm_recipe

STEPS = 2


def make_video_data(root: Path, rows: int = 16) -> str:
    """Every fourth row a video file, then a frame list, an image and a text-only row."""
    lines = []
    for k in range(rows):
        colour = ("red", "green", "blue", "yellow")[k % 4]
        if k % 4 == 0:
            write_video(root / f"{k}.mov", frames=6 + k % 3, height=12, width=16, fps=3)
            user = [{"type": "video", "video": f"{k}.mov"}, {"type": "text", "text": "What moves?"}]
        elif k % 4 == 1:
            frames = []
            for f in range(4):
                draw(colour, ("square", "dot")[f % 2], (8, 12)).save(root / f"{k}_{f}.png")
                frames.append(f"{k}_{f}.png")
            user = [{"type": "video", "video": frames, "fps": 2}, {"type": "text", "text": "What blinks?"}]
        elif k % 4 == 2:
            draw(colour, "stripe", (12, 12)).save(root / f"{k}.png")
            user = [{"type": "image", "image": f"{k}.png"}, {"type": "text", "text": "What is this?"}]
        else:
            user = "Name a colour."
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": f"A {colour} thing."}]
        lines.append(json.dumps({"messages": messages}))
    path = root / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vlm_video")
    (root / "media").mkdir()
    return {
        "processor": make_processor_dir(root / "processor"),
        "train": make_video_data(root / "media"),
        "media": str(root / "media"),
        "weights": initial_weights(root / "weights"),
    }


def _video_steps(ctx, raw: dict, n: int) -> dict:
    from veomni.train.loop import build_run, train_step
    from veomni.train.recipe import recipe_from_dict

    run = build_run(recipe_from_dict(raw))
    it = iter(run.train_data)
    steps = [next(it) for _ in range(n)]

    def count(key: str) -> int:
        return sum(int(b[key].shape[0]) for s in steps for b in s.micro_batches if b[key] is not None)

    videos, images = count("video_grid_thw"), count("image_grid_thw")
    return {"stats": [train_step(run, s) for s in steps], "videos": videos, "images": images}


@pytest.fixture(scope="module")
def one_rank(dist_pools, assets, tmp_path_factory) -> dict:
    raw = vlm_recipe(assets, str(tmp_path_factory.mktemp("one")), steps=STEPS)
    return dist_pools.get(1, "gloo").run(_video_steps, raw, STEPS)[0]


def test_video_rows_train(one_rank):
    assert one_rank["videos"] > 0 and one_rank["images"] > 0
    for stats in one_rank["stats"]:
        assert math.isfinite(stats["loss"]) and math.isfinite(stats["grad_norm"]) and stats["grad_norm"] > 0


def test_video_rows_under_sp2_match_one_rank(dist_pools, assets, one_rank, tmp_path):
    raw = vlm_recipe(assets, str(tmp_path), sp=2, steps=STEPS)
    for result in dist_pools.get(2, "gloo").run(_video_steps, raw, STEPS):
        assert result["videos"] == one_rank["videos"]
        for got, want in zip(result["stats"], one_rank["stats"], strict=True):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)


def test_data_preview_shows_video_spans(assets, tmp_path):
    import io

    from veomni.train.data.preview import preview
    from veomni.train.recipe import recipe_from_dict, save_recipe

    path = tmp_path / "vlm.yaml"
    save_recipe(recipe_from_dict(vlm_recipe(assets, str(tmp_path))), path)
    out = io.StringIO()
    preview([str(path), "--n", "4", "--samples", "0"], out)
    text = out.getvalue()
    assert " videos (grids [[2, " in text
    # Each temporal patch: its timestamp, then its placeholders collapsed into one span; all untrained.
    span = r"<\d+\.\d seconds><\|vision_start\|><video x\d+><\|vision_end\|>"
    assert re.search(rf"\[\[<\|im_start\|>user\n<\|vision_start\|>{span}{span}<\|vision_end\|>What", text)
    assert "]]A " in text
