"""The one list of veomni's model families, and lookups over it.

Each entry names a family's declaration module (``veomni.models.<family>.family``, whose ``FAMILY`` is a
`veomni.models.family.ModelFamily`). The model registry (`veomni.models.registry.MODELS`) and patchgen's
``--list/--check`` are built from this list; adding a family is its folder plus one line here.
"""

from __future__ import annotations

import importlib

from veomni.models.family import DataRules, LoraTargets, ModelFamily, ModelTypeSpec, TrainingHooks, resolve

FAMILY_MODULES: tuple[str, ...] = (
    "veomni.models.llama.family",
    "veomni.models.qwen2.family",
    "veomni.models.qwen3.family",
    "veomni.models.qwen3_moe.family",
    "veomni.models.qwen3_vl.family",
    "veomni.models.qwen3_vl_moe.family",
    "veomni.models.qwen2_vl.family",
    "veomni.models.qwen2_5_vl.family",
    "veomni.models.gpt_oss.family",
    "veomni.models.seed_oss.family",
    "veomni.models.gemma3.family",
    "veomni.models.deepseek_v3.family",
    "veomni.models.glm4_moe.family",
    "veomni.models.qwen2_5_omni.family",
    "veomni.models.qwen3_next.family",
    "veomni.models.qwen3_5.family",
    "veomni.models.qwen3_5_moe.family",
    "veomni.models.qwen3_omni_moe.family",
    "veomni.models.wan.family",
)


def load_family(module_name: str) -> ModelFamily:
    """The ``FAMILY`` of the declaration module ``module_name`` (an error says what the module holds instead)."""
    module = importlib.import_module(module_name)
    family = getattr(module, "FAMILY", None)
    if not isinstance(family, ModelFamily):
        raise TypeError(
            f"{module_name}: expected a module-level FAMILY = ModelFamily(...), found {type(family).__name__}"
        )
    return family


FAMILIES: tuple[ModelFamily, ...] = tuple(load_family(name) for name in FAMILY_MODULES)
"""veomni's built-in families, in `FAMILY_MODULES` order (declarations only: no modeling code is imported)."""


def _by_model_type() -> dict[str, tuple[ModelFamily, ModelTypeSpec]]:
    found: dict[str, tuple[ModelFamily, ModelTypeSpec]] = {}
    for family in FAMILIES:
        for spec in family.model_types:
            if spec.model_type in found:
                raise ValueError(
                    f"model_type {spec.model_type!r} is declared by families {found[spec.model_type][0].name!r} "
                    f"and {family.name!r}"
                )
            found[spec.model_type] = (family, spec)
    return found


_MODEL_TYPES = _by_model_type()


def family_of(model_type: str) -> ModelFamily | None:
    """The family declaring ``model_type`` (HF ``model_type`` or diffusers ``_class_name``), or None."""
    hit = _MODEL_TYPES.get(model_type)
    return None if hit is None else hit[0]


def data_rules(model_type: str) -> DataRules | None:
    """The data pipeline's rules for ``model_type`` (`veomni.models.family.DataRules`), or None (text-only or
    not a veomni family)."""
    hit = _MODEL_TYPES.get(model_type)
    return None if hit is None else hit[1].data


def lora_targets(model_type: str) -> LoraTargets | None:
    """Where LoRA adapters go in ``model_type`` (`veomni.models.family.LoraTargets`), or None when its family
    declares nothing (a LoRA recipe must then name its target modules)."""
    hit = _MODEL_TYPES.get(model_type)
    return None if hit is None else hit[1].lora


def training_hooks(model_type: str) -> TrainingHooks:
    """The trainer's hooks for ``model_type``'s family; none for a model no family declares."""
    hit = _MODEL_TYPES.get(model_type)
    return TrainingHooks() if hit is None else hit[0].hooks


def async_ulysses_classes(model_type: str) -> tuple[type, ...]:
    """The attention classes of ``model_type`` whose forward has the async Ulysses branch, imported
    (`veomni.models.family.ModelTypeSpec.async_ulysses`).

    Raises:
        ValueError: ``model_type`` has none; the message gives its family's reason (``no_async_ulysses``), or says
            that it has no Ulysses SP or that no family declares it.
    """
    hit = _MODEL_TYPES.get(model_type)
    if hit is None:
        raise ValueError(
            f"model_type {model_type!r} is declared by no veomni family, so it has no async Ulysses path"
        )
    family, spec = hit
    if spec.async_ulysses:
        return tuple(resolve(target) for target in spec.async_ulysses)
    reason = spec.no_async_ulysses or f"it has no Ulysses SP (fast_paths {sorted(spec.fast_paths)})"
    raise ValueError(
        f"model_type {model_type!r} (family {family.name!r}) has no async Ulysses path: {reason}"
    )


def patch_config_modules() -> list[str]:
    """Every family's patch-config modules, in `FAMILY_MODULES` order (what ``patchgen --list/--check`` cover)."""
    return [name for family in FAMILIES for name in family.patch_configs]
