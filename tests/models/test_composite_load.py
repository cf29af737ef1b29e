"""Composite checkpoints (Qwen2-VL, Qwen3.5-MoE) through veomni's loader and export, against transformers.

The checkpoints are written by plain ``save_pretrained`` (5.23), which stores both in their original Hub layout:
Qwen2-VL's renames (``model.`` -> ``model.language_model.``, ``visual.`` -> ``model.visual.``) and Qwen3.5-MoE's
scoped per-expert merge must run on load and be undone on export.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import backend_params
from loading_fixtures import (
    checkpoint_tensors,
    eager_ops,
    gather_state_dict,
    qwen2_vl_config,
    save_composite,
    state,
)
from safetensors.torch import save_file
from transformers import Qwen2VLForConditionalGeneration, Qwen3_5MoeForConditionalGeneration

from veomni.models.build import build_model
from veomni.models.convert.key_transforms import ScopedConverter
from veomni.models.export.hf import export_hf
from veomni.models.loading import CheckpointMismatchError, converters_for, load_weights

TASK = "image_text_to_text"


@pytest.fixture(scope="module")
def composite(tmp_path_factory):
    root = tmp_path_factory.mktemp("composite")
    paths = {"qwen2_vl": str(root / "qwen2_vl"), "qwen3_5_moe": str(root / "qwen3_5_moe")}
    save_composite("qwen2_vl", paths["qwen2_vl"], seed=5, max_shard_size="40KB")  # an index and shards
    save_composite("qwen3_5_moe", paths["qwen3_5_moe"], seed=6)
    return paths


def _load_and_export(ctx, path: str, ref_cls: type, mode: str, out: str) -> tuple[list[str], dict[str, str]]:
    pstate = state(ctx)
    model = build_model(path, weights=path, ops=eager_ops(), parallel_state=pstate, load_mode=mode, task=TASK)
    ref = ref_cls.from_pretrained(path)
    full = gather_state_dict(model, pstate)
    ref_sd = ref.state_dict()
    assert sorted(full) == sorted(ref_sd)
    bad = [k for k in ref_sd if not torch.equal(full[k], ref_sd[k])]
    assert not bad, bad
    report = load_weights(model, path, mode=mode)
    export_hf(model, out)
    return sorted(report.loaded), report.sources


@pytest.mark.parametrize("world_size, backend", backend_params(1, 2))
def test_qwen2_vl_legacy_checkpoint_loads_like_transformers_and_exports_back(
    dist_pools, composite, tmp_path, world_size, backend
):
    path = composite["qwen2_vl"]
    saved = checkpoint_tensors(path)
    # The legacy layout, as on the Hub: no `model.language_model.` / `model.visual.` prefixes.
    assert any(k.startswith("visual.blocks.") for k in saved) and any(
        k.startswith("model.layers.") for k in saved
    )
    assert not any(k.startswith(("model.language_model.", "model.visual.")) for k in saved)
    pool = dist_pools.get(world_size, backend)
    for mode in ("sharded", "rank0_broadcast"):
        out = tmp_path / f"{mode}-{world_size}"
        loaded, sources = pool.run(_load_and_export, path, Qwen2VLForConditionalGeneration, mode, str(out))[0]
        assert sources["model.visual.blocks.0.attn.qkv.weight"] == "visual.blocks.0.attn.qkv.weight"
        assert sources["model.language_model.norm.weight"] == "model.norm.weight"
        exported = checkpoint_tensors(str(out))
        assert sorted(exported) == sorted(saved)  # exactly save_pretrained's keys
        assert all(torch.equal(exported[k], saved[k]) for k in saved)


def test_qwen3_5_moe_per_expert_checkpoint_merges_through_the_scoped_recipe(dist_pools, composite, tmp_path):
    # Qwen3.5-MoE's root class and model_type have no recipe; its text sub-model (model.language_model,
    # model_type qwen3_5_moe_text) has PrefixChange + qwen2_moe's expert merge, scoped to `language_model`.
    path = composite["qwen3_5_moe"]
    saved = checkpoint_tensors(path)
    assert "model.language_model.layers.1.mlp.experts.3.up_proj.weight" in saved
    out = tmp_path / "qwen3_5_moe"
    _, sources = dist_pools.get(2).run(
        _load_and_export, path, Qwen3_5MoeForConditionalGeneration, "sharded", str(out)
    )[0]
    assert sources["model.language_model.layers.1.mlp.experts.gate_up_proj"].startswith(
        "ExpertMergeConverter"
    )
    exported = checkpoint_tensors(str(out))
    assert sorted(exported) == sorted(saved)
    assert all(torch.equal(exported[k], saved[k]) for k in saved)


def test_the_scoped_merge_is_chosen_from_the_text_sub_model(composite):
    model = build_model(composite["qwen3_5_moe"], ops=eager_ops(), task=TASK, init_device="meta")
    scoped = [c for c in converters_for(model) if isinstance(c, ScopedConverter)]
    assert [(c.scope, type(c.inner).__name__, c.num_experts) for c in scoped] == [
        ("language_model", "ExpertMergeConverter", 4),
        ("language_model", "ExpertMergeConverter", 4),
    ]


def test_a_sub_model_whose_keys_match_nothing_is_named(composite, tmp_path):
    # The vision tower stored as `vision_tower.*`: no recipe maps it onto model.visual.
    saved = checkpoint_tensors(composite["qwen2_vl"])
    renamed = {
        ("vision_tower." + k[len("visual.") :] if k.startswith("visual.") else k): v for k, v in saved.items()
    }
    bad = tmp_path / "renamed"
    bad.mkdir()
    save_file(renamed, str(bad / "model.safetensors"), metadata={"format": "pt"})
    model = build_model(qwen2_vl_config(), ops=eager_ops(), task=TASK)
    with pytest.raises(CheckpointMismatchError) as err:
        load_weights(model, bad)
    message = str(err.value)
    n_visual = sum(k.startswith("model.visual.") for k in model.state_dict())
    assert (
        f"sub-model model.visual (Qwen2VisionTransformerPretrainedModel): none of its {n_visual} keys"
        in message
    )
    assert "'Qwen2VLForConditionalGeneration'" in message  # the recipe that was applied
    assert "expects keys like ['model.visual.patch_embed.proj.weight'" in message
    assert "look like ['vision_tower." in message
    assert "sub-model model.language_model" not in message  # the text model loaded fine
    assert len(err.value.missing) == n_visual


def test_a_missing_sub_model_says_its_weights_are_absent(composite, tmp_path):
    saved = checkpoint_tensors(composite["qwen2_vl"])
    text_only = tmp_path / "text_only"
    text_only.mkdir()
    save_file(
        {k: v for k, v in saved.items() if not k.startswith("visual.")}, str(text_only / "model.safetensors")
    )
    model = build_model(qwen2_vl_config(), ops=eager_ops(), task=TASK)
    with pytest.raises(CheckpointMismatchError, match=r"sub-model model.visual .*weights are absent"):
        load_weights(model, text_only)


def test_the_text_model_loads_from_the_composite_checkpoint(composite):
    # Qwen3_5MoeForCausalLM (model_type qwen3_5_moe_text) from the VLM's checkpoint: its root recipe drops the
    # `language_model.` level (PrefixChange) and merges the experts; the class itself declares the vision
    # tower's keys ignorable (`_keys_to_ignore_on_load_unexpected`).
    path = composite["qwen3_5_moe"]
    vlm = Qwen3_5MoeForConditionalGeneration.from_pretrained(path)
    model = build_model(vlm.config.text_config, weights=path, ops=eager_ops())
    # veomni's own adapter of the text model (registered with the linear-attention hybrids).
    assert type(model).__name__ == "Qwen3_5MoeForCausalLM"
    assert type(model).__module__ == "veomni.models.qwen3_5_moe.generated.patched_modeling_qwen3_5_moe"
    theirs = vlm.state_dict()
    for key, value in model.state_dict().items():
        source = key.replace("model.", "model.language_model.", 1) if key.startswith("model.") else key
        assert torch.equal(value, theirs[source]), key
    report = load_weights(model, path)
    assert report.ignored and all(k.startswith("model.visual.") for k in report.ignored)
    assert report.sources["model.layers.0.mlp.experts.down_proj"].startswith("ExpertMergeConverter")
    assert report.sources["model.norm.weight"] == "model.language_model.norm.weight"


def test_an_export_cast_to_bf16_says_so_in_every_sub_config(composite, tmp_path):
    # transformers' from_pretrained(dtype=bf16) puts the dtype on the config and each sub-config, and
    # save_pretrained writes them so. Ours, live and from DCP, must write the same config.json, not sub-configs
    # still saying float32 (the dtype the model was built and trained in).
    import json

    import torch.distributed.checkpoint as dcp

    from veomni.models.export.hf import export_dcp_to_hf

    path = composite["qwen2_vl"]
    model = build_model(path, weights=path, ops=eager_ops(), task=TASK)
    export_hf(model, tmp_path / "live", dtype=torch.bfloat16)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    export_dcp_to_hf(
        tmp_path / "dcp", tmp_path / "offline", config=path, prefix="model.", task=TASK, dtype=torch.bfloat16
    )
    upstream = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.bfloat16)
    upstream.save_pretrained(tmp_path / "hf")
    want = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert want["text_config"]["dtype"] == want["vision_config"]["dtype"] == "bfloat16"
    for out in ("live", "offline"):
        assert json.loads((tmp_path / out / "config.json").read_text()) == want, out


def test_the_offline_export_infers_the_task_from_the_checkpoint(composite, tmp_path):
    # No task given: a VLM's training checkpoint records its trained class in hf_files/config.json; a checkpoint
    # without hf_files/ gets the source's config, whose architectures may name another class of the model type
    # (the VLM, for its text model trained alone): the task whose keys are the checkpoint's is taken.
    import torch.distributed.checkpoint as dcp

    from veomni.models.export.cli import main as export_cli
    from veomni.models.export.files import CHECKPOINT_FILES_DIR, save_model_files
    from veomni.models.export.hf import export_dcp_to_hf

    path = composite["qwen2_vl"]
    vlm = build_model(path, weights=path, ops=eager_ops(), task=TASK)
    step = tmp_path / "step_00000001"
    save_model_files(vlm, step / CHECKPOINT_FILES_DIR)
    dcp.save({"model": vlm.state_dict()}, checkpoint_id=str(step / "dcp"), no_dist=True)
    assert export_cli([str(step / "dcp"), str(tmp_path / "vlm"), "--prefix", "model."]) == 0
    saved = checkpoint_tensors(path)
    exported = checkpoint_tensors(str(tmp_path / "vlm"))
    assert sorted(exported) == sorted(saved) and all(torch.equal(exported[k], saved[k]) for k in saved)

    path = composite["qwen3_5_moe"]
    text = build_model(path, weights=path, ops=eager_ops())  # causal_lm: the text model of the VLM checkpoint
    dcp.save({"model": text.state_dict()}, checkpoint_id=str(tmp_path / "text_dcp"), no_dist=True)
    export_dcp_to_hf(tmp_path / "text_dcp", tmp_path / "text", config=path, prefix="model.")
    export_hf(text, tmp_path / "live")
    offline, live = checkpoint_tensors(str(tmp_path / "text")), checkpoint_tensors(str(tmp_path / "live"))
    assert sorted(offline) == sorted(live) and all(torch.equal(offline[k], live[k]) for k in live)
    assert (tmp_path / "text" / "config.json").read_text() == (tmp_path / "live" / "config.json").read_text()
