"""The explicit list of patch-config modules that ``patchgen --list/--all/--check`` know about.

Adapters append their config module names here (one line each) when they add a generated file. Keeping
the list explicit means ``--check`` in CI covers exactly what is checked in, with no filesystem scan.
"""

from __future__ import annotations

CONFIG_MODULES: list[str] = [
    "veomni.models.llama.patch_config",
    "veomni.models.qwen2.patch_config",
    "veomni.models.qwen3.patch_config",
    "veomni.models.qwen3_moe.patch_config",
    "veomni.models.qwen3_vl.patch_config",
    "veomni.models.qwen3_vl_moe.patch_config",
    "veomni.models.qwen2_vl.patch_config",
    "veomni.models.qwen2_5_vl.patch_config",
    "veomni.models.gpt_oss.patch_config",
    "veomni.models.seed_oss.patch_config",
    "veomni.models.gemma3.patch_config",
    "veomni.models.deepseek_v3.patch_config",
    "veomni.models.qwen2_5_omni.patch_config",
    "veomni.models.qwen3_next.patch_config",
    "veomni.models.qwen3_5.patch_config",
    "veomni.models.qwen3_5_moe.patch_config",
    "veomni.models.qwen3_omni_moe.patch_config",
]


def registered_configs() -> list[str]:
    """The registered config module names, in registration order."""
    return list(CONFIG_MODULES)
