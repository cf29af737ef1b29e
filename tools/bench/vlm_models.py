"""The architectures `bench_vlm.py` trains (``--model``), written out so that nothing is downloaded, each with a tiny
variant of the same architecture for CPU smoke runs."""

from __future__ import annotations

from typing import Any

from transformers import Qwen2_5_VLConfig, Qwen3_5Config, Qwen3VLConfig

# Qwen3-VL-2B-Instruct's architecture (the published config.json, token ids included).
QWEN3_VL_2B: dict[str, Any] = {
    "text_config": {
        "vocab_size": 151_936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 262_144,
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [24, 20, 20],
                            "mrope_interleaved": True},
        "bos_token_id": 151_643, "eos_token_id": 151_645,
    },
    "vision_config": {
        "depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16, "patch_size": 16,
        "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 2048, "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [5, 11, 17], "hidden_act": "gelu_pytorch_tanh", "in_channels": 3,
    },
    "image_token_id": 151_655, "video_token_id": 151_656, "vision_start_token_id": 151_652,
    "vision_end_token_id": 151_653, "tie_word_embeddings": True,
}  # fmt: skip
# The same architecture shrunk for CPU smoke runs.
TINY: dict[str, Any] = {
    "text_config": QWEN3_VL_2B["text_config"] | {
        "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [4, 2, 2],
                            "mrope_interleaved": True},
        "bos_token_id": 1, "eos_token_id": 2,
    },
    "vision_config": QWEN3_VL_2B["vision_config"] | {
        "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4, "out_hidden_size": 64,
        "num_position_embeddings": 64, "deepstack_visual_indexes": [0],
    },
    "image_token_id": 990, "video_token_id": 991, "vision_start_token_id": 992, "vision_end_token_id": 993,
    "tie_word_embeddings": True,
}  # fmt: skip
# Qwen2.5-VL-7B-Instruct's architecture (the published config.json, token ids included).
QWEN2_5_VL_7B: dict[str, Any] = {
    "text_config": {
        "vocab_size": 152_064, "hidden_size": 3584, "intermediate_size": 18_944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 128_000,
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [16, 24, 24]},
        "bos_token_id": 151_643, "eos_token_id": 151_645,
    },
    "vision_config": {
        "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 3584,
        "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2, "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "hidden_act": "silu", "in_channels": 3,
    },
    "image_token_id": 151_655, "video_token_id": 151_656, "vision_start_token_id": 151_652,
    "vision_end_token_id": 151_653, "tie_word_embeddings": False,
}  # fmt: skip
TINY_2_5: dict[str, Any] = {
    "text_config": QWEN2_5_VL_7B["text_config"] | {
        "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [2, 3, 3]},
        "bos_token_id": 1, "eos_token_id": 2,
    },
    "vision_config": QWEN2_5_VL_7B["vision_config"] | {
        "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4, "out_hidden_size": 64,
        "patch_size": 16, "window_size": 64, "fullatt_block_indexes": [1],
    },
    "image_token_id": 990, "video_token_id": 991, "vision_start_token_id": 992, "vision_end_token_id": 993,
}  # fmt: skip
# Qwen3.5-9B's architecture as transformers' Qwen3_5Config defaults describe it (a "Qwen3.5-9B style" configuration:
# hybrid text model, 3 Gated DeltaNet layers per gated full-attention layer; ViT 27 blocks of 1,152, no deepstack),
# the merger's output at the text width, cut to 8 of its 32 text layers so that one GPU trains it (4.2 B parameters).
QWEN3_5_9B_8L: dict[str, Any] = {
    "text_config": {
        "vocab_size": 248_320, "hidden_size": 4096, "intermediate_size": 12_288, "num_hidden_layers": 8,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "max_position_embeddings": 32_768, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    },
    "vision_config": {
        "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "patch_size": 16,
        "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 4096, "num_position_embeddings": 2304,
        "hidden_act": "gelu_pytorch_tanh", "in_channels": 3,
    },
    "image_token_id": 248_056, "video_token_id": 248_057, "vision_start_token_id": 248_053,
    "vision_end_token_id": 248_054, "tie_word_embeddings": False,
}  # fmt: skip
TINY_3_5: dict[str, Any] = {
    "text_config": QWEN3_5_9B_8L["text_config"] | {
        "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
        "layer_types": ["linear_attention", "full_attention"], "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5,
                            "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    },
    "vision_config": QWEN3_5_9B_8L["vision_config"] | {
        "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4, "out_hidden_size": 64,
        "num_position_embeddings": 64,
    },
    "image_token_id": 990, "video_token_id": 991, "vision_start_token_id": 992, "vision_end_token_id": 993,
    "tie_word_embeddings": False,
}  # fmt: skip
# --model -> (config class, full config, tiny config, label).
MODELS = {
    "qwen3_vl_2b": (Qwen3VLConfig, QWEN3_VL_2B, TINY, "Qwen3-VL-2B architecture"),
    "qwen2_5_vl_7b": (Qwen2_5_VLConfig, QWEN2_5_VL_7B, TINY_2_5, "Qwen2.5-VL-7B architecture"),
    "qwen3_5_9b_8l": (Qwen3_5Config, QWEN3_5_9B_8L, TINY_3_5, "Qwen3.5-9B architecture, 8 of 32 text layers"),
}


def vlm_config(tiny: bool, model: str = "qwen3_vl_2b") -> Qwen3VLConfig | Qwen2_5_VLConfig:
    """``model``'s config (`MODELS`; or its tiny smoke config), KV cache off as in training."""
    cls, full, small, _ = MODELS[model]
    config = cls(**(small if tiny else full))
    config.text_config.use_cache = False
    return config
