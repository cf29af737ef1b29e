"""Qwen3-VL adapter: the patch config, its generated modeling file and the hand-written pieces it calls."""
