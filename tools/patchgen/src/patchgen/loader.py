"""Load a patch-config module and find its `PatchConfig`, touching as little of its package as possible.

A model package's ``__init__`` typically imports the generated module; if that file is stale or broken,
importing the package would make regeneration impossible. So a config module found on ``sys.path`` is
executed from its file directly, without running its parents' ``__init__`` files.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from .config import PatchConfig
from .source import PatchgenError


@dataclass(frozen=True)
class LoadedConfig:
    """A config with the module name it came from and the directory of its file."""

    module_name: str
    config: PatchConfig
    directory: Path

    def default_output(self) -> Path:
        """Where the generated file lives unless ``-o`` says otherwise: ``<config dir>/generated/``."""
        return self.directory / "generated" / self.config.target_file


def _load_module(name: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    rel = Path(*name.split("."))
    for entry in sys.path:
        candidate = Path(entry or ".") / rel.with_suffix(".py")
        if candidate.is_file():
            spec = importlib.util.spec_from_file_location(name, candidate)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            # Registered before execution so that sibling configs importing it reuse this instance.
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
            return module
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise PatchgenError(f"cannot import patch config module {name!r}: {exc}") from exc


def load_config(name: str, variable: str | None = None) -> LoadedConfig:
    """Import config module ``name`` and return its `PatchConfig`.

    The config is the module attribute ``variable`` if given, else ``config``, else the only
    `PatchConfig` instance among the module's globals.
    """
    module = _load_module(name)
    if variable is not None or hasattr(module, "config"):
        attr = variable or "config"
        config = getattr(module, attr, None)
        if not isinstance(config, PatchConfig):
            raise PatchgenError(f"{name}.{attr} is {type(config).__name__}, expected PatchConfig")
    else:
        found = {k: v for k, v in vars(module).items() if isinstance(v, PatchConfig)}
        if len(found) != 1:
            raise PatchgenError(
                f"{name} defines {len(found)} PatchConfig objects ({sorted(found)}); "
                "name one with -c/--config-var"
            )
        config = next(iter(found.values()))
    if module.__file__ is None:
        raise PatchgenError(f"config module {name!r} has no file")
    return LoadedConfig(name, config, Path(module.__file__).resolve().parent)
