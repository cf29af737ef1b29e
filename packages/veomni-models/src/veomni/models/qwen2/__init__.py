"""Qwen2 adapter: the patch config and its generated modeling file."""
