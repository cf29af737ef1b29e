"""Import a `tools/bench` script as a module (the scripts are not a package), once per test session."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parents[2] / "tools" / "bench"


def load_bench(script: str) -> ModuleType:
    """``tools/bench/<script>`` loaded under the name ``<stem>_under_test`` (cached in ``sys.modules``)."""
    name = f"{Path(script).stem}_under_test"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH_DIR / script)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
