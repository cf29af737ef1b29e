"""Seed-OSS adapter: the patch config and its generated modeling file."""
