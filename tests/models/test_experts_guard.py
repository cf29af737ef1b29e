"""The veomni experts backend refuses HF experts modules its kernels do not compute (bias, transposed or
interleaved layout, no gate, custom gate/activation, clamp), naming the flag; eager runs them unchanged."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import GptOssConfig, GptOssForCausalLM
from transformers.activations import GELUActivation
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from veomni.kernels import OpsConfig, resolve_kernels
from veomni.models.hf.experts import experts_mismatches, register_hf_experts
from veomni.models.hf.kernel_hooks import ATTR, apply_ops, attach_kernels
from veomni.models.qwen3_moe.generated.patched_modeling_qwen3_moe import Qwen3MoeForCausalLM

EAGER = dict(
    rms_norm="eager", rope="eager", swiglu="eager", cross_entropy="eager", load_balancing_loss="eager"
)


def tiny_gpt_oss() -> GptOssForCausalLM:
    config = GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    config._attn_implementation = "eager"  # gpt_oss has attention sinks: no sdpa
    torch.manual_seed(0)
    model = GptOssForCausalLM(config)
    with torch.no_grad():  # biases start at zero; make them matter
        for name, param in model.named_parameters():
            if name.endswith("_bias"):
                param.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gpt_oss_experts_are_refused_with_the_flags_named(backend):
    model = tiny_gpt_oss()
    with pytest.raises(ValueError) as err:
        apply_ops(model, OpsConfig(**EAGER, attention="eager", moe_experts=backend))
    text = str(err.value)
    assert f"OpsConfig.moe_experts={backend!r}" in text
    assert "GptOssExperts at model.layers.0.mlp.experts and 1 more" in text
    for line in (
        "has_bias: expected False, found True",
        "is_transposed: expected False, found True",
        "is_concatenated: expected True, found False",
        "_apply_gate: expected transformers' default act_fn(gate) * up, found GptOssExperts._apply_gate",
        "limit: expected none (the kernels neither clamp nor scale), found 7.0",
        "parameters: expected exactly ['down_proj', 'gate_up_proj'], found ['down_proj', 'down_proj_bias', "
        "'gate_up_proj', 'gate_up_proj_bias']",
    ):
        assert line in text
    assert "moe_experts='eager'" in text and "backend='hf'" in text
    # Refused before anything was bound.
    assert not hasattr(model, ATTR) and model.config._experts_implementation != "veomni"


def test_gpt_oss_runs_its_own_forward_under_eager():
    model = tiny_gpt_oss()
    reference = copy.deepcopy(model.model.layers[0].mlp.experts)
    apply_ops(model, OpsConfig(**EAGER, attention="eager", moe_experts="eager"))
    assert model.config._experts_implementation == "veomni"
    experts = model.model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(9, 32, generator=gen)
    index = torch.randint(0, 4, (9, 2), generator=gen)
    weights = torch.rand(9, 2, generator=gen)
    # Bitwise: the veomni experts function hands eager to the class's own forward (biases, clamp and all).
    assert torch.equal(experts(hidden, index, weights), reference(hidden, index, weights))


def test_experts_reached_without_apply_ops_are_checked_in_the_forward():
    model = tiny_gpt_oss()
    attach_kernels(model, resolve_kernels(OpsConfig(**EAGER, moe_experts="torch")))
    model.set_experts_implementation(register_hf_experts())
    with pytest.raises(ValueError, match="cannot run GptOssExperts: .*has_bias: expected False, found True"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))


def test_accepted_experts_reached_without_apply_ops_are_inspected_once(monkeypatch):
    from test_moe_adapter import tiny_config

    import veomni.models.hf.experts as hf_experts

    model = Qwen3MoeForCausalLM(tiny_config())
    attach_kernels(model, resolve_kernels(OpsConfig(**EAGER, moe_experts="torch")))
    model.set_experts_implementation(register_hf_experts())
    calls = []
    inspect = hf_experts.module_mismatches
    monkeypatch.setattr(hf_experts, "module_mismatches", lambda m: calls.append(m) or inspect(m))
    ids = torch.zeros(1, 4, dtype=torch.long)
    model(input_ids=ids)
    experts = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeExperts"]
    assert len(calls) == len(experts) > 0
    model(input_ids=ids)
    assert len(calls) == len(experts)  # accepted once per module, not again on every forward


def test_qwen3_moe_experts_are_accepted():
    from test_moe_adapter import tiny_config

    model = Qwen3MoeForCausalLM(tiny_config())
    apply_ops(model, OpsConfig(**EAGER, attention="sdpa", moe_experts="torch"))
    assert model.config._experts_implementation == "veomni"
    assert experts_mismatches(model.model.layers[1].mlp.experts) == []


class _ClampedGate(Qwen3MoeExperts):
    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate.clamp(max=1.0)) * up


def _set(name, value):
    return lambda m: setattr(m, name, value)


@pytest.mark.parametrize(
    "edit, expected",
    [
        (_set("has_gate", False), "has_gate: expected True, found False"),
        (_set("has_post_expert_norm", True), "has_post_expert_norm: expected False, found True"),
        (_set("_is_expert_parallel", True), "_is_expert_parallel: expected False"),
        (_set("act_fn", GELUActivation()), "act_fn: expected SiLU, found GELUActivation"),
        (_set("limit", 10.0), "limit: expected none (the kernels neither clamp nor scale), found 10.0"),
        (lambda m: m.register_parameter("down_proj_bias", nn.Parameter(torch.zeros(4, 16))),
         "found ['down_proj', 'down_proj_bias', 'gate_up_proj']"),
        (_set("post_expert_norm", nn.LayerNorm(16)), "submodules: expected only act_fn, found also ['post_expert_norm']"),
        (lambda m: setattr(m, "down_proj", nn.Parameter(torch.zeros(4, 8, 16))),
         "weight shapes: expected gate_up_proj [E, 2I, H] and down_proj [E, H, I], found (4, 16, 16) and (4, 8, 16)"),
        (lambda m: setattr(m, "__class__", _ClampedGate), "_apply_gate: expected transformers' default"),
    ],
    ids=["no-gate", "post-norm", "hf-ep", "gelu", "clamp", "bias", "extra-module", "shapes", "custom-gate"],
)  # fmt: skip
def test_each_difference_is_named(edit, expected):
    from test_moe_adapter import tiny_config

    module = Qwen3MoeExperts(tiny_config(hidden_size=16, moe_intermediate_size=8, num_experts=4))
    assert experts_mismatches(module) == []
    edit(module)
    problems = experts_mismatches(module)
    assert len(problems) == 1 and expected in problems[0], problems


@pytest.mark.parametrize(
    "model_type, config_name, experts_name, expected",
    [
        ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeExperts", []),
        ("mixtral", "MixtralConfig", "MixtralExperts", []),
        ("deepseek_v3", "DeepseekV3Config", "DeepseekV3Experts", []),
        ("glm4_moe", "Glm4MoeConfig", "Glm4MoeExperts", []),
        ("gpt_oss", "GptOssConfig", "GptOssExperts", ["is_concatenated", "is_transposed", "has_bias", "_apply_gate"]),
        ("nemotron_h", "NemotronHConfig", "NemotronHExperts", ["has_gate", "act_fn", "parameters"]),
        ("deepseek_v4", "DeepseekV4Config", "DeepseekV4Experts", ["_apply_gate", "limit"]),
        ("aria", "AriaTextConfig", "AriaExperts", ["is_transposed"]),
        ("muse_spark", "MuseSparkTextConfig", "MuseSparkExperts", ["has_post_expert_norm", "submodules"]),
    ],
)  # fmt: skip
def test_upstream_experts_classes(model_type, config_name, experts_name, expected):
    # The installed transformers' own classes, built from their default configs on meta (no memory).
    import importlib

    config_cls = getattr(
        importlib.import_module(f"transformers.models.{model_type}.configuration_{model_type}"), config_name
    )
    experts_cls = getattr(
        importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}"), experts_name
    )
    with torch.device("meta"):
        module = experts_cls(config_cls())
    found = [line.split(":")[0] for line in experts_mismatches(module)]
    assert set(expected) <= set(found) and bool(found) == bool(expected), found
