"""The architectures `bench_sp.py` trains (``--model``), written out so that nothing is downloaded, each with a tiny
variant of the same architecture for CPU smoke runs."""

from __future__ import annotations

import argparse
from typing import Any

# Qwen3-8B's published config, written out so that nothing is downloaded (max_position_embeddings 40960 -> 131072
# for 128k sequences; plain RoPE, no scaling). KV cache off, as in training.
QWEN3_8B: dict[str, Any] = {
    "model_type": "qwen3", "vocab_size": 151_936, "hidden_size": 4096, "intermediate_size": 12_288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}, "tie_word_embeddings": False,
    "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False,
    "bos_token_id": 151_643, "eos_token_id": 151_645, "use_cache": False,
}  # fmt: skip
# Qwen3.5-9B's text model (transformers' Qwen3_5TextConfig defaults, its "9B style" configuration): the Gated
# DeltaNet hybrid, 3 linear-attention layers per gated full-attention layer; Ulysses SP splits the Gated DeltaNet heads
# (16 key / 32 value) as it does the attention heads (16 q / 4 kv), so SP <= 4.
QWEN3_5_9B: dict[str, Any] = {
    "model_type": "qwen3_5_text", "vocab_size": 248_320, "hidden_size": 4096, "intermediate_size": 12_288,
    "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 8,
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": False, "hidden_act": "silu", "use_cache": False,
}  # fmt: skip
# The same architectures shrunk for CPU smoke runs (heads divisible by SP=2 and 4).
TINY: dict[str, Any] = QWEN3_8B | {
    "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096,
    "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
TINY_QWEN3_5: dict[str, Any] = QWEN3_5_9B | {
    "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 4,
    "linear_num_value_heads": 8, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"], "max_position_embeddings": 4096,
}  # fmt: skip
# --model -> (full config, tiny config, name)
MODELS: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {
    "qwen3_8b": (QWEN3_8B, TINY, "Qwen3-8B"),
    "qwen3_5_9b": (QWEN3_5_9B, TINY_QWEN3_5, "Qwen3.5-9B text model (Gated DeltaNet hybrid)"),
}


def model_values(args: argparse.Namespace) -> dict[str, Any]:
    """The config dict of ``--model`` (its tiny variant with ``--tiny``)."""
    full, tiny, _ = MODELS[args.model]
    return dict(tiny if args.tiny else full)
