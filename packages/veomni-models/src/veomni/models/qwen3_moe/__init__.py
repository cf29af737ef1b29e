"""Qwen3-MoE adapter: the patch config and its generated modeling file."""
