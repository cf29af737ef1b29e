"""Smoke and parity test of tools/bench/bench_vlm.py on CPU: a tiny Qwen3-VL and a tiny Qwen2.5-VL (windowed ViT,
the window layout from the collator for veomni), veomni against plain HF.

Every contender loads the same saved weights and trains on the same mixed image/text packed rows; in fp32 the
losses and grad norms must agree step for step, which checks that the benchmark feeds both sides the same
images, positions and labels (a contender that dropped the pixels would diverge at step 0).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from bench_loader import load_bench

bench = load_bench("bench_vlm.py")


def test_rows_are_full_and_placeholders_match_the_grids():
    config = bench.vlm_config(tiny=True)
    batches = bench.packed_vlm_batches(4, 700, config, 0.7, bench.TINY_IMAGE_SIZES, seed=3)
    merge = config.vision_config.spatial_merge_size
    for b in batches:
        ids = b["input_ids"][0]
        assert ids.numel() == 700 == sum(b["doc_lens"])
        placeholders = int((ids == config.image_token_id).sum())
        grids = b["image_grid_thw"]
        expected = 0 if grids is None else int(grids.prod(dim=1).sum()) // merge**2
        assert placeholders == expected
        assert b["num_patches"] == (0 if grids is None else int(grids.prod(dim=1).sum()))
        if grids is not None:
            assert b["pixel_values"].shape[0] == b["num_patches"]
        labels = b["labels"][0]
        assert not bool((labels == config.image_token_id).any())  # image tokens are never targets
        assert b["position_ids"].shape == (4, 1, 700)
    assert sum(b["images"] for b in batches) > 0
    again = bench.packed_vlm_batches(4, 700, config, 0.7, bench.TINY_IMAGE_SIZES, seed=3)
    assert all(np.array_equal(a["input_ids"], c["input_ids"]) for a, c in zip(batches, again, strict=True))


def test_qwen2_5_vl_clips_are_one_run_per_grid_with_the_models_positions():
    config = bench.vlm_config(tiny=True, model="qwen2_5_vl_7b")
    batches = bench.packed_vlm_batches(4, 700, config, 0.3, bench.TINY_IMAGE_SIZES, 3, 0.4, 2)
    merge = config.vision_config.spatial_merge_size
    for b in batches:
        ids = b["input_ids"][0]
        grids = b["video_grid_thw"]
        expected = 0 if grids is None else int(grids.prod(dim=1).sum()) // merge**2
        assert int((ids == config.video_token_id).sum()) == expected
        if grids is not None:
            assert grids[:, 0].tolist() == [2] * len(grids) and b["pixel_values_videos"].shape[0] == grids.prod(1).sum()
    assert sum(b["videos"] for b in batches) > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, video_fraction", [("qwen3_vl_2b", 0.0), ("qwen2_5_vl_7b", 0.0), ("qwen2_5_vl_7b", 0.3)]
)
def test_fp32_contenders_match_step_for_step(tmp_path, model, video_fraction):
    out = tmp_path / "vlm.json"
    args = [
        "--model",
        model,
        "--tiny",
        "--seq-len",
        "600",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--device",
        "cpu",
        "--precision",
        "fp32",
    ]
    if video_fraction:  # clip conversations too: HF places and positions them from the same 4-row position ids
        args += ["--video-fraction", str(video_fraction)]
    bench.main([*args, "--contenders", "veomni,veomni_plain,hf", "--out", str(out)])
    result = json.loads(out.read_text())
    runs = result["contenders"]
    assert sum(result["data"]["images_per_micro_batch"]) > 0
    assert (sum(result["data"]["videos_per_micro_batch"]) > 0) == bool(video_fraction)
    assert result["model"] == f"tiny {model} (smoke)"
    for r in runs.values():
        assert "error" not in r, r.get("error")
        assert len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"] + r["grad_norms"])
    hf = runs["hf"]
    for name in ("veomni", "veomni_plain"):
        assert runs[name]["losses"] == pytest.approx(hf["losses"], rel=1e-5)
        assert runs[name]["grad_norms"] == pytest.approx(hf["grad_norms"], rel=1e-4)
    assert result["ratios"]["veomni/hf"]["tokens_per_s"] == pytest.approx(
        runs["veomni"]["tokens_per_s_per_gpu"] / hf["tokens_per_s_per_gpu"]
    )
