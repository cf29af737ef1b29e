"""A package's curated public names, imported on first use (PEP 562): ``veomni.models`` and ``veomni.train`` list
theirs as ``{name: module}`` and take their ``__all__``, ``__getattr__`` and ``__dir__`` from `lazy_public_names`.

It lives here, not in ``veomni.core``, because importing ``veomni.core`` imports torch, and ``import veomni.models``
/ ``import veomni.train`` must stay cheap (tests/test_package_api.py); ``veomni.train`` sits above this layer.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_public_names"]


def lazy_public_names(
    package: str, public: Mapping[str, str]
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``(__all__, __getattr__, __dir__)`` for the package ``package`` whose public names are ``public``
    (``{name: the module defining it}``): a name is imported from its module when first read; any other name is an
    AttributeError listing the public ones."""
    names = sorted(public)

    def __getattr__(name: str) -> Any:
        module = public.get(name)
        if module is None:
            raise AttributeError(
                f"module {package!r} has no attribute {name!r}; its public names are {names}"
            )
        return getattr(importlib.import_module(module), name)

    def __dir__() -> list[str]:
        return list(names)

    return names, __getattr__, __dir__
