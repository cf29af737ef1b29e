"""The vlm task end to end: `build_run` + `train_step` of a tiny Qwen3-VL (2 text layers, ViT depth 1) on
synthetic shape/colour images, on one rank and with ViT+LLM Ulysses SP=2 on gloo (same losses), and the export.

The processor directory is `test_multimodal_data.make_processor_dir` (quickstart tokenizer + vision tokens +
a PIL ``Qwen2VLImageProcessor``); the model starts from weights saved by plain transformers so that both layouts
start identical.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from test_multimodal_data import END, IMAGE, START, VIDEO, make_processor_dir

from veomni.train.recipe import load_recipe, recipe_from_dict, recipe_to_dict

STEPS = 3
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 220), "yellow": (230, 210, 40)}
SHAPES = ("square", "stripe", "dot")


def tiny_config() -> dict:
    return {
        "text_config": {
            "vocab_size": 1032, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
            "rope_parameters": {
                "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True,
            },
        },
        "vision_config": {
            "depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4, "patch_size": 2,
            "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 64, "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0],
        },
        "image_token_id": IMAGE, "video_token_id": VIDEO, "vision_start_token_id": START, "vision_end_token_id": END,
        "tie_word_embeddings": False,
    }  # fmt: skip


def draw(colour: str, shape: str, size: tuple[int, int]):
    from PIL import Image, ImageDraw

    height, width = size
    image = Image.new("RGB", (width, height), (245, 245, 245))
    pen = ImageDraw.Draw(image)
    box = (width // 4, height // 4, 3 * width // 4, 3 * height // 4)
    if shape == "square":
        pen.rectangle(box, fill=COLOURS[colour])
    elif shape == "dot":
        pen.ellipse(box, fill=COLOURS[colour])
    else:
        pen.rectangle((0, height // 3, width, 2 * height // 3), fill=COLOURS[colour])
    return image


def make_data(root: Path, rows: int = 48) -> str:
    """``rows`` conversations over small images (sizes vary so grids differ); some rows hold two images and
    every fifth none."""
    lines = []
    sizes = [(8, 8), (12, 16), (16, 12), (10, 10)]
    for k in range(rows):
        colour, shape = list(COLOURS)[k % 4], SHAPES[k % 3]
        name = f"{k}.png"
        draw(colour, shape, sizes[k % 4]).save(root / name)
        if k % 5 == 4:
            user: list | str = "Name a colour."
        elif k % 7 == 3:
            user = [{"type": "image", "image": name}, {"type": "image", "image": f"{k - 1}.png"},
                    {"type": "text", "text": "What is the first?"}]  # fmt: skip
        else:
            user = [{"type": "image", "image": name}, {"type": "text", "text": "What is this?"}]
        answer = f"A {colour} {shape}." if k % 5 != 4 else f"{colour.capitalize()}."
        lines.append(
            json.dumps(
                {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}
            )
        )
    path = root / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def initial_weights(out: Path) -> str:
    from transformers import AutoConfig, AutoModelForImageTextToText

    values = tiny_config()
    config = AutoConfig.for_model("qwen3_vl", **values)
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vlm")
    (root / "media").mkdir()
    return {
        "processor": make_processor_dir(root / "processor"),
        "train": make_data(root / "media"),
        "media": str(root / "media"),
        "weights": initial_weights(root / "weights"),
    }


def vlm_recipe(assets: dict, out: str, *, sp: int = 1, **train) -> dict:
    raw = recipe_to_dict(load_recipe("quickstart"))
    raw["model"].update({"config": None, "weights": assets["weights"], "tokenizer": assets["processor"],
                         "task": "vlm", "dtype": "float32"})  # fmt: skip
    raw["data"].update({"train_files": [assets["train"]], "eval_files": [], "kind": "multimodal",
                        "media_root": assets["media"], "max_seq_len": 256, "overlong": "error", "num_workers": 0,
                        "patches_per_micro_batch": 512})  # fmt: skip
    raw["parallel"] = {"sp": sp}
    raw["train"].update({"tokens_per_step": 512, "tokens_per_micro_batch": 256, "steps": STEPS, "epochs": None,
                         "eval_interval": None, "log_interval": 1, **train})  # fmt: skip
    raw["optim"].update({"warmup_steps": 1, "lr": 3e-3})
    raw["ops"] = {}
    raw["checkpoint"].update({"dir": out, "resume": "never", "save_final": False, "hf_export": False})
    return raw


def _steps(ctx, raw: dict, n: int, export: str | None = None) -> dict:
    from veomni.train.loop import build_run, train_step

    run = build_run(recipe_from_dict(raw))
    it = iter(run.train_data)
    steps = [next(it) for _ in range(n)]
    images = sum(
        int(b["image_grid_thw"].shape[0])
        for s in steps
        for b in s.micro_batches
        if b["image_grid_thw"] is not None
    )
    flops = [run.task.step_flops(s) for s in steps]
    stats = [train_step(run, s) for s in steps]
    if export is not None:
        run.task.export(run.model, Path(export), run.tokenizer, run.state)
    return {"stats": stats, "images": images, "flops": flops}


@pytest.fixture(scope="module")
def one_rank(dist_pools, assets, tmp_path_factory) -> dict:
    raw = vlm_recipe(assets, str(tmp_path_factory.mktemp("one")))
    export = str(tmp_path_factory.mktemp("export"))
    return {**dist_pools.get(1, "gloo").run(_steps, raw, STEPS, export)[0], "export": export}


def test_one_rank_trains(one_rank):
    losses = [s["loss"] for s in one_rank["stats"]]
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], losses
    assert one_rank["images"] > 0
    assert all(f > 0 for f in one_rank["flops"])


def test_export_loads_in_plain_transformers_and_generates(one_rank, assets):
    """Weights + tokenizer/chat template + preprocessor config: plain transformers loads them and generates from
    an image (placeholders expanded by Qwen3-VL processor's rule; ``AutoProcessor`` itself needs torchvision)."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    out = Path(one_rank["export"])
    assert (out / "preprocessor_config.json").is_file() and (out / "chat_template.jinja").is_file()
    model = AutoModelForImageTextToText.from_pretrained(out).eval()
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


def test_sp2_matches_one_rank(dist_pools, assets, one_rank, tmp_path):
    raw = vlm_recipe(assets, str(tmp_path), sp=2)
    for result in dist_pools.get(2, "gloo").run(_steps, raw, STEPS):
        for got, want in zip(result["stats"], one_rank["stats"], strict=True):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
        # The attention term counts the SP padding segment (cu_seqlens of the padded row): within 1e-5.
        assert result["flops"] == pytest.approx(one_rank["flops"], rel=1e-5)


def test_task_and_kind_must_match(assets, tmp_path):
    from veomni.train.data import DataError
    from veomni.train.data.build import check_task_and_kind

    raw = vlm_recipe(assets, str(tmp_path))
    check_task_and_kind(recipe_from_dict(raw))
    bad = copy.deepcopy(raw)
    bad["data"]["kind"] = "conversation"
    # Refused by the recipe for conversation data.
    for media_field in ("media_root", "patches_per_micro_batch"):
        bad["data"].pop(media_field, None)
    with pytest.raises(DataError, match=r"model.task='vlm' trains on data.kind in \['multimodal'\]"):
        check_task_and_kind(recipe_from_dict(bad))


def test_vlm_flops_split_language_model_and_tower():
    """The LM term counts the language model's matmul weights only (no embedding lookup, no tower); the tower
    term counts its weights per patch, the patch mergers per merge**2 patches."""
    from transformers import AutoConfig

    from veomni.train.data import Step
    from veomni.train.loop import meta_instance
    from veomni.train.tasks import build_task
    from veomni.train.tasks.vision import VlmTask

    config = AutoConfig.for_model("qwen3_vl", **tiny_config())
    probe = meta_instance(config, "image_text_to_text")
    task = build_task("vlm", probe)
    assert isinstance(task, VlmTask) and task.model_task == "image_text_to_text"
    lm = sum(
        p.numel()
        for n, p in probe.named_parameters()
        if p.dim() >= 2 and not n.startswith("model.visual.") and "embed_tokens" not in n
    )
    assert task.flops_per_token == 6.0 * lm
    per_patch = sum(
        p.numel() / (4 if "merger" in n else 1)
        for n, p in probe.model.visual.named_parameters()
        if p.dim() >= 2 and n != "pos_embed.weight"  # Qwen3-VL's learned position table is looked up
    )
    assert probe.model.visual.pos_embed.weight.numel() > 0
    assert task.vision_flops_per_patch == pytest.approx(6.0 * per_patch)
    batch = {"cu_seqlens": torch.tensor([0, 10, 30], dtype=torch.int32)}
    step = Step(step=0, epoch=0, micro_batches=[batch], tokens=30, valid_tokens=5, patches=96)
    text_only = Step(step=0, epoch=0, micro_batches=[batch], tokens=30, valid_tokens=5)
    assert task.step_flops(step) - task.step_flops(text_only) == pytest.approx(
        96 * task.vision_flops_per_patch
    )


def test_data_preview_shows_image_spans_and_the_loss_mask(assets, tmp_path):
    import io

    from veomni.train.data.preview import preview
    from veomni.train.recipe import save_recipe

    path = tmp_path / "vlm.yaml"
    save_recipe(recipe_from_dict(vlm_recipe(assets, str(tmp_path))), path)
    out = io.StringIO()
    preview([str(path), "--n", "1", "--samples", "0"], out)
    text = out.getvalue()
    assert "    vision: " in text and " patches (grids [[1, " in text
    # Image placeholders collapse to one span, untrained; the answer is trained (not bracketed).
    assert "[[<|im_start|>user\n<|vision_start|><image x" in text
    assert "]]A " in text and "<|im_end|>\n" in text


def test_resumes_exactly_from_a_checkpoint_saved_before_the_first_image(dist_pools, assets, tmp_path):
    # Saved at step 0: no parameter (the vision tower's included) has AdamW state yet (issue 42).
    from resume_helpers import check_exact_resume, resume_before_gradients

    raw = vlm_recipe(assets, str(tmp_path / "run"), steps=2)
    (result,) = dist_pools.get(1, "gloo").run(resume_before_gradients, raw, 0, 2)
    check_exact_resume(result, some="visual")
