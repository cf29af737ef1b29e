"""The default FSDP policy's units: an untied LM head is a unit of its own, a tied one stays in the root."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from veomni.models.build import default_fsdp_policy, untied_lm_head
from veomni.train.model_setup import _fsdp_policy
from veomni.train.recipe import load_recipe, recipe_from_dict, recipe_to_dict


def _probe(tie: bool) -> torch.nn.Module:
    config = Qwen3Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, tie_word_embeddings=tie,
    )  # fmt: skip
    with torch.device("meta"):
        return Qwen3ForCausalLM._from_config(config)


@pytest.mark.parametrize("tie, head", [(False, "lm_head"), (True, None)])
def test_default_policy_makes_an_untied_head_its_own_unit(tie, head):
    probe = _probe(tie)
    assert untied_lm_head(probe) == head
    assert default_fsdp_policy(probe).head == head
    assert default_fsdp_policy(probe, head_unit=False).head is None
    assert untied_lm_head(probe.model) is None  # no lm_head at all


@pytest.mark.parametrize("flag, head", [(True, "lm_head"), (False, None)])
def test_recipe_switch_keeps_the_head_in_the_root(flag, head):
    raw = recipe_to_dict(load_recipe("quickstart"))
    raw["parallel"]["lm_head_unit"] = flag
    policy = _fsdp_policy(recipe_from_dict(raw), _probe(False), torch.bfloat16, torch.float32)
    assert policy.head == head and policy.param_dtype == torch.bfloat16
