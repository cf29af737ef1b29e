"""Diffusion transformers as families: Wan is registered through `veomni.models.wan.family`, its DiffusionRules
import, a declaration whose fast paths contradict its rules is refused, and a diffusers model no family declares
is refused ops / SP by the build, each error naming the models veomni has (the dit task's refusal:
tests/train/test_dit_inputs.py)."""

from __future__ import annotations

import json

import pytest
import torch
from dist_harness import backend_params
from loading_fixtures import eager_ops

from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import build_parallel_state
from veomni.models.build import build_model
from veomni.models.diffusers.rules import (
    ConditionConfigs,
    diffusion_models,
    diffusion_rules,
    find_diffusion_rules,
)
from veomni.models.families import FAMILIES, family_of
from veomni.models.family import DiffusionRules, ModelTypeSpec, resolve
from veomni.models.registry import MODELS

diffusers = pytest.importorskip("diffusers")

WAN = "WanTransformer3DModel"
RULES = {
    "condition_config": "veomni.models.wan.condition:WanConditionConfig",
    "condition_model": "veomni.models.wan.condition:WanConditionModel",
    "condition_error": "veomni.models.wan.pipeline_dir:ConditionCheckpointError",
    "condition_configs": "veomni.models.wan.rules:condition_configs",
    "compatibility": "veomni.models.wan.rules:compatibility",
    "flow_matching_inputs": "veomni.models.wan.condition:flow_matching_inputs",
    "weight_counts": "veomni.models.wan.rules:weight_counts",
    "modes": {"t2v": "text-to-video"},
}


def _config_dir(tmp_path, class_name: str, **values):
    folder = tmp_path / class_name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"_class_name": class_name, **values}))
    return folder


def test_wan_is_a_registered_family(tmp_path):
    assert family_of(WAN).name == "wan" and diffusion_models() == {WAN: "wan"}
    config = MODELS.load_config(_config_dir(tmp_path, WAN, num_layers=1))
    resolved = MODELS.model_class(config, "diffusion_transformer")
    assert resolved.cls is diffusers.WanTransformer3DModel and resolved.registered
    assert resolved.fast_paths == {"sp", "fused_kernels"}
    hf = MODELS.model_class(config, "diffusion_transformer", backend="hf")
    assert hf.cls is diffusers.WanTransformer3DModel and not hf.registered and hf.fast_paths == frozenset()


def test_every_diffusion_rule_resolves():
    declared = [spec for family in FAMILIES for spec in family.model_types if spec.diffusion is not None]
    assert [spec.model_type for spec in declared] == [WAN]
    for spec in declared:
        for field in DiffusionRules.__attrs_attrs__:
            if field.name == "modes":  # names, not targets
                continue
            target = getattr(spec.diffusion, field.name)
            if target is not None:
                assert callable(resolve(target)), f"{spec.model_type}.{field.name}: {target}"
    assert issubclass(resolve(find_diffusion_rules(WAN).condition_error), Exception)


def test_fast_paths_must_match_the_rules():
    rules = DiffusionRules(bind_kernels="a:b", **RULES)
    ModelTypeSpec(model_type="X", library="diffusers", classes={"diffusion_transformer": "a:X"},
                  fast_paths={"fused_kernels"}, diffusion=rules)  # fmt: skip
    with pytest.raises(ValueError, match=r"disagree with its DiffusionRules for \['sp'\]"):
        ModelTypeSpec(model_type="X", library="diffusers", classes={"diffusion_transformer": "a:X"},
                      fast_paths={"sp", "fused_kernels"}, diffusion=rules)  # fmt: skip
    with pytest.raises(ValueError, match=r"disagree with its DiffusionRules for \['fused_kernels'\]"):
        ModelTypeSpec(model_type="X", library="diffusers", classes={"diffusion_transformer": "a:X"},
                      diffusion=rules)  # fmt: skip
    with pytest.raises(ValueError, match="DiffusionRules are for diffusers models only"):
        ModelTypeSpec(model_type="x", config="a:C", classes={"causal_lm": "a:X"}, diffusion=rules)
    with pytest.raises(
        ValueError, match="DiffusionRules.compatibility: expected a 'package.module:attribute'"
    ):
        DiffusionRules(**(RULES | {"compatibility": "no_colon"}))


def test_the_family_names_its_condition_modes():
    rules = find_diffusion_rules(WAN)
    assert list(rules.modes) == ["t2v", "i2v"]
    assert rules.condition_mode(None) == "t2v" and rules.condition_mode("i2v") == "i2v"
    with pytest.raises(ValueError, match="condition mode 'v2v' is not one this model trains \\(t2v: text-to-video; "
                       "i2v: image-to-video"):  # fmt: skip
        rules.condition_mode("v2v")
    with pytest.raises(ValueError, match="DiffusionRules.modes: expected"):
        DiffusionRules(**(RULES | {"modes": {}}))


def test_wan_weight_counts_sort_its_matrices_by_what_they_multiply():
    """Text and image context weights, timestep weights and per-token weights partition the matrices (the I2V
    model has every kind); the attention shape is the config's."""
    from veomni.models.diffusers.rules import WeightCounts

    with torch.device("meta"):
        model = diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=12, out_channels=4,
            text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, image_dim=16, added_kv_proj_dim=24,
        )  # fmt: skip
    counts = resolve(find_diffusion_rules(WAN).weight_counts)(model)
    assert isinstance(counts, WeightCounts) and (counts.layers, counts.width) == (2, 24)
    matrices = sum(
        p.numel() for n, p in model.named_parameters() if p.dim() >= 2 and "scale_shift_table" not in n
    )
    assert counts.token + counts.text + counts.image + counts.sample == matrices
    assert min(counts.token, counts.text, counts.image, counts.sample) > 0


def test_a_diffusers_model_without_rules_is_named():
    assert find_diffusion_rules("FluxTransformer2DModel") is None
    with pytest.raises(ValueError, match=r"where: the diffusers model 'FluxTransformer2DModel' .*has no veomni "
                       r"diffusion rules.*WanTransformer3DModel \(family 'wan'\)"):  # fmt: skip
        diffusion_rules("FluxTransformer2DModel", "where")


def test_wan_condition_configs_and_compatibility(tmp_path):
    from models.test_dit_condition import write_wan_dir

    rules = find_diffusion_rules(WAN)
    root = write_wan_dir(tmp_path / "wan", i2v=True)
    cond = resolve(rules.condition_configs)(root, "i2v", None)
    assert isinstance(cond, ConditionConfigs)
    assert (cond.temporal_compression, cond.spatial_compression) == (4, 8)
    z = int(cond.vae["z_dim"])
    fits = {"in_channels": 2 * z + 4, "out_channels": z, "text_dim": cond.text_dim, "image_dim": cond.image_dim,
            "added_kv_proj_dim": 8}  # fmt: skip
    check = resolve(rules.compatibility)
    assert check(fits, cond, mode="i2v", max_sequence_length=512) == []
    misfits = check(fits | {"out_channels": z + 1}, cond, mode="i2v", max_sequence_length=77)
    assert [(m.key, m.found, m.expected) for m in misfits] == [
        ("out_channels", z + 1, z),
        ("max_sequence_length", 77, 512),
    ]
    with pytest.raises(
        resolve(rules.condition_error),
        match="serves mode 't2v', but the condition model was asked for mode 'i2v'",
    ):
        resolve(rules.condition_configs)(write_wan_dir(tmp_path / "t2v", i2v=False), "i2v", None)


def test_ops_refused_for_a_model_without_kernels(tmp_path):
    from veomni.models.diffusers.build import _bind_kernels

    with pytest.raises(ValueError, match=r"bound to the diffusers models \['WanTransformer3DModel'\] only, not to "
                       r"Linear; build it with ops=None"):  # fmt: skip
        _bind_kernels(torch.nn.Linear(2, 2), eager_ops())


def _refuse_sp(ctx, src: str) -> str:
    state = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type)
    with pytest.raises(ValueError, match=r"Ulysses sequence parallelism \(sp=2\) is implemented for the diffusers "
                       r"models \['WanTransformer3DModel'\] only, not for AutoencoderKLWan; use sp=1"):  # fmt: skip
        build_model(src, weights=None, parallel_state=state)
    return "ok"


@pytest.mark.parametrize("world_size, backend", backend_params(2)[:1])
def test_sp_refused_for_a_model_without_it(dist_pools, tmp_path, world_size, backend):
    diffusers.AutoencoderKLWan(base_dim=8, z_dim=4).save_config(str(tmp_path))
    assert dist_pools.get(world_size, backend).run(_refuse_sp, str(tmp_path)) == ["ok", "ok"]
