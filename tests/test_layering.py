"""Dependencies point one way: core <- kernels <- models <- train. Checked by reading every import statement."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["core", "kernels", "models", "train"]
# Third-party modules a layer must never import (core and kernels stay free of HF).
FORBIDDEN_THIRD_PARTY = {
    "core": {"transformers", "diffusers", "triton", "liger_kernel", "flash_attn"},
    "kernels": {"transformers", "diffusers"},
}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def layer_sources(layer: str) -> list[Path]:
    return sorted((ROOT / "packages" / f"veomni-{layer}" / "src" / "veomni" / layer).rglob("*.py"))


def violations(layer: str, modules: set[str]) -> list[str]:
    allowed = set(LAYERS[: LAYERS.index(layer) + 1])
    bad = []
    for module in sorted(modules):
        parts = module.split(".")
        if parts[0] == "veomni" and len(parts) > 1 and parts[1] in LAYERS and parts[1] not in allowed:
            bad.append(f"imports veomni.{parts[1]}, a layer above {layer}")
        if parts[0] == "veomni" and len(parts) == 1:
            bad.append("imports the bare 'veomni' namespace")
        if parts[0] in FORBIDDEN_THIRD_PARTY.get(layer, set()):
            bad.append(f"imports {parts[0]}, which veomni.{layer} must not depend on")
    return bad


@pytest.mark.parametrize("layer", LAYERS)
def test_layer_imports_only_below(layer):
    sources = layer_sources(layer)
    assert sources, f"veomni.{layer} has no sources under packages/veomni-{layer}/src/veomni/{layer}"
    problems = [
        f"{src.relative_to(ROOT)}: {msg}"
        for src in sources
        for msg in violations(layer, imported_modules(src))
    ]
    assert not problems, "\n".join(problems)


def test_namespace_has_no_init():
    inits = sorted(ROOT.glob("packages/*/src/veomni/__init__.py"))
    assert not inits, f"veomni is a PEP 420 namespace; remove {inits}"


def test_checker_catches_upward_and_hf_imports(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import transformers\nfrom veomni.train.loop import x\nfrom veomni.core import y\n")
    problems = violations("core", imported_modules(bad))
    assert problems == [
        "imports transformers, which veomni.core must not depend on",
        "imports veomni.train, a layer above core",
    ]
    assert violations("train", imported_modules(bad)) == []


def test_the_runtime_never_imports_the_dev_tool_patchgen():
    # patch_config.py files are patchgen's input (kept out of the wheel by veomni-models' wheel-exclude); every
    # other module of the four packages must run without patchgen installed.
    problems = [
        str(src.relative_to(ROOT))
        for layer in LAYERS
        for src in layer_sources(layer)
        if src.name != "patch_config.py" and any(m.split(".")[0] == "patchgen" for m in imported_modules(src))
    ]
    assert not problems, f"runtime modules import patchgen: {problems}"


def test_the_models_wheel_leaves_out_patch_configs_and_diffs():
    import tomllib

    excluded = tomllib.loads((ROOT / "packages" / "veomni-models" / "pyproject.toml").read_text())["tool"]["uv"][
        "build-backend"
    ]["wheel-exclude"]
    assert set(excluded) >= {"**/patch_config.py", "**/generated/*.diff"}, excluded
