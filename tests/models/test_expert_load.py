"""Expert-load counters on HF fused experts modules: every (token, choice) pair of a training forward is counted
once per layer, evaluation and no-grad forwards are not, and a read restarts the counts."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from veomni.models.moe.expert_load import attach_expert_load_counters, load_summary, read_expert_loads


def tiny_moe():
    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_experts=4, num_experts_per_tok=2, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def test_each_training_forward_counts_every_choice_once_per_layer():
    model = tiny_moe().train()
    names = attach_expert_load_counters(model)
    assert names == [f"model.layers.{i}.mlp.experts" for i in range(3)]
    ids = torch.randint(0, 64, (2, 10))
    model(input_ids=ids)
    with torch.no_grad():
        model(input_ids=ids)  # no gradients: not counted
    model.eval()
    model(input_ids=ids)  # evaluation: not counted
    loads = read_expert_loads(model, names)
    assert loads.shape == (3, 4) and loads.dtype == torch.float32
    assert loads.sum(dim=1).tolist() == [20 * 2] * 3  # 20 tokens x top-2, per layer
    assert read_expert_loads(model, names).sum() == 0  # the read restarted the counters


def test_summary_of_even_and_skewed_loads():
    even = load_summary(torch.tensor([[5.0, 5.0, 5.0, 5.0]]))
    assert even["moe_imbalance"] == 1.0 and even["moe_idle_experts"] == 0.0
    skewed = load_summary(torch.tensor([[5.0, 5.0, 5.0, 5.0], [20.0, 0.0, 0.0, 0.0]]))
    assert skewed["moe_imbalance"] == 4.0 and skewed["moe_imbalance_mean"] == pytest.approx(2.5)
    assert skewed["moe_idle_experts"] == pytest.approx(3 / 8)
    assert skewed["moe_imbalance_per_layer"] == [1.0, 4.0]


def test_a_dense_model_has_no_counters():
    config = AutoConfig.for_model(
        "qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16,
    )  # fmt: skip
    assert attach_expert_load_counters(AutoModelForCausalLM.from_config(config)) == []

