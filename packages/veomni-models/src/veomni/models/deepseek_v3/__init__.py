"""DeepSeek-V3 adapter: the patch config and its generated modeling file."""
