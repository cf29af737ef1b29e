"""The offline export of a training checkpoint (`veomni.models.export.export_dcp_to_hf` on ``step_N/dcp``) gives what
the in-loop export (the task's ``export``) gives: the trained config (``model.config_overrides`` included), the
generation config and the tokenizer / processor files, which the checkpoint keeps in ``step_N/hf_files``. A
checkpoint without that directory (written before it existed) still exports from the source config. Text, VLM and
omni (the Qwen2.5-Omni thinker of test_omni_train, with its one image-and-audio preprocessor file) runs."""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_loop import DENSE, initial_weights, tiny_recipe
from test_omni_train import MELS, omni_recipe
from test_omni_train import assets as omni_assets  # noqa: F401  (fixture)
from test_vlm_train import initial_weights as vlm_weights
from test_vlm_train import make_data, make_processor_dir, vlm_recipe

from veomni.models.export.cli import main as export_cli
from veomni.models.export.files import CHECKPOINT_FILES_DIR
from veomni.models.export.hf import export_dcp_to_hf
from veomni.train.recipe import recipe_from_dict

# rope scaling and a longer context: what a long-context fine-tune sets on top of the source model's config.
OVERRIDES = {
    "max_position_embeddings": 2048,
    "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
}


def _train_save_export(ctx, raw: dict, export: str) -> str:
    """One step, a checkpoint (the loop's own ``_save``) and the in-loop export; returns the step directory."""
    from veomni.train.loop import _export, _save, build_run, train_step

    run = build_run(recipe_from_dict(raw))
    train_step(run, next(iter(run.train_data)))
    _save(run)
    shutil.move(str(_export(run, "hf")), export)
    return str(Path(raw["checkpoint"]["dir"]) / f"step_{run.step:08d}")


def files(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if p.is_file()}


def config_of(root: Path) -> dict:
    return json.loads((root / "config.json").read_text())


def assert_same_export(offline: Path, in_loop: Path) -> None:
    """The same file names, configs, generation config, side files and tensors."""
    assert files(offline) == files(in_loop)
    assert config_of(offline) == config_of(in_loop)
    for name in files(in_loop) - {"config.json"}:
        if name.endswith(".safetensors"):
            want, got = load_file(in_loop / name), load_file(offline / name)
            assert want.keys() == got.keys()
            assert all(torch.equal(want[k], got[k]) for k in want), name
        elif name.endswith(".json"):
            assert json.loads((offline / name).read_text()) == json.loads((in_loop / name).read_text()), name
        else:
            assert (offline / name).read_bytes() == (in_loop / name).read_bytes(), name


@pytest.fixture(scope="module")
def text_run(dist_pools, tmp_path_factory) -> dict:
    weights = initial_weights(DENSE, str(tmp_path_factory.mktemp("text_init")))
    raw = tiny_recipe(str(tmp_path_factory.mktemp("text_run")), DENSE, weights=weights)
    raw["model"]["config_overrides"] = OVERRIDES
    export = str(tmp_path_factory.mktemp("text_export") / "hf")
    step = dist_pools.get(1, "gloo").run(_train_save_export, raw, export)[0]
    return {"weights": weights, "step": Path(step), "export": Path(export)}


def test_offline_export_of_a_text_run_carries_its_config_overrides(text_run, tmp_path, caplog):
    step, in_loop = text_run["step"], text_run["export"]
    assert config_of(in_loop)["max_position_embeddings"] == 2048  # the in-loop export always had them
    # Without --config: the checkpoint describes itself.
    assert export_cli([str(step / "dcp"), str(tmp_path / "bare"), "--prefix", "model."]) == 0
    assert_same_export(tmp_path / "bare", in_loop)
    # With the source model's directory, as the docs used to say: the checkpoint's trained config still wins,
    # and the warning names what the source would have lost.
    with caplog.at_level(logging.WARNING, logger="veomni.models.export.files"):
        export_dcp_to_hf(step / "dcp", tmp_path / "source", config=text_run["weights"], prefix="model.")
    assert_same_export(tmp_path / "source", in_loop)
    assert config_of(tmp_path / "source")["rope_parameters"]["factor"] == 4.0
    assert "max_position_embeddings" in caplog.text and "rope_parameters" in caplog.text


def test_an_old_layout_checkpoint_still_exports_from_the_source_config(text_run, tmp_path, caplog):
    old = tmp_path / "step_00000001"
    shutil.copytree(text_run["step"], old, ignore=shutil.ignore_patterns(CHECKPOINT_FILES_DIR))
    with pytest.raises(FileNotFoundError, match="pass config="):
        export_dcp_to_hf(old / "dcp", tmp_path / "none", prefix="model.")
    with caplog.at_level(logging.INFO, logger="veomni.models.export.files"):
        export_dcp_to_hf(old / "dcp", tmp_path / "out", config=text_run["weights"], prefix="model.")
    assert f"config from {text_run['weights']}" in caplog.text
    # The weights are the trained ones; the config is the source's (the overrides are lost, as the log says).
    in_loop = text_run["export"]
    want, got = load_file(in_loop / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert config_of(tmp_path / "out")["max_position_embeddings"] == DENSE["max_position_embeddings"]


@pytest.fixture(scope="module")
def vlm_run(dist_pools, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vlm_offline")
    (root / "media").mkdir()
    assets = {
        "processor": make_processor_dir(root / "processor"),
        "train": make_data(root / "media", rows=8),
        "media": str(root / "media"),
        "weights": vlm_weights(root / "weights"),
    }
    raw = vlm_recipe(assets, str(root / "run"), steps=1)
    export = str(root / "hf")
    step = dist_pools.get(1, "gloo").run(_train_save_export, raw, export)[0]
    return {"step": Path(step), "export": Path(export)}


def test_offline_vlm_export_equals_the_in_loop_export_and_loads_its_processor(vlm_run, tmp_path):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    out = tmp_path / "out"
    export_dcp_to_hf(vlm_run["step"] / "dcp", out, prefix="model.")  # the task comes from hf_files/
    assert_same_export(out, vlm_run["export"])
    for name in ("tokenizer.json", "chat_template.jinja", "preprocessor_config.json",
                 "video_preprocessor_config.json", "generation_config.json"):  # fmt: skip
        assert (out / name).is_file(), name
    model = AutoModelForImageTextToText.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id is not None
    assert AutoImageProcessor.from_pretrained(out).merge_size == 2
    if importlib.util.find_spec("torchvision") is None:
        # Qwen3-VL's processor needs a video processor, which needs torchvision: without it neither export builds
        # one, for that reason alone.
        with pytest.raises(ImportError, match="Torchvision"):
            AutoProcessor.from_pretrained(out)
    else:
        assert type(AutoProcessor.from_pretrained(out)).__name__ == "Qwen3VLProcessor"


@pytest.fixture(scope="module")
def omni_run(dist_pools, omni_assets, tmp_path_factory) -> dict:  # noqa: F811
    root = tmp_path_factory.mktemp("omni_offline")
    raw = omni_recipe(omni_assets, str(root / "run"), steps=1)
    export = str(root / "hf")
    step = dist_pools.get(1, "gloo").run(_train_save_export, raw, export)[0]
    return {"step": Path(step), "export": Path(export)}


def test_offline_omni_export_equals_the_in_loop_export_and_loads_in_transformers(omni_run, tmp_path):
    from transformers import (
        AutoModelForMultimodalLM,
        Qwen2_5OmniThinkerForConditionalGeneration,
        WhisperFeatureExtractor,
    )

    out = tmp_path / "out"
    # No --task: the omni thinker's class is inferred from the trained config in hf_files/.
    assert export_cli([str(omni_run["step"] / "dcp"), str(out), "--prefix", "model."]) == 0
    assert_same_export(out, omni_run["export"])
    model, info = AutoModelForMultimodalLM.from_pretrained(out, output_loading_info=True)
    assert isinstance(model, Qwen2_5OmniThinkerForConditionalGeneration)
    # No missing, unexpected or mismatched key: nothing initialised at random.
    assert not any(info.values()), info
    # The file holds the upstream (hub) key names, which transformers renames on load and back on save: the model
    # saved again gives the exported tensors.
    model.save_pretrained(tmp_path / "again")
    want, got = load_file(out / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    # The audio half of the one preprocessor file.
    assert WhisperFeatureExtractor.from_pretrained(out).feature_size == MELS
