"""veomni.models: the model registry built from the model families, meta-device build, weight loading, export.

The public names below are imported on first use (PEP 562), so ``import veomni.models`` stays cheap and declaring
a family (``veomni.models.<family>.family``) does not pull in the registry.
"""

from __future__ import annotations

from veomni.models.public_names import lazy_public_names

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

__all__, __getattr__, __dir__ = lazy_public_names(__name__, _PUBLIC)
