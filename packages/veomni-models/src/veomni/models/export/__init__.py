"""Exports in the upstream format: HF safetensors from a live model or a DCP checkpoint, its side files, the CLI."""
