"""Key-only checkpoint transforms and sub-model scopes, as transformers applies them.

transformers' conversion recipes (``transformers.conversion_mapping``) rename checkpoint keys with regexes
(``WeightRenaming``: look-aheads such as ``^model(?!\\.(language_model|visual))``, capture groups) and add or
drop whole prefixes (``PrefixChange``). A recipe found on a sub-model (``model.language_model`` of a VLM) is
scoped: it applies only to keys under that sub-model's prefix, with or without the base model prefix.

`KeyRename` runs one of transformers' own rename objects (so a key is renamed exactly as ``from_pretrained``
renames it, quirks included) and its ``reverse_transform`` (as ``save_pretrained`` writes it). `ScopedConverter`
restricts one of veomni's tensor converters to a scope, with transformers' prefix rule. `rename_key` /
`unrename_key` chain them in transformers' order: on load every rename in turn, on export their inverses in
the opposite order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from veomni.models.convert.converters import CheckpointConverter, Converted, UnsupportedRecipeError

if TYPE_CHECKING:
    from veomni.models.convert.converters import _Buffering
    from veomni.models.loading.lazy import TensorLike


def scope_prefixes(scope: str | None, base_model_prefix: str | None) -> tuple[str, ...] | None:
    """The key prefixes a transform scoped to ``scope`` accepts; None when unscoped (every key).

    As transformers matches scoped transforms: ``{base}.{scope}.`` first, then ``{scope}.`` (a checkpoint of
    the base model, saved without the head's prefix). An empty scope (a sub-model at the base model itself)
    accepts every key, preferring to strip ``{base}.``.
    """
    if scope is None:
        return None
    scope_dot = f"{scope}." if scope else ""
    base_dot = f"{base_model_prefix}." if base_model_prefix else ""
    return (base_dot + scope_dot, scope_dot) if base_dot else (scope_dot,)


def describe(transform: object) -> str:
    """A short human-readable description of one of transformers' transforms (patterns, ops, scope)."""
    ops = [type(op).__name__ for op in getattr(transform, "operations", [])]
    src = getattr(transform, "_original_source_patterns", "?")
    dst = getattr(transform, "_original_target_patterns", "?")
    scope = getattr(transform, "scope_prefix", None)
    where = f", scope {scope!r}" if scope is not None else ""
    return f"{type(transform).__name__}({src} -> {dst}{', ops=' + str(ops) if ops else ''}{where})"


class KeyRename:
    """One key rename of a transformers recipe: ``apply`` on load, ``revert`` on export.

    Args:
        transform: a ``transformers.core_model_loading.WeightRenaming`` (or subclass: ``PrefixChange``, ...),
            with its ``scope_prefix`` / ``base_model_prefix`` already set for the sub-model it belongs to.
        recipe_name: the recipe it comes from (a class name or ``model_type``), for messages.
    """

    def __init__(self, transform: object, recipe_name: str) -> None:
        from transformers.core_model_loading import WeightRenaming

        if not isinstance(transform, WeightRenaming):
            raise TypeError(f"KeyRename needs a transformers WeightRenaming, got {type(transform).__name__}")
        self.recipe_name = recipe_name
        self.description = describe(transform)
        self.scope: str | None = transform.scope_prefix
        self.is_prefix_change = type(transform).__name__ == "PrefixChange"
        self._forward = transform
        try:
            self._backward: object | None = transform.reverse_transform()
            self._no_inverse = ""
        except Exception as err:  # noqa: BLE001 - reported when an export needs the inverse
            self._backward, self._no_inverse = None, f"{type(err).__name__}: {err}"

    def apply(self, key: str) -> str:
        """``key`` as ``from_pretrained`` renames it with this transform (unchanged when it does not fire)."""
        renamed, _ = self._forward.rename_source_key(key)  # type: ignore[attr-defined]
        return renamed

    def revert(self, key: str) -> str:
        """``key`` as ``save_pretrained`` writes it back through the inverse transform."""
        if self._backward is None:
            raise UnsupportedRecipeError(
                f"{self.description} from recipe {self.recipe_name!r} has no inverse ({self._no_inverse}), "
                f"so {key!r} cannot be exported in the original layout"
            )
        renamed, _ = self._backward.rename_source_key(key)  # type: ignore[attr-defined]
        return renamed

    def __repr__(self) -> str:
        return f"KeyRename({self.description})"


def rename_key(key: str, renames: Sequence[KeyRename]) -> str:
    """A checkpoint key after every rename in turn (transformers applies all of them, in recipe order)."""
    for rename in renames:
        key = rename.apply(key)
    return key


def unrename_key(key: str, renames: Sequence[KeyRename]) -> str:
    """The checkpoint key a model key is saved as: every inverse, in the opposite order (as save_pretrained)."""
    for rename in reversed(renames):
        key = rename.revert(key)
    return key


class ScopedConverter:
    """A tensor converter restricted to the keys of one sub-model (see `scope_prefixes`).

    Checkpoint keys are claimed only under the scope; on export, only model keys under it are reverted.
    """

    def __init__(self, inner: CheckpointConverter, scope: str | None, base_model_prefix: str | None) -> None:
        self.inner = inner
        self.scope = scope
        self.prefixes = scope_prefixes(scope, base_model_prefix)

    def in_scope(self, name: str) -> bool:
        """Whether ``name`` lies under the scope."""
        return self.prefixes is None or any(name.startswith(p) for p in self.prefixes)

    def can_handle(self, name: str) -> bool:
        """The inner converter's verdict, for keys in scope only."""
        return self.in_scope(name) and self.inner.can_handle(name)

    def convert(self, name: str, tensor: TensorLike) -> Converted | _Buffering:
        """Delegates to the inner converter."""
        return self.inner.convert(name, tensor)

    def finalize(self) -> None:
        """Delegates to the inner converter."""
        self.inner.finalize()

    def revert(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """The inner converter's revert for model keys in scope; None elsewhere."""
        return self.inner.revert(name, tensor) if self.in_scope(name) else None

    def __getattr__(self, attr: str) -> object:
        # Tests and messages read the inner converter's fields (sources, num_experts, description ...).
        if attr == "inner":
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    def __repr__(self) -> str:
        return f"ScopedConverter({self.inner!r}, scope={self.scope!r})"
