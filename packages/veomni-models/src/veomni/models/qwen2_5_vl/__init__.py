"""Qwen2.5-VL adapter: the patch config (Qwen2-VL's pieces plus windowed ViT attention) and its host-side window index."""
