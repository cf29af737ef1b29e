"""Gemma 3 (text) adapter: the patch config, its generated modeling file and its guards."""
