"""The curated public names of veomni.models and veomni.train resolve, lazily, and nothing else is offered."""

from __future__ import annotations

import subprocess
import sys

import pytest

import veomni.models
import veomni.train


@pytest.mark.parametrize("package", [veomni.models, veomni.train], ids=lambda p: p.__name__)
def test_every_public_name_resolves(package):
    assert package.__all__ and sorted(package.__all__) == package.__all__
    for name in package.__all__:
        assert getattr(package, name) is not None, name
    with pytest.raises(AttributeError, match=r"has no attribute 'nope'; its public names are"):
        package.nope  # noqa: B018


def test_importing_the_packages_imports_nothing_heavy():
    script = "import sys, veomni.models, veomni.train; print(sorted(m for m in ('transformers', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
