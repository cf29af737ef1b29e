"""veomni.models: the model registry built from the model families, meta-device build, weight loading, export.

The public names below are imported on first use (PEP 562), so ``import veomni.models`` stays cheap and declaring
a family (``veomni.models.<family>.family``) does not pull in the registry.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "MODELS": "veomni.models.registry",
    "ModelRegistry": "veomni.models.registry",
    "build_model": "veomni.models.build",
    "ModelFamily": "veomni.models.family",
    "ModelTypeSpec": "veomni.models.family",
    "DataRules": "veomni.models.family",
    "TrainingHooks": "veomni.models.family",
    "FAMILIES": "veomni.models.families",
    "family_of": "veomni.models.families",
    "export_hf": "veomni.models.export.hf",
    "export_dcp_to_hf": "veomni.models.export.hf",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(
            f"module 'veomni.models' has no attribute {name!r}; its public names are {__all__}"
        )
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
