"""The patch-config modules that ``patchgen --list/--all/--check`` know about.

They come from veomni's family list (`veomni.models.families.FAMILY_MODULES`: each family declares its
``patch_configs``), so a family is added in one place. The list is explicit -- no filesystem scan -- so ``--check``
in CI covers exactly what the families declare; a stray patch config on disk is reported by the test suite.
"""

from __future__ import annotations

from veomni.models.families import patch_config_modules

CONFIG_MODULES: list[str] = patch_config_modules()


def registered_configs() -> list[str]:
    """The registered config module names, in registration order."""
    return list(CONFIG_MODULES)
