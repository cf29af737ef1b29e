"""Checkpoint conversion: key transforms, per-model conversion recipes, converters between layouts."""
