"""Qwen2-VL and Qwen2.5-VL through the trainer (task vlm): every dense (dp, sp, ep) layout on 2 gloo ranks gives the
one-process per-step loss and grad norm (fp32) with micro-batches that hold no image on some ranks; the tower's
segment tables (Qwen2.5-VL: its window layout too) are computed by the collator, not in the forward; resume is
exact; video rows with a video processor config of another family (Qwen3-VL's) are refused with the reason (video
rows themselves: test_vlm_qwen2_video_train.py); the export loads in plain transformers and generates.

Processor, data and recipe come from test_vlm_train / test_vlm_moe_train (images of varying sizes, then runs of
text-only rows, unshuffled), with the tiny configs of tests/models/test_qwen2_vl.py at the trainer's vocabulary.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from test_multimodal_data import END, IMAGE, START, VIDEO, make_processor_dir
from test_vlm_moe_train import make_data
from test_vlm_train import draw, vlm_recipe

from veomni.train.recipe import recipe_from_dict

STEPS = 2
LAYOUTS = [(2, 1, 1), (1, 2, 1)]  # (dp_replicate, sp, ep) on 2 ranks; ep does not apply to dense models
FAMILIES = ("qwen2_vl", "qwen2_5_vl")
TEXT = {
    "vocab_size": 1032, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
}  # fmt: skip
VISION = {
    "qwen2_vl": {"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 4, "mlp_ratio": 2,
                 "patch_size": 2, "temporal_patch_size": 2, "spatial_merge_size": 2},
    "qwen2_5_vl": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4, "out_hidden_size": 64,
                   "patch_size": 2, "temporal_patch_size": 2, "spatial_merge_size": 2, "window_size": 8,
                   "fullatt_block_indexes": [1]},
}  # fmt: skip


def initial_weights(out: Path, family: str) -> str:
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.for_model(
        family, text_config=copy.deepcopy(TEXT), vision_config=dict(VISION[family]), image_token_id=IMAGE,
        video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vlm_qwen2")
    (root / "media").mkdir()
    return {
        "processor": make_processor_dir(root / "processor"),
        "train": make_data(root / "media"),
        "media": str(root / "media"),
        "root": root,
    }


@pytest.fixture(scope="module", params=FAMILIES)
def assets(request, data) -> dict:
    return {
        **data,
        "family": request.param,
        "weights": initial_weights(data["root"] / request.param, request.param),
    }


def recipe(assets: dict, out: str, *, dp_replicate: int = 1, sp: int = 1, steps: int = STEPS) -> dict:
    raw = vlm_recipe(assets, out, sp=sp, steps=steps)
    raw["parallel"] = {"dp_replicate": dp_replicate, "sp": sp}
    raw["data"]["shuffle"] = False
    return raw


def _steps(ctx, raw: dict, export: str | None = None) -> dict:
    from veomni.train.loop import build_run, train_step

    run = build_run(recipe_from_dict(raw))
    it = iter(run.train_data)
    steps = [next(it) for _ in range(STEPS)]
    batches = [b for s in steps for b in s.micro_batches]
    imageless = sum(b["image_grid_thw"] is None for b in batches)
    layouts = [sorted(b["vision_metadata"]) for b in batches if b["vision_metadata"] is not None]
    stats = [train_step(run, s) for s in steps]
    if export is not None:
        run.task.export(run.model, Path(export), run.tokenizer, run.state)
    return {"stats": stats, "imageless": imageless, "layouts": layouts}


@pytest.fixture(scope="module")
def one_rank(dist_pools, assets, tmp_path_factory) -> dict:
    raw = recipe(assets, str(tmp_path_factory.mktemp("one")))
    export = str(tmp_path_factory.mktemp("export"))
    return {**dist_pools.get(1, "gloo").run(_steps, raw, export)[0], "export": export}


def test_one_rank_trains_and_the_collator_lays_out_windows(one_rank, assets):
    losses = [s["loss"] for s in one_rank["stats"]]
    assert all(math.isfinite(x) for x in losses), losses
    want = ["cu_seqlens", "max_seqlen"]  # the per-frame segments; Qwen2.5-VL adds its windows
    if assets["family"] == "qwen2_5_vl":
        want = ["cu_seqlens", "cu_window_seqlens", "max_seqlen", "max_window_seqlen", "window_index"]
    assert one_rank["layouts"] and all(keys == want for keys in one_rank["layouts"])


def test_every_layout_matches_one_process(dist_pools, assets, one_rank, tmp_path):
    pool = dist_pools.get(2, "gloo")
    for dp_replicate, sp, ep in LAYOUTS:
        layout = f"dp_replicate={dp_replicate} sp={sp} ep={ep}"
        raw = recipe(assets, str(tmp_path / layout.replace(" ", "_")), dp_replicate=dp_replicate, sp=sp)
        results = pool.run(_steps, raw)
        imageless = [r["imageless"] for r in results]
        assert sum(imageless) > 0, layout
        if sp == 1:  # data parallel: one rank's micro-batch has images while the other's has none
            assert len(set(imageless)) == 2, (layout, imageless)
        for result in results:
            for step, (got, want) in enumerate(zip(result["stats"], one_rank["stats"], strict=True)):
                assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), (layout, step)
                assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), (layout, step)


def _resume(ctx, raw: dict, split: int, total: int) -> tuple[list[float], list[float]]:
    from veomni.train.loop import _save, build_run, train_step

    straight = build_run(recipe_from_dict(raw))
    it = iter(straight.train_data)
    want = [train_step(straight, next(it))["loss"] for _ in range(total)]
    first = build_run(recipe_from_dict(raw))
    it = iter(first.train_data)
    got = [train_step(first, next(it))["loss"] for _ in range(split)]
    _save(first)
    resumed = copy.deepcopy(raw)
    resumed["checkpoint"]["resume"] = "auto"
    second = build_run(recipe_from_dict(resumed))
    assert second.step == split
    it = iter(second.train_data)
    got += [train_step(second, next(it))["loss"] for _ in range(total - split)]
    return want, got


def test_resume_is_exact(dist_pools, assets, tmp_path):
    if assets["family"] != "qwen2_5_vl":
        pytest.skip(
            "resume is model-agnostic: run for the family with the extra collator state (windows) only"
        )
    raw = recipe(assets, str(tmp_path), steps=3)
    want, got = dist_pools.get(1, "gloo").run(_resume, raw, 1, 3)[0]
    assert got == want


def test_export_loads_in_plain_transformers_and_generates(one_rank, assets):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    out = Path(one_rank["export"])
    model = AutoModelForImageTextToText.from_pretrained(out).eval()
    assert model.config.model_type == assets["family"] and type(model).__module__.startswith("transformers.")
    tokenizer, images = AutoTokenizer.from_pretrained(out), AutoImageProcessor.from_pretrained(out)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    pixels = images(images=[draw("red", "dot", (12, 16))], return_tensors="pt")
    tokens = int(pixels["image_grid_thw"].prod()) // images.merge_size**2
    ids = tokenizer(text.replace("<|image_pad|>", "<|image_pad|>" * tokens), return_tensors="pt")["input_ids"]
    generated = model.generate(
        input_ids=ids, mm_token_type_ids=(ids == IMAGE).int(), max_new_tokens=4, do_sample=False, **pixels
    )
    assert generated.shape == (1, ids.shape[1] + 4)


def _build_error(ctx, raw: dict) -> str:
    from veomni.train.loop import build_run

    try:
        build_run(recipe_from_dict(raw))
    except Exception as err:  # noqa: BLE001 - the message is the result
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_video_rows_with_a_qwen3_video_processor_are_refused_with_the_reason(dist_pools, assets, tmp_path):
    """The processor directory holds a Qwen3-VL video processor config (pixel budgets over all frames), which the
    Qwen2-VL video rule does not read: a video row is an error naming why, never silently other pixels."""
    import json

    frames = []
    for k in range(2):
        draw("red", "dot", (8, 8)).save(tmp_path / f"f{k}.png")
        frames.append(f"f{k}.png")
    turns = [{"role": "user", "content": [{"type": "video", "video": frames, "fps": 2},
                                          {"type": "text", "text": "What blinks?"}]},
             {"role": "assistant", "content": "A dot."}]  # fmt: skip
    (tmp_path / "video.jsonl").write_text(json.dumps({"messages": turns}) + "\n")
    raw = recipe(assets, str(tmp_path / "out"))
    raw["data"].update({"train_files": [str(tmp_path / "video.jsonl")], "media_root": str(tmp_path)})
    message = dist_pools.get(1, "gloo").run(_build_error, raw)[0]
    assert "video 0 cannot be encoded" in message, message
    assert "holds no usable video processor config for qwen2" in message, message
    assert "is a Qwen3VLVideoProcessor config; Qwen2-VL / Qwen2.5-VL videos need" in message, message
