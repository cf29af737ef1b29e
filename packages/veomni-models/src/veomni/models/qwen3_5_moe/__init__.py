"""Qwen3.5-MoE adapter (text model): the patch config and its generated modeling file."""
