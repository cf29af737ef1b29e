"""Qwen2.5-Omni thinker adapter: the patch config, its generated modeling file and the hand-written pieces it calls."""
