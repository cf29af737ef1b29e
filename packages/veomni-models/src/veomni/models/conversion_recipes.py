"""Choosing a model's checkpoint converters from transformers' own conversion recipe.

transformers describes, per model type or class, how original checkpoints map onto its modeling
(``transformers.conversion_mapping``): e.g. ``qwen3_moe`` is an alias of the ``qwen2_moe`` recipe, which merges
per-expert ``gate_proj`` / ``up_proj`` / ``down_proj`` into fused tensors. We read that recipe, never the
family name, and build the matching converters. Transforms we do not implement (renames, prefix changes,
other ops) become guards: a checkpoint key they would apply to is an error naming the transform, while a
checkpoint already in the model's layout (which they would not touch) still loads.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from veomni.models.converters import (
    CheckpointConverter,
    Converted,
    ExpertMergeConverter,
    FusedTransposeConverter,
    UnsupportedRecipeError,
    plain_pattern,
    suffix_regex,
)


def _recipe(names: Sequence[str | None]) -> tuple[str, list] | None:
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    for name in names:
        if name:
            recipe = get_checkpoint_conversion_mapping(name)
            if recipe is not None:
                return name, recipe
    return None


def _describe(transform: object) -> str:
    ops = [type(op).__name__ for op in getattr(transform, "operations", [])]
    src = getattr(transform, "_original_source_patterns", "?")
    dst = getattr(transform, "_original_target_patterns", "?")
    return f"{type(transform).__name__}({src} -> {dst}{', ops=' + str(ops) if ops else ''})"


def _pattern(source: str) -> re.Pattern[str]:
    # transformers' source patterns are searched as regexes, with '*' standing for a module index.
    try:
        return re.compile(source.replace(".*.", r"\.\d+\.") if "*" in source else source)
    except re.error:
        return re.compile(re.escape(source))


class UnsupportedTransform:
    """A guard for one recipe transform veomni does not implement: keys it applies to raise.

    ``can_handle`` claims the checkpoint keys the transform's source patterns match; ``convert`` raises
    `UnsupportedRecipeError` naming the transform and the way out. It never reverts anything.
    """

    def __init__(self, recipe_name: str, transform: object) -> None:
        self.recipe_name = recipe_name
        self.description = _describe(transform)
        self._patterns = [_pattern(s) for s in getattr(transform, "_original_source_patterns", [])]

    def can_handle(self, name: str) -> bool:
        """Whether the transform would apply to the checkpoint key ``name``."""
        return any(p.search(name) for p in self._patterns)

    def convert(self, name: str, tensor: object) -> Converted:
        """Always raises: veomni cannot apply this transform."""
        raise UnsupportedRecipeError(
            f"checkpoint key {name!r} needs {self.description} from transformers' conversion recipe "
            f"{self.recipe_name!r}, which veomni's loader does not implement; convert the checkpoint once with "
            "transformers (from_pretrained, then save_pretrained(save_original_format=False))"
        )

    def finalize(self) -> None:
        """Nothing is ever buffered."""

    def revert(self, name: str, tensor: object) -> None:
        """Never: the export keeps the model's layout for these keys."""
        return None


def select_converters(
    full_shapes: Mapping[str, Sequence[int]], *, model_type: str | None, class_name: str | None = None
) -> list[CheckpointConverter]:
    """The converters for a model, chosen from transformers' conversion recipe for it.

    The recipe is looked up as transformers does: by class name first, then by ``model_type`` (aliases such
    as ``qwen3_moe -> qwen2_moe`` resolved by transformers). ``MergeModulelist(0)`` [+ ``Concatenate``] becomes
    an `ExpertMergeConverter`; ``Transpose`` of a tensor onto its own name a `FusedTransposeConverter`; no
    recipe means the checkpoint is in the model's layout (no converter). Anything else becomes an
    `UnsupportedTransform` guard, listed first so that it claims its keys before any other converter.

    Args:
        full_shapes: ``{model key: full shape}`` of every parameter (pre-EP, pre-FSDP); the number of experts
            and the expected layouts are read from it, not from config fields.
        model_type: the config's ``model_type``.
        class_name: the model class's name (as transformers names it, no FSDP wrapper prefix).
    """
    from transformers.core_model_loading import Concatenate, MergeModulelist, Transpose, WeightConverter

    found = _recipe([class_name, model_type])
    if found is None:
        return []
    recipe_name, recipe = found
    guards: list[CheckpointConverter] = []
    converters: list[CheckpointConverter] = []
    transposes: dict[tuple[int, int, bool], list[str]] = {}
    for t in recipe:
        ops = list(getattr(t, "operations", []))
        kinds = [type(op) for op in ops]
        src, dst = list(t._original_source_patterns), list(t._original_target_patterns)
        try:
            if not isinstance(t, WeightConverter) or len(dst) != 1:
                raise UnsupportedRecipeError(_describe(t))
            if kinds in ([MergeModulelist], [MergeModulelist, Concatenate]) and ops[0].dim == 0:
                target = plain_pattern(dst[0], "target")
                rx = suffix_regex(re.escape(target))
                experts = {tuple(shape)[0] for key, shape in full_shapes.items() if rx.match(key)}
                if len(experts) > 1:
                    raise UnsupportedRecipeError(
                        f"{target}: layers have different expert counts {sorted(experts)}"
                    )
                if experts:  # else the model has no such tensor: stray keys are reported as unexpected
                    concat = ops[-1].dim if len(ops) == 2 else 0
                    converters.append(ExpertMergeConverter(src, target, experts.pop(), concat))
            elif kinds == [Transpose] and src == dst:
                op = ops[0]
                transposes.setdefault((op.dim0, op.dim1, not op.check_dims), []).append(
                    plain_pattern(dst[0], "target")
                )
            else:
                raise UnsupportedRecipeError(_describe(t))
        except UnsupportedRecipeError:
            guards.append(UnsupportedTransform(recipe_name, t))
    for (dim0, dim1, on_export), targets in transposes.items():
        conv = FusedTransposeConverter(targets, full_shapes, dim0, dim1, transpose_on_export=on_export)
        if any(conv.can_handle(k) for k in full_shapes):
            converters.append(conv)
    return guards + converters
