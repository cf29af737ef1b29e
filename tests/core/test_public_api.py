"""Every public function of veomni.core is fully typed and documented; the re-exports resolve."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import veomni.core as core


def _public_functions():
    for info in pkgutil.walk_packages(core.__path__, "veomni.core."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if not name.startswith("_") and inspect.isfunction(obj) and obj.__module__ == module.__name__:
                yield f"{module.__name__}.{name}", obj


def test_public_functions_are_typed_and_documented():
    problems = []
    functions = list(_public_functions())
    assert len(functions) > 20
    for qualname, fn in functions:
        sig = inspect.signature(fn)
        untyped = [p for p, v in sig.parameters.items() if v.annotation is inspect.Parameter.empty]
        if untyped:
            problems.append(f"{qualname}: parameters without annotations {untyped}")
        if sig.return_annotation is inspect.Signature.empty:
            problems.append(f"{qualname}: no return annotation")
        if not (fn.__doc__ or "").strip():
            problems.append(f"{qualname}: no docstring")
    assert not problems, "\n".join(problems)


def test_reexports_resolve():
    for name in core.__all__:
        assert getattr(core, name) is not None, name
