"""The dit task's bad input: a transformers checkpoint given as a DiT, ops the hf backend would ignore, condition
directories missing a model, clips and frames of the wrong shape or order, mixed parquet files, truncated latent
shards -- each a clear error naming what was expected and what was found (issue 18, item 7)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from test_dit_train import QUICKSTART, _build_error, dit_recipe

from veomni.train.recipe import recipe_from_dict

# ---------------------------------------------------------------- bad input


def test_ops_under_the_hf_backend_are_refused_not_ignored(dist_pools, tmp_path):
    # model.backend=hf keeps diffusers' own attention code: kernels the recipe names would silently not run.
    raw = dit_recipe(str(tmp_path))
    raw["model"]["backend"] = "hf"
    raw["ops"] = {"attention": "eager", "rms_norm": "eager"}
    kind, message = dist_pools.get(1, "gloo").run(_build_error, raw)[0]
    assert kind == "PreflightError", message
    assert "model.backend=hf" in message and "'attention': 'eager'" in message and "'rms_norm': 'eager'" in message
    del raw["ops"]
    assert dist_pools.get(1, "gloo").run(_build_error, raw)[0] == ("no error", "")


def test_transformers_checkpoint_as_dit_is_refused(dist_pools, tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model("qwen3", hidden_size=32, num_hidden_layers=1).save_pretrained(tmp_path / "qwen")
    raw = dit_recipe(str(tmp_path / "run"))
    raw["model"]["config"] = str(tmp_path / "qwen")
    kind, message = dist_pools.get(1, "gloo").run(_build_error, raw)[0]
    assert kind == "PreflightError"
    assert "transformers checkpoint (model_type 'qwen3')" in message and str(tmp_path / "qwen") in message
    assert "diffusers config.json with _class_name" in message
    # A Wan pipeline root where the transformer subfolder is meant.
    shutil.copytree(QUICKSTART / "condition", tmp_path / "wan")
    raw["model"]["config"] = str(tmp_path / "wan")
    kind, message = dist_pools.get(1, "gloo").run(_build_error, raw)[0]
    assert kind == "PreflightError" and f"to {tmp_path / 'wan' / 'transformer'}" in message


def test_a_diffusers_model_no_family_declares_is_refused(dist_pools, tmp_path):
    # The dit task asks the transformer's family for its DiffusionRules: a diffusers class without them is refused
    # before anything is built, naming it and the diffusion transformers veomni has.
    (tmp_path / "flux").mkdir()
    (tmp_path / "flux" / "config.json").write_text(
        json.dumps({"_class_name": "FluxTransformer2DModel", "num_layers": 1, "patch_size": 1})
    )
    raw = dit_recipe(str(tmp_path / "run"))
    raw["model"].update({"config": str(tmp_path / "flux"), "weights": None})
    kind, message = dist_pools.get(1, "gloo").run(_build_error, raw)[0]
    assert kind == "PreflightError", message
    assert "'FluxTransformer2DModel'" in message and str(tmp_path / "flux") in message
    assert "WanTransformer3DModel (family 'wan')" in message


def test_the_condition_mode_is_the_familys(tmp_path):
    """dit.mode is checked against the transformer family's modes (DiffusionRules.modes); null takes its first."""
    from veomni.train.preflight import PreflightError
    from veomni.train.tasks.dit_setup import dit_rules, transformer_config, with_condition_mode

    raw = dit_recipe(str(tmp_path))
    raw["dit"]["mode"] = None
    recipe = recipe_from_dict(raw)
    rules = dit_rules(transformer_config(recipe))
    assert with_condition_mode(recipe, rules).dit.mode == "t2v"
    raw["dit"]["mode"] = "v2v"
    with pytest.raises(PreflightError, match=r"dit.mode: condition mode 'v2v' is not one this model trains \(t2v: "):
        with_condition_mode(recipe_from_dict(raw), rules)


@pytest.mark.parametrize("length", [512, 500, 1024])
def test_i2v_prompt_length_must_be_the_one_wan_splits_at(tmp_path, length):
    # Wan's image-conditioned cross-attention takes the context's last 512 tokens as the prompt and the rest as
    # CLIP tokens: another prompt length would route tokens through the wrong projections without an error.
    from models.test_dit_condition import write_wan_dir

    from veomni.train.preflight import PreflightError
    from veomni.train.tasks.dit_setup import (
        check_compatible,
        condition_configs,
        dit_rules,
        transformer_config,
    )

    condition = write_wan_dir(tmp_path / "wan_i2v", i2v=True)
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({
        "_class_name": "WanTransformer3DModel", "added_kv_proj_dim": 24, "attention_head_dim": 12,
        "cross_attn_norm": True, "eps": 1e-6, "ffn_dim": 32, "freq_dim": 32, "image_dim": 16, "in_channels": 12,
        "num_attention_heads": 2, "num_layers": 1, "out_channels": 4, "patch_size": [1, 2, 2],
        "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 32, "text_dim": 32,
    }))  # fmt: skip
    raw = dit_recipe(str(tmp_path / "run"))
    raw["model"].update({"config": str(tmp_path / "transformer"), "weights": None})
    raw["dit"].update({"condition": str(condition), "mode": "i2v", "max_sequence_length": length})
    recipe = recipe_from_dict(raw)
    config = transformer_config(recipe)
    rules = dit_rules(config)
    cond = condition_configs(recipe, rules)
    if length == 512:
        check_compatible(config, cond, recipe, rules)
    else:
        with pytest.raises(PreflightError, match=f"dit.max_sequence_length={length} \\(expected 512"):
            check_compatible(config, cond, recipe, rules)


@pytest.mark.parametrize("missing", ["vae", "text_encoder"])
def test_condition_dir_missing_a_component(dist_pools, tmp_path, missing):
    shutil.copytree(QUICKSTART / "condition", tmp_path / "wan")
    shutil.rmtree(tmp_path / "wan" / missing)
    raw = dit_recipe(str(tmp_path / "run"))
    raw["dit"]["condition"] = str(tmp_path / "wan")
    kind, message = dist_pools.get(1, "gloo").run(_build_error, raw)[0]
    assert kind == "PreflightError"
    assert str(tmp_path / "wan") in message and f"{missing}/config.json" in message


def test_condition_weights_missing_for_pretrained(dist_pools, tmp_path):
    raw = dit_recipe(str(tmp_path / "run"))
    raw["dit"]["condition_init"] = "pretrained"  # the quickstart ships configs only
    kind, message = dist_pools.get(1, "gloo").run(_build_error, raw)[0]
    assert kind == "PreflightError"
    assert "config but no weights" in message and "text_encoder (expected model*.safetensors" in message
    assert "vae (expected diffusion_pytorch_model*.safetensors" in message


def _write_clip(root: Path, name: str, sizes: list[tuple[int, int]]) -> None:
    from PIL import Image

    (root / name).mkdir(parents=True)
    for i, (h, w) in enumerate(sizes):
        Image.new("RGB", (w, h), (200, 10, 10)).save(root / name / f"{i:03d}.png")


@pytest.mark.parametrize(
    "sizes, message",
    [
        (
            [(32, 32)] * 4 + [(32, 48)],
            r"line 2: frames of inconsistent size: frame 0 \(.*000.png\) is 32x32 \(HxW\) "
            r"but frame 4 \(.*004.png\) is 32x48",
        ),
        (
            [(24, 32)] * 5,
            r"line 2: resolution 24x32 \(HxW\); expected H divisible by 16 and W by 16 \(VAE factor 8 x "
            r"patch 2x2\)",
        ),
        ([(32, 32)] * 4, r"line 2: 4 frames; expected 1 \+ 4k frames"),
    ],
)
def test_bad_clips_name_file_and_row(tmp_path, sizes, message):
    from veomni.train.data.dit import ShapeRule, index_dit
    from veomni.train.data.sources import DataError, RowSource

    _write_clip(tmp_path, "good", [(32, 32)] * 5)
    _write_clip(tmp_path, "bad", sizes)
    rows = [{"video": "good", "caption": "a red square"}, {"video": "bad", "caption": "a red square"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = RowSource([str(tmp_path / "d.jsonl")], "auto", ["video", "caption"])
    with pytest.raises(DataError, match=f"{re.escape(str(tmp_path / 'd.jsonl'))} {message}"):
        index_dit(source, None, ShapeRule(temporal=4, spatial=8, patch=(1, 2, 2)))


def test_empty_video_path_is_refused_not_read_as_the_data_directory(tmp_path):
    # os.path.join(root, "") is the data file's directory: its pictures must not become a clip.
    from PIL import Image

    from veomni.train.data.dit import ShapeRule, index_dit
    from veomni.train.data.sources import DataError, RowSource

    for i in range(5):
        Image.new("RGB", (32, 32), (200, 10, 10)).save(tmp_path / f"{i:03d}.png")
    rows = [{"image": f"{i:03d}.png", "caption": "a still"} for i in range(5)] + [{"video": "", "caption": "x"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = RowSource([str(tmp_path / "d.jsonl")], "auto", ["caption"])
    with pytest.raises(DataError, match="line 6: 'video' must be a frames directory"):
        index_dit(source, None, ShapeRule(temporal=4, spatial=8, patch=(1, 2, 2)))


def test_frames_numbered_without_padding_keep_their_order(tmp_path):
    # ffmpeg's `%d.png` writes 1.png .. 13.png: name order must compare the numbers, not the characters
    # ("10.png" < "2.png"), or the clip is silently shuffled in time.
    from PIL import Image

    from veomni.train.data.dit import load_clip, sample_frames
    from veomni.train.data.sources import RowRef

    (tmp_path / "clip").mkdir()
    for i in range(1, 14):
        Image.new("RGB", (16, 16), (i * 10, 0, 0)).save(tmp_path / "clip" / f"{i}.png")
    ref = RowRef(str(tmp_path / "d.jsonl"), 0, 1)
    frames, _ = sample_frames({"video": "clip", "caption": "x"}, ref, str(tmp_path))
    clip = load_clip(frames, (13, 16, 16), ref)
    red = ((clip[0, :, 0, 0] + 1.0) * 127.5).round().tolist()
    assert red == [i * 10.0 for i in range(1, 14)]


def test_parquet_files_of_clips_and_of_stills_read_together(tmp_path):
    # Each row gives a video or an image: a file of clips has no image column, one of stills no video column.
    import pyarrow as pa
    import pyarrow.parquet as pq

    from veomni.train.data.dit import MEDIA_COLUMNS, ShapeRule, index_dit
    from veomni.train.data.sources import DataError, RowSource

    _write_clip(tmp_path, "clip", [(32, 32)] * 5)
    _write_clip(tmp_path, "stills", [(32, 32)])
    pq.write_table(pa.table({"video": ["clip"], "caption": ["a clip"]}), tmp_path / "videos.parquet")
    pq.write_table(pa.table({"image": ["stills/000.png"], "caption": ["a still"]}), tmp_path / "images.parquet")
    files = [str(tmp_path / "videos.parquet"), str(tmp_path / "images.parquet")]
    source = RowSource(files, "auto", ["caption"], MEDIA_COLUMNS)
    assert source[1] == {"caption": "a still", "image": "stills/000.png", "video": None}
    rule = ShapeRule(temporal=4, spatial=8, patch=(1, 2, 2))
    assert index_dit(source, None, rule).tolist() == [[5, 32, 32], [1, 32, 32]]
    pq.write_table(pa.table({"image": ["stills/000.png"]}), tmp_path / "uncaptioned.parquet")
    with pytest.raises(DataError, match=r"uncaptioned.parquet: missing column\(s\) \['caption'\]"):
        RowSource([str(tmp_path / "uncaptioned.parquet")], "auto", ["caption"], MEDIA_COLUMNS)


def test_a_truncated_latent_shard_is_a_data_error_naming_it(tmp_path):
    from safetensors.torch import save_file

    from veomni.train.data.dit import load_latent_row
    from veomni.train.data.sources import DataError, RowRef

    shard = tmp_path / "shards" / "00000.safetensors"
    shard.parent.mkdir()
    save_file({"0.prompt_embeds": torch.zeros(1, 4, 8), "0.latent_params": torch.zeros(1, 8, 1, 2, 2)}, str(shard))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    row = {"shard": "shards/00000.safetensors", "index": 0, "shape": [1, 16, 16], "caption": "x"}
    with pytest.raises(DataError, match=r"latents.jsonl line 1: latent shard .*00000.safetensors is unreadable"):
        load_latent_row(row, RowRef(str(tmp_path / "latents.jsonl"), 0, 1), str(tmp_path))


