"""Qwen2-VL adapter: the patch config, its generated modeling file and the hand-written pieces it calls (shared with Qwen2.5-VL)."""
