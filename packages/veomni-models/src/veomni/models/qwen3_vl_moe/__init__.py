"""Qwen3-VL-MoE adapter: a patch config reusing the Qwen3-VL one (name_map) and its generated modeling file."""
