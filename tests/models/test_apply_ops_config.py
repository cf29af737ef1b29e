"""`apply_ops` leaves the config it was given untouched: two models sharing one config object (a frozen reference
model beside the trained one) keep their own attention / experts implementations, and the unbound one still
equals upstream transformers."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from veomni.kernels import OpsConfig
from veomni.models.hf.kernel_hooks import apply_ops, own_config
from veomni.models.qwen3.generated.patched_modeling_qwen3 import Qwen3ForCausalLM
from veomni.models.qwen3_moe.generated.patched_modeling_qwen3_moe import Qwen3MoeForCausalLM

TINY = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
)  # fmt: skip
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
OPS = OpsConfig(
    attention="sdpa", rms_norm="torch", rope="eager", swiglu="eager", cross_entropy="eager", moe_experts="torch",
    load_balancing_loss="eager",
)  # fmt: skip
CASES = {
    "dense": (Qwen3ForCausalLM, transformers.Qwen3ForCausalLM, transformers.Qwen3Config, {}),
    "moe": (Qwen3MoeForCausalLM, transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig, MOE),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_second_model_sharing_the_config_is_unchanged_by_apply_ops(case):
    ours_cls, upstream_cls, config_cls, extra = CASES[case]
    config = config_cls(**TINY, **extra)
    config._attn_implementation = "sdpa"
    if extra:
        config._experts_implementation = "eager"
    torch.manual_seed(0)
    policy = ours_cls(config).eval()
    reference = ours_cls(config).eval()  # the same config object: a frozen reference beside the policy
    reference.load_state_dict(policy.state_dict())
    before = config.to_dict(), config._attn_implementation, getattr(config, "_experts_implementation", None)

    apply_ops(policy, OPS)

    after = config.to_dict(), config._attn_implementation, getattr(config, "_experts_implementation", None)
    assert after == before, "apply_ops wrote into the config object it was given"
    assert reference.config is config and policy.config is not config
    assert policy.config._attn_implementation == "veomni_sdpa"
    # Every submodule of the policy reads the policy's copy; none of the reference's reads it.
    policy_configs = {id(m.config) for m in policy.modules() if hasattr(m, "config")}
    reference_configs = {id(m.config) for m in reference.modules() if hasattr(m, "config")}
    assert policy_configs == {id(policy.config)} and reference_configs == {id(config)}

    upstream = upstream_cls(copy.deepcopy(config)).eval()
    upstream.load_state_dict(policy.state_dict())
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = upstream(input_ids=ids).logits
        # Before: MoE failed here ("has no veomni kernels attached"), dense ran veomni_sdpa without kernels.
        got_reference = reference(input_ids=ids).logits
        got_policy = policy(input_ids=ids).logits
    torch.testing.assert_close(got_reference, want, rtol=0, atol=0)
    torch.testing.assert_close(got_policy, want, rtol=1e-5, atol=1e-5)


def test_own_config_refuses_a_module_without_an_hf_config():
    with pytest.raises(TypeError, match="expects an HF PreTrainedModel"):
        own_config(torch.nn.Linear(2, 2))
