"""Choosing a model's checkpoint converters from transformers' own conversion recipes.

transformers describes, per model type or class, how original checkpoints map onto its modeling
(``transformers.conversion_mapping``): e.g. ``qwen3_moe`` is an alias of the ``qwen2_moe`` recipe, which merges
per-expert ``gate_proj`` / ``up_proj`` / ``down_proj`` into fused tensors, and ``Qwen2VLForConditionalGeneration``
renames ``visual.`` / ``model.`` to ``model.visual.`` / ``model.language_model.``. We read those recipes, never
the family name. For a composite model, `model_converters` walks every ``PreTrainedModel`` sub-module as
``get_model_conversion_mapping`` does and scopes each sub-model's recipe to its prefix.

Key renames (``WeightRenaming``, ``PrefixChange``) become `veomni.models.convert.key_transforms.KeyRename`s; expert
merges and transposes our lazy converters. Transforms we do not implement (other tensor ops) become guards: a
checkpoint key they would apply to is an error naming the transform, while a checkpoint already in the
model's layout (which they would not touch) still loads.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping, Sequence

from torch import nn

from veomni.models.convert.converters import (
    CheckpointConverter,
    Converted,
    ExpertMergeConverter,
    FusedTransposeConverter,
    UnsupportedRecipeError,
    plain_pattern,
    suffix_regex,
)
from veomni.models.convert.key_transforms import KeyRename, ScopedConverter, describe, scope_prefixes


def _recipe(names: Sequence[str | None]) -> tuple[str, list] | None:
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    for name in names:
        if name:
            recipe = get_checkpoint_conversion_mapping(name)
            if recipe is not None:
                return name, recipe
    return None


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
        self.description = describe(transform)
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


def _in_scope(key: str, prefixes: tuple[str, ...] | None) -> bool:
    return prefixes is None or any(key.startswith(p) for p in prefixes)


def _tensor_converter(
    recipe_name: str, t: object, full_shapes: Mapping[str, Sequence[int]], transposes: dict
) -> CheckpointConverter | None:
    """Our converter for one ``WeightConverter`` (None when the model has no tensor it would produce);
    transposes are collected into ``transposes`` (one converter per (dims, export rule, scope)).
    Raises `UnsupportedRecipeError` for anything else."""
    from transformers.core_model_loading import Concatenate, MergeModulelist, Transpose, WeightConverter

    ops = list(getattr(t, "operations", []))
    kinds = [type(op) for op in ops]
    src, dst = list(t._original_source_patterns), list(t._original_target_patterns)  # type: ignore[attr-defined]
    if not isinstance(t, WeightConverter) or len(dst) != 1:
        raise UnsupportedRecipeError(describe(t))
    scope, base = t.scope_prefix, t.base_model_prefix
    prefixes = scope_prefixes(scope, base)
    if kinds in ([MergeModulelist], [MergeModulelist, Concatenate]) and ops[0].dim == 0:
        target = plain_pattern(dst[0], "target")
        rx = suffix_regex(re.escape(target))
        experts = {
            tuple(shape)[0]
            for key, shape in full_shapes.items()
            if rx.match(key) and _in_scope(key, prefixes)
        }
        if len(experts) > 1:
            raise UnsupportedRecipeError(f"{target}: layers have different expert counts {sorted(experts)}")
        if not experts:  # the model has no such tensor: stray keys are reported as unexpected
            return None
        concat = ops[-1].dim if len(ops) == 2 else 0
        merge = ExpertMergeConverter(src, target, experts.pop(), concat)
        return merge if scope is None else ScopedConverter(merge, scope, base)
    if kinds == [Transpose] and src == dst:
        op = ops[0]
        key = (op.dim0, op.dim1, not op.check_dims, scope, base)
        transposes.setdefault(key, []).append(plain_pattern(dst[0], "target"))
        return None
    raise UnsupportedRecipeError(describe(t))


def _build(
    entries: Sequence[tuple[str, object]], full_shapes: Mapping[str, Sequence[int]]
) -> list[CheckpointConverter | KeyRename]:
    from transformers.core_model_loading import WeightRenaming

    renames: list[KeyRename] = []
    guards: list[CheckpointConverter] = []
    converters: list[CheckpointConverter] = []
    transposes: dict[tuple, list[str]] = {}
    for recipe_name, t in entries:
        if isinstance(t, WeightRenaming):
            renames.append(KeyRename(t, recipe_name))
            continue
        try:
            conv = _tensor_converter(recipe_name, t, full_shapes, transposes)
        except UnsupportedRecipeError:
            guard = UnsupportedTransform(recipe_name, t)
            scope = getattr(t, "scope_prefix", None)
            conv = guard if scope is None else ScopedConverter(guard, scope, t.base_model_prefix)  # type: ignore[attr-defined]
            guards.append(conv)
            continue
        if conv is not None:
            converters.append(conv)
    for (dim0, dim1, on_export, scope, base), targets in transposes.items():
        prefixes = scope_prefixes(scope, base)
        shapes = {k: v for k, v in full_shapes.items() if _in_scope(k, prefixes)}
        conv = FusedTransposeConverter(targets, shapes, dim0, dim1, transpose_on_export=on_export)
        if any(conv.can_handle(k) for k in shapes):
            converters.append(conv if scope is None else ScopedConverter(conv, scope, base))
    return [*renames, *guards, *converters]


def select_converters(
    full_shapes: Mapping[str, Sequence[int]], *, model_type: str | None, class_name: str | None = None
) -> list[CheckpointConverter | KeyRename]:
    """The converters of one recipe, looked up as transformers does for a single model: by class name first,
    then by ``model_type`` (aliases such as ``qwen3_moe -> qwen2_moe`` resolved by transformers).

    For a model object (composites included) use `model_converters`, which walks its sub-models.
    ``MergeModulelist(0)`` [+ ``Concatenate``] becomes an `ExpertMergeConverter`; ``Transpose`` of a tensor onto
    its own name a `FusedTransposeConverter`; renames `KeyRename`s; no recipe means the checkpoint is in the
    model's layout (no converter). Anything else becomes an `UnsupportedTransform` guard, listed before the
    other tensor converters so that it claims its keys first.

    Args:
        full_shapes: ``{model key: full shape}`` of every parameter (pre-EP, pre-FSDP); the number of experts
            and the expected layouts are read from it, not from config fields.
        model_type: the config's ``model_type``.
        class_name: the model class's name (as transformers names it, no FSDP wrapper prefix).
    """
    found = _recipe([class_name, model_type])
    if found is None:
        return []
    recipe_name, recipe = found
    return _build([(recipe_name, t) for t in recipe], full_shapes)


def _claimed(paths: list[str], name: str) -> bool:
    return any(seen == "" or name.startswith(seen + ".") for seen in paths)


def _custom_code(cls: type) -> bool:
    # transformers skips models defined outside it (their layout may differ under a native name). veomni's
    # generated modeling keeps upstream's names and layout, so it counts as native; FSDP2's wrapper class is
    # looked through by the caller.
    if getattr(cls, "_auto_class", None) is not None:
        return True
    return not cls.__module__.startswith(("transformers.", "veomni."))


def recipe_transforms(model: nn.Module, *, add_legacy: bool = True) -> list[tuple[str, object]]:
    """``(recipe name, transform)`` for ``model`` and each of its sub-models, scoped, in transformers' order.

    The walk of ``transformers.conversion_mapping.get_model_conversion_mapping`` (which the tests compare it
    with), done on class names without FSDP2's ``FSDP<Class>`` wrappers so it also works on a sharded model:
    every ``PreTrainedModel`` module is looked up by class name, then ``model_type``; a name an ancestor already
    claimed is skipped (as is remote / user code, except veomni's own generated modeling, which keeps upstream's
    layout); a sub-model's transforms get ``scope_prefix`` (its path without the base model prefix)
    and ``base_model_prefix``. ``add_legacy`` appends the ``legacy`` renames (``LayerNorm.gamma`` ...), which
    transformers applies on load but not when saving.
    """
    from transformers import PreTrainedModel
    from transformers.conversion_mapping import USER_REGISTERED_MAPPINGS, get_checkpoint_conversion_mapping

    from veomni.models.loading.targets import unwrapped_class

    base = getattr(model, "base_model_prefix", "") or ""
    seen: defaultdict[str, list[str]] = defaultdict(list)
    out: list[tuple[str, object]] = []
    for name, module in model.named_modules():
        if not isinstance(module, PreTrainedModel):
            continue
        cls = unwrapped_class(module)
        class_name = cls.__name__
        model_type = getattr(module.config, "model_type", None)
        registered = class_name in USER_REGISTERED_MAPPINGS or model_type in USER_REGISTERED_MAPPINGS
        if _custom_code(cls) and not registered:
            continue  # remote code may reuse a native name without its layout
        if _claimed(seen[class_name], name):
            continue
        recipe_name, transforms = class_name, get_checkpoint_conversion_mapping(class_name)
        via_class = transforms is not None
        if not via_class:
            if model_type and _claimed(seen[model_type], name):
                continue
            if model_type:
                recipe_name, transforms = model_type, get_checkpoint_conversion_mapping(model_type)
        if transforms is None:
            continue
        if name:
            scope = name.removeprefix(base).removeprefix(".")
            for t in transforms:
                t.scope_prefix, t.base_model_prefix = scope, base
        out.extend((recipe_name, t) for t in transforms)
        seen[class_name].append(name)
        if not via_class and model_type:
            seen[model_type].append(name)
    if add_legacy:
        out.extend(("legacy", t) for t in get_checkpoint_conversion_mapping("legacy") or [])
    return out


def model_converters(
    model: nn.Module, full_shapes: Mapping[str, Sequence[int]], *, for_export: bool = False
) -> list[CheckpointConverter | KeyRename]:
    """Fresh converters for ``model`` (plain or FSDP / EP sharded), from the recipes of all its sub-models.

    On load (``for_export=False``) this is what ``from_pretrained`` applies, ``legacy`` renames included. For
    export it is what ``save_pretrained`` reverts on a model it did not load itself: no ``legacy`` renames and
    no ``PrefixChange`` (it cannot know whether the prefix was there), so an export is written in the layout
    of the model's original checkpoints whatever layout it was loaded from.

    Args:
        model: the model (its class, sub-models and configs decide the recipes).
        full_shapes: ``{model key: full shape}`` (pre-EP, pre-FSDP).
        for_export: choose the transforms export reverts.
    """
    entries = recipe_transforms(model, add_legacy=not for_export)
    if for_export:
        entries = [(n, t) for n, t in entries if type(t).__name__ != "PrefixChange"]
    return _build(entries, full_shapes)
