"""Qwen3.5-MoE (the hybrid Gated DeltaNet VLM) through the trainer (task vlm): the expert-parallel layouts
(dp_replicate, sp, ep) = (1, 1, 2) and (1, 2, 2) on 2 gloo ranks give the one-process per-step loss and grad norm
(fp32), with micro-batches that hold no image on some ranks (the dummy tower pass); video rows are accepted.

Processor, data and recipe are Qwen3-VL-MoE's trainer test's (test_vlm_moe_train), with a Qwen3.5-MoE model.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_vlm_moe_train import STEPS, _steps, make_data, moe_recipe
from test_vlm_train import make_processor_dir, tiny_config

LAYOUTS = [(1, 1, 2), (1, 2, 2)]  # (dp_replicate, sp, ep) on 2 ranks


def qwen3_5_moe_config() -> dict:
    """Qwen3-VL trainer test's tiny VLM as Qwen3.5-MoE: a linear-attention layer then a full-attention one, partial
    RoPE over interleaved mrope sections, 4 routed experts (top-2) + a shared expert, a tower without deepstack."""
    values = copy.deepcopy(tiny_config())
    values["vision_config"].pop("deepstack_visual_indexes")
    values["text_config"].update(
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, moe_intermediate_size=24,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.05,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    )  # fmt: skip
    return values


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    from transformers import AutoConfig, AutoModelForImageTextToText

    root = tmp_path_factory.mktemp("vlm_qwen3_5_moe")
    (root / "media").mkdir()
    config = AutoConfig.for_model("qwen3_5_moe", **qwen3_5_moe_config())
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config).save_pretrained(root / "weights")
    return {
        "processor": make_processor_dir(root / "processor"),
        "train": make_data(root / "media"),
        "media": str(root / "media"),
        "weights": str(root / "weights"),
    }


def test_ep_layouts_match_one_process(dist_pools, assets, tmp_path):
    one = dist_pools.get(1, "gloo").run(_steps, moe_recipe(assets, str(tmp_path / "one")))[0]
    assert one["task_coef"] == 0.05 and one["model_coef"] == 0.0  # the aux loss found in text_config
    assert one["imageless"] > 0  # a text-only micro-batch: the tower's dummy pass ran
    pool = dist_pools.get(2, "gloo")
    for dp_replicate, sp, ep in LAYOUTS:
        layout = f"dp_replicate={dp_replicate} sp={sp} ep={ep}"
        raw = moe_recipe(assets, str(tmp_path / layout.replace(" ", "_")), dp_replicate=dp_replicate, sp=sp, ep=ep)
        for result in pool.run(_steps, raw):
            assert len(result["stats"]) == STEPS
            for step, (got, want) in enumerate(zip(result["stats"], one["stats"], strict=True)):
                assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), (layout, step)
                assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), (layout, step)


def test_video_rows_are_accepted_for_qwen3_5():
    from transformers import AutoConfig

    from veomni.train.loop import meta_instance
    from veomni.train.tasks import build_task

    for model_type in ("qwen3_5", "qwen3_5_moe"):
        values = qwen3_5_moe_config()
        if model_type == "qwen3_5":
            for key in ("moe_intermediate_size", "shared_expert_intermediate_size", "num_experts",
                        "num_experts_per_tok", "router_aux_loss_coef"):  # fmt: skip
                values["text_config"].pop(key)
        probe = meta_instance(AutoConfig.for_model(model_type, **values), "image_text_to_text")
        task = build_task("vlm", probe)
        # The family's data rules name Qwen3-VL's video rule (and so the timestamped video layout).
        assert task.data_rules is not None and task.data_rules.encoder == "vision", task.data_rules
        assert task.data_rules.video_rule is not None and task.data_rules.no_video is None
        assert task.vision_flops_per_patch > 0 and task.flops_per_token > 0
