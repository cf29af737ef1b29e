"""Qwen3-Next adapter: the patch config, Ulysses SP for Gated DeltaNet (`sp`) and its generated modeling file."""
