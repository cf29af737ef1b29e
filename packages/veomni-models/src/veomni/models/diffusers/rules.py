"""The diffusion families' rules, found by a diffusers ``_class_name``, and the values they exchange with their
callers.

A diffusion family declares `veomni.models.family.DiffusionRules` on its `veomni.models.family.ModelTypeSpec`
(``library="diffusers"``). The diffusers build (`veomni.models.diffusers.build`) asks them for the kernels and the
Ulysses SP it applies, the ``dit`` task (`veomni.train.tasks.dit`) for its condition side; neither names a family.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from veomni.models.families import FAMILIES
from veomni.models.family import DiffusionRules, resolve

__all__ = [
    "ConditionConfigs",
    "Mismatch",
    "WeightCounts",
    "diffusion_models",
    "diffusion_rules",
    "find_diffusion_rules",
    "resolve_rule",
]


@attrs.frozen(kw_only=True)
class ConditionConfigs:
    """A diffusion transformer's condition side, read from its configs alone (`DiffusionRules.condition_configs`).

    Attributes:
        vae: the VAE config (the class's defaults filled in); what `DiffusionRules.flow_matching_inputs` takes as
            ``vae_config`` (latent channels and normalisation statistics).
        schedule: the flow-matching schedule (`veomni.models.diffusers.flow_matching.FlowMatchingSchedule`).
        text_dim: width of the text encoder's embeddings (the transformer's context width).
        image_dim: width of the image encoder's embeddings, or None without an image condition.
        image_tokens: image-condition tokens per sample (0 without an image condition).
        temporal_compression: video frames per latent frame (after the first) of the VAE.
        spatial_compression: pixels per latent pixel (each of height and width) of the VAE.
    """

    vae: Mapping[str, Any]
    schedule: Any
    text_dim: int
    image_dim: int | None
    image_tokens: int
    temporal_compression: int
    spatial_compression: int


@attrs.frozen
class Mismatch:
    """One setting that does not fit the condition side (`DiffusionRules.compatibility`).

    Attributes:
        key: a transformer config key, or ``max_sequence_length`` (the prompt length the caller passed).
        found: its value.
        expected: the value the condition side needs.
        why: where the expected value comes from.
    """

    key: str
    found: Any
    expected: Any
    why: str


@attrs.frozen(kw_only=True)
class WeightCounts:
    """A diffusion transformer's matmul weights (element counts) by what each multiplies, and its self-attention
    shape (`DiffusionRules.weight_counts`): the dit task's FLOPs count (`veomni.train.tasks.dit.DitFlops`).

    Attributes:
        token: weights multiplying each video token (patch embedding, blocks, output projection).
        text: weights multiplying each text context token (the text embedder, the cross-attention's keys and
            values).
        image: weights multiplying each image context token; 0 without an image condition.
        sample: weights that run once per sample (the timestep embedding).
        layers: self-attention layers.
        width: their ``heads * head_dim`` (attention score and value FLOPs).
    """

    token: int
    text: int
    image: int
    sample: int
    layers: int
    width: int


def diffusion_models() -> dict[str, str]:
    """``{_class_name: family name}`` of every diffusers model a family declares `DiffusionRules` for."""
    return {
        spec.model_type: family.name
        for family in FAMILIES
        for spec in family.model_types
        if spec.diffusion is not None
    }


def find_diffusion_rules(class_name: str) -> DiffusionRules | None:
    """The `DiffusionRules` of the diffusers model ``class_name`` (its ``_class_name``), or None."""
    for family in FAMILIES:
        spec = family.spec(class_name)
        if spec is not None and spec.diffusion is not None:
            return spec.diffusion
    return None


def diffusion_rules(class_name: str, where: str) -> DiffusionRules:
    """The `DiffusionRules` of ``class_name``; a ValueError (prefixed by ``where``) naming it and the diffusion
    models veomni has rules for when no family declares them."""
    rules = find_diffusion_rules(class_name)
    if rules is None:
        known = ", ".join(
            f"{name} (family {family!r})" for name, family in sorted(diffusion_models().items())
        )
        raise ValueError(
            f"{where}: the diffusers model {class_name!r} (its config's _class_name) has no veomni diffusion "
            f"rules: no family declares it. Diffusion transformers veomni trains: {known}"
        )
    return rules


def resolve_rule(rules: DiffusionRules, name: str) -> Any:
    """Import and return the rule ``name`` (a `DiffusionRules` field) of ``rules``; a ValueError when the family
    leaves it unset."""
    target = getattr(rules, name)
    if target is None:
        raise ValueError(f"the diffusion rules declare no {name!r}")
    return resolve(target)
