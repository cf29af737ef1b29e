"""Every DSL primitive applied to the fake upstream module, checked on the parsed and executed output."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from fakeup.modeling_dense import DenseMoeOutput, DenseOutput
from helpers_patchgen import import_file
from patchgen.codegen import Generated, find_source, generate, transformers_version
from patchgen.config import PatchConfig, PatchConfigError
from patchgen.loader import load_config
from patchgen.normalize import normalise
from patchgen.source import PatchgenError


@pytest.fixture(scope="module")
def full() -> Generated:
    loaded = load_config("fake_patch_configs.fake_full")
    return generate(loaded.config, loaded.module_name)


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


def test_header_lists_patches_and_transformers_version(full: Generated) -> None:
    head = full.code.split('"""', 1)[0]
    assert f"# transformers=={transformers_version()}" in head
    assert "# Source module: fakeup.modeling_fake" in head
    for line in (
        "replace_class FakeMLP: MLP that halves after scaling",
        "override_method FakeModel.forward: forward doubles the last value",
        "add_method FakeModel.describe: a method upstream lacks",
        "modify_init FakeModel.__init__: __init__ records that it is patched",
        "replace_function fake_helper: the helper adds ten",
        "external FakeModel.greet: greet comes from another module",
        "add_helper veomni_half: halves its input",
        "exclude_from_output: Talker",
    ):
        assert line in head


def test_structure_of_the_output(full: Generated) -> None:
    tree = ast.parse(full.code)
    assert ast.get_docstring(tree, clean=False).startswith("Fake upstream modeling module.")
    assert "# A module-level comment that must survive generation." in full.code
    assert "# Post-import block: a module-level constant." in full.code
    # Relative import made absolute, dropped name gone, added import present.
    assert "from fakeup._base import BaseModule\n" in full.code
    assert "from ._base" not in full.code
    assert "import statistics" in full.code
    # Exclusion: definition gone, __all__ rebuilt.
    assert not any(isinstance(n, ast.ClassDef) and n.name == "Talker" for n in tree.body)
    all_stmt = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "__all__")
    assert "Talker" not in ast.literal_eval(all_stmt.value)
    assert "FakeModel" in ast.literal_eval(all_stmt.value)
    # One marker per patched site (+ helper + post-import block).
    assert len(re.findall(r"# \[PATCHED\] ", full.code)) == 8
    model = _class(tree, "FakeModel")
    assert [m.name for m in model.body if isinstance(m, ast.FunctionDef)] == [
        "__init__",
        "forward",
        "greet",
        "describe",
    ]


def test_decorators_are_preserved_and_registration_decorators_stripped(full: Generated) -> None:
    tree = ast.parse(full.code)
    forward = _method(_class(tree, "FakeModel"), "forward")
    assert [ast.unparse(d) for d in forward.decorator_list] == ["traced"]
    helper = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "fake_helper")
    assert [ast.unparse(d) for d in helper.decorator_list] == ["functools.lru_cache(maxsize=4)"]
    assert not re.search(r"@config\.", full.code)


def test_modify_init_is_really_applied(full: Generated) -> None:
    init = _method(_class(ast.parse(full.code), "FakeModel"), "__init__")
    assert "self.patched = True" in ast.unparse(init)


def test_unreferenced_helper_warning(full: Generated) -> None:
    assert any("talker_only_helper" in w for w in full.warnings)


def test_generated_module_executes(full: Generated, tmp_path: Path) -> None:
    path = tmp_path / "patched_fake.py"
    path.write_text(full.code)
    mod = import_file(path, "patchgen_test_patched_fake")
    model = mod.FakeModel(mod.FakeConfig(hidden=4))
    out = model.forward(1.0)
    # MLP: 1*4 halved = 2; helper: +10 = 12; forward doubles: 24.
    assert out == mod.FakeOutput(last=24.0, hidden=[1.0, 2.0])
    assert model.patched is True
    assert model.describe() == "patched:4"
    assert model.greet() == "external"
    assert model.forward.calls == 1  # @traced kept
    assert mod.PATCH_MEAN == 2.0
    assert not hasattr(mod, "Talker")


def _without_header(code: str) -> str:
    return code.split("# " + "=" * 100 + "\n\n", 2)[-1]


def _absolutize_tree(tree: ast.Module, package: str) -> str:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            node.module = f"{package}.{node.module}" if node.module else package
            node.level = 0
    return ast.dump(tree)


def test_empty_config_reproduces_upstream() -> None:
    loaded = load_config("fake_patch_configs.fake_empty")
    gen = generate(loaded.config, loaded.module_name)
    upstream = find_source("fakeup.modeling_fake").read_text()
    # Same program as upstream (relative imports resolved) ...
    assert _absolutize_tree(ast.parse(gen.code), "fakeup") == _absolutize_tree(ast.parse(upstream), "fakeup")
    # ... and, text-wise, upstream under the same ruff normalisation except the import line.
    expected = normalise(upstream).replace("from ._base import", "from fakeup._base import")
    assert _without_header(gen.code) == expected
    changed = [ln for ln in gen.diff.splitlines()[2:] if ln[:1] in ("+", "-")]
    assert all(ln.startswith("+#") or ln == "+" or "_base import" in ln for ln in changed)


def test_empty_config_on_real_upstream_has_only_header_and_import_changes() -> None:
    cfg = PatchConfig("transformers.models.qwen3.modeling_qwen3", "q.py", "empty")
    gen = generate(cfg)
    changed = [
        ln for ln in gen.diff.splitlines()[2:] if ln[:1] in ("+", "-") and not ln.startswith(("+#", "+ "))
    ]
    assert changed and all(ln == "+" or "import" in ln for ln in changed)


def _fake_config(**kw: str) -> PatchConfig:
    return PatchConfig("fakeup.modeling_fake", "out.py", "test", **kw)


def dense_forward(self, x: float) -> DenseOutput:
    y = self.mlp(x)
    return DenseOutput(last=y, hidden=[x, y])


def dense_moe_forward(self, x: float) -> DenseMoeOutput:
    y = self.mlp(x)
    return DenseMoeOutput(last=y, hidden=[x, y])


def test_name_map_renames_when_fields_match() -> None:
    cfg = _fake_config()
    cfg.name_map({"Dense": "Fake"}, origin_module="fakeup.modeling_dense")
    cfg.override_method("FakeModel", "forward", description="dense forward reused")(dense_forward)
    gen = generate(cfg)
    assert "return FakeOutput(last=y, hidden=[x, y])" in gen.code
    assert "DenseOutput" not in gen.code


def test_name_map_refuses_a_rename_that_changes_the_field_set() -> None:
    cfg = _fake_config()
    cfg.name_map({"Dense": "Fake"}, origin_module="fakeup.modeling_dense")
    cfg.override_method("FakeModel", "forward", description="dense MoE forward reused")(dense_moe_forward)
    with pytest.raises(
        PatchgenError, match=r"name_map refused.*DenseMoeOutput.*FakeMoeOutput.*router_logits"
    ):
        generate(cfg)


def test_name_map_without_origin_module_refuses_renamed_calls() -> None:
    cfg = _fake_config()
    cfg.name_map({"Dense": "Fake"})
    cfg.override_method("FakeModel", "forward", description="dense forward reused")(dense_forward)
    with pytest.raises(PatchgenError, match="origin_module"):
        generate(cfg)


def test_per_patch_empty_name_map_opts_out() -> None:
    cfg = _fake_config()
    cfg.name_map({"Fake": "Nope"}, origin_module="fakeup.modeling_dense")

    def forward(self, x: float) -> float:
        return FakeHelperAlias(x)  # noqa: F821 - resolved by the add_post_import_block below

    cfg.add_post_import_block("FakeHelperAlias = float\n")
    cfg.override_method("FakeModel", "forward", description="not mapped", name_map={})(forward)
    assert "return FakeHelperAlias(x)" in generate(cfg).code


def test_modify_init_without_upstream_init_is_an_error() -> None:
    cfg = _fake_config()

    def init(self) -> None:
        self.x = 1

    cfg.modify_init("Talker", description="no init upstream")(init)
    with pytest.raises(
        PatchgenError, match=r"modify_init Talker\.__init__: .* defines no method '__init__'.*add_method"
    ):
        generate(cfg)


def test_unknown_target_names_close_matches() -> None:
    cfg = _fake_config()

    def fake_helpr(x: float) -> float:
        return x

    cfg.replace_function("fake_helpr", description="typo")(fake_helpr)
    with pytest.raises(PatchgenError, match=r"fake_helpr.*fake_helper"):
        generate(cfg)


def test_conflicting_patches_are_refused_at_declaration() -> None:
    cfg = _fake_config()
    cfg.override_method("FakeModel.forward", description="one")(dense_forward)
    with pytest.raises(PatchConfigError, match="conflicts"):
        cfg.override_method("FakeModel.forward", description="two")(dense_forward)
    with pytest.raises(PatchConfigError, match="description"):
        cfg.replace_function("fake_helper", description="")


def test_drop_import_names_of_unknown_name_is_an_error() -> None:
    cfg = _fake_config()
    cfg.drop_import_names("not_imported")
    with pytest.raises(PatchgenError, match="not_imported"):
        generate(cfg)


def test_undefined_names_in_patches_are_reported() -> None:
    cfg = _fake_config()

    def greet(self) -> str:
        return no_such_name  # noqa: F821 - the point of the test

    cfg.override_method("FakeModel.greet", description="broken")(greet)
    with pytest.raises(PatchgenError, match="undefined names: no_such_name"):
        generate(cfg)


def test_an_added_import_nothing_uses_is_an_error_not_silently_dropped() -> None:
    # Ruff's unused-import fix would delete it while the header still lists it under "Patches applied"; an import
    # added for its side effect would silently not run.
    cfg = _fake_config()
    cfg.add_import("import statistics")
    # One name used: the statement stays (sibling configs share supersets of `from` imports).
    cfg.add_import("from json import dumps, loads")

    def greet(self) -> str:
        return dumps("patched")  # noqa: F821 - the add_import above binds it in the output

    cfg.override_method("FakeModel.greet", description="uses dumps only")(greet)
    with pytest.raises(PatchgenError, match=r"out\.py: add_import \['import statistics'\]") as info:
        generate(cfg)
    assert "json" not in str(info.value)


def test_a_patch_on_an_excluded_definition_is_an_error_not_silently_dropped() -> None:
    cfg = _fake_config()
    cfg.exclude_from_output("Talker")

    def forward(self, x: float) -> float:
        return x

    cfg.override_method("Talker.forward", description="never emitted")(forward)
    with pytest.raises(PatchgenError, match=r"Talker.*exclude_from_output.*override_method Talker\.forward"):
        generate(cfg)
