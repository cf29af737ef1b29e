"""Qwen3-Omni-MoE thinker adapter: the patch config, its generated modeling file and the hand-written pieces it calls."""
