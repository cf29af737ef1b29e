"""Qwen3.5 adapter (text model): the patch config and its generated modeling file."""
