"""Qwen3 (dense) adapter: the patch config and its generated modeling file."""
