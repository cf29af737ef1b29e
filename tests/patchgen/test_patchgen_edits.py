"""Explicit method injection and the statement/expression edits, through the real libcst machinery.

Every edit is applied to the fake upstream module (``fakeup.modeling_fake``), generated, normalised by ruff and
executed: the tests check what the patched code computes, not only its text.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import libcst as cst
import pytest
from fakeup.modeling_fake import FakeConfig
from helpers_patchgen import import_file
from hypothesis import given, settings
from hypothesis import strategies as st
from patchgen.codegen import Generated, generate
from patchgen.config import PatchConfig, PatchConfigError
from patchgen.edits import apply_edits
from patchgen.source import PatchgenError

_counter = itertools.count()


def _config() -> PatchConfig:
    return PatchConfig(source_module="fakeup.modeling_fake", target_file="out.py", description="edits test")


def _run(gen: Generated, tmp_path: Path):
    path = tmp_path / f"edited_{next(_counter)}.py"
    path.write_text(gen.code)
    return import_file(path, path.stem)


def _forward_source(gen: Generated) -> str:
    tree = ast.parse(gen.code)
    model = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "FakeModel")
    return ast.unparse(next(n for n in model.body if isinstance(n, ast.FunctionDef) and n.name == "forward"))


# ------------------------------------------------------------------------------------------ explicit injection


def test_override_of_a_method_upstream_lacks_names_the_class_its_methods_and_a_close_match() -> None:
    cfg = _config()

    def froward(self, x: float) -> float:
        return x

    cfg.override_method("FakeModel.froward", description="typo of forward")(froward)
    with pytest.raises(PatchgenError) as info:
        generate(cfg)
    message = str(info.value)
    assert "override_method FakeModel.froward" in message
    assert "['__init__', 'forward', 'greet']" in message
    assert "Did you mean 'forward'?" in message
    assert "add_method" in message


def test_add_method_appends_a_new_method_that_runs(tmp_path: Path) -> None:
    cfg = _config()

    def describe(self) -> str:
        return f"hidden={self.config.hidden}"

    cfg.add_method("FakeModel.describe", description="a method upstream lacks")(describe)
    gen = generate(cfg)
    assert "# [PATCHED] a method upstream lacks (injected: not in upstream)" in gen.code
    assert "#   - add_method FakeModel.describe: a method upstream lacks" in gen.code
    module = _run(gen, tmp_path)
    assert module.FakeModel(FakeConfig(hidden=7)).describe() == "hidden=7"


def test_add_method_of_a_name_upstream_defines_is_an_error() -> None:
    cfg = _config()

    def greet(self) -> str:
        return "shadowed"

    cfg.add_method("FakeModel.greet", description="would shadow upstream silently")(greet)
    with pytest.raises(
        PatchgenError, match=r"add_method FakeModel\.greet: .* already defines 'greet'.*override_method"
    ):
        generate(cfg)


# ------------------------------------------------------------------------------------------ expression edits


def test_replace_call_splices_the_arguments_and_runs(tmp_path: Path) -> None:
    cfg = _config()
    cfg.replace_call(
        "FakeModel.forward", "fake_helper", "float(fake_helper(__args__) * 100)", description="scaled helper"
    )
    gen = generate(cfg)
    assert "# [PATCHED] scaled helper" in gen.code
    assert "#   - replace_call FakeModel.forward: scaled helper" in gen.code
    module = _run(gen, tmp_path)
    # Upstream: mlp scales by hidden (4), then fake_helper adds 1: (2 * 4 + 1) * 100.
    assert module.FakeModel(FakeConfig(hidden=4)).forward(2.0).last == 900.0
    # Everything else in the method is upstream's text, decorator included.
    assert "@traced" in gen.code.split("def forward(self, x: float) -> FakeOutput:")[0].rsplit("\n\n", 1)[-1]


def test_replace_call_with_the_wrong_count_fails_naming_what_it_found() -> None:
    cfg = _config()
    cfg.replace_call(
        "FakeModel.forward", "fake_helper", "fake_helper(__args__)", count=2, description="twice"
    )
    with pytest.raises(
        PatchgenError, match=r"expected 2 calls of 'fake_helper', found 1: \['fake_helper\(y\)'\]"
    ):
        generate(cfg)


def test_replace_call_of_an_absent_callee_fails_loudly() -> None:
    cfg = _config()
    cfg.replace_call("FakeModel.forward", "apply_rotary", "x", description="gone upstream")
    with pytest.raises(
        PatchgenError, match=r"expected 1 calls of 'apply_rotary', found 0.*Has upstream changed"
    ):
        generate(cfg)


def test_replace_expression_matches_syntax_not_layout(tmp_path: Path) -> None:
    cfg = _config()
    # Upstream writes `x * self.weight`; the anchor's extra parentheses and spaces do not matter.
    cfg.replace_expression("FakeMLP.forward", "(x  *  self.weight)", "__match__ + 1.0", description="shifted")
    module = _run(generate(cfg), tmp_path)
    assert module.FakeMLP(3).forward(2.0) == 7.0


def test_replace_expression_found_twice_when_once_was_expected() -> None:
    cfg = _config()
    cfg.replace_expression("FakeModel.forward", "x", "x", description="x is used twice")
    with pytest.raises(PatchgenError, match=r"expected 1 expressions equal to 'x', found 2"):
        generate(cfg)


# ------------------------------------------------------------------------------------------ statement edits


def test_insert_before_and_after_a_statement(tmp_path: Path) -> None:
    cfg = _config()
    cfg.insert_before("FakeModel.forward", "y = self.mlp(x)", "x = x + 1.0", description="shift the input")
    cfg.insert_after("FakeModel.forward", "y = self.mlp(x)", "y = -y", description="negate")
    gen = generate(cfg)
    module = _run(gen, tmp_path)
    out = module.FakeModel(FakeConfig(hidden=2)).forward(1.0)
    assert out.hidden == [2.0, -4.0] and out.last == -3.0
    body = _forward_source(gen)
    assert body.index("x = x + 1.0") < body.index("y = self.mlp(x)") < body.index("y = -y")


def test_replace_statement_and_delete(tmp_path: Path) -> None:
    cfg = _config()
    cfg.replace_statement(
        "FakeModel.forward",
        "return FakeOutput(last=fake_helper(y), hidden=[x, y])",
        "return FakeOutput(last=y, hidden=None)",
        description="no helper, no hidden",
    )
    cfg.replace_statement("FakeModel.__init__", "self.config = config", "", description="dropped")
    module = _run(generate(cfg), tmp_path)
    model = module.FakeModel(FakeConfig(hidden=3))
    assert not hasattr(model, "config")
    assert model.forward(2.0) == module.FakeOutput(last=6.0, hidden=None)


def test_wrap_statement_puts_it_in_the_template(tmp_path: Path) -> None:
    cfg = _config()
    cfg.wrap_statement(
        "FakeModel.forward",
        "y = self.mlp(x)",
        "try:\n    __body__\nexcept ZeroDivisionError:\n    y = 0.0",
        description="guarded",
    )
    gen = generate(cfg)
    assert "# [PATCHED] guarded" in gen.code
    assert "try:\n            y = self.mlp(x)\n        except ZeroDivisionError:" in gen.code
    module = _run(gen, tmp_path)
    assert module.FakeModel(FakeConfig(hidden=2)).forward(1.5).hidden == [1.5, 3.0]


def test_a_compound_header_anchor_edits_the_whole_block() -> None:
    source = "def f(x, cache):\n    if cache is not None:\n        x = cache.update(x)\n    return x\n"
    func = cst.parse_module(source).body[0]
    assert isinstance(func, cst.FunctionDef)
    cfg = _config()
    cfg.insert_after("f", "if cache is not None:", "x = x * 2", description="after the block")
    edited = apply_edits(func, cfg.edits)
    code = cst.Module(body=[edited]).code
    assert code.index("x = cache.update(x)") < code.index("x = x * 2") < code.index("return x")


def test_statement_anchor_not_found_suggests_the_closest_statements() -> None:
    cfg = _config()
    cfg.insert_before("FakeModel.forward", "y = self.mlp(z)", "pass", description="stale anchor")
    with pytest.raises(PatchgenError, match=r"found 0 \(closest statements: \['y = self\.mlp\(x\)'"):
        generate(cfg)


def test_an_edit_of_a_method_upstream_lacks_names_the_methods() -> None:
    cfg = _config()
    cfg.insert_before("FakeModel.fwd", "y = self.mlp(x)", "pass", description="wrong method")
    with pytest.raises(PatchgenError, match=r"insert_before FakeModel\.fwd: .* defines no method 'fwd'"):
        generate(cfg)


def test_edits_conflict_with_whole_replacements_of_their_target() -> None:
    cfg = _config()
    cfg.replace_call("FakeModel.forward", "fake_helper", "fake_helper(__args__)", description="edit")

    def forward(self, x: float) -> float:
        return x

    with pytest.raises(PatchConfigError, match="conflicts with earlier replace_call"):
        cfg.override_method("FakeModel.forward", description="whole")(forward)
    with pytest.raises(PatchConfigError, match="count"):
        cfg.replace_call("FakeModel.greet", "str", "str(__args__)", count=0, description="bad count")
    with pytest.raises(PatchConfigError, match="__body__"):
        cfg.wrap_statement("FakeModel.greet", "return 'upstream'", "with x:\n    pass", description="no body")


# ------------------------------------------------------------------------------------------ property


@settings(max_examples=40, deadline=None)
@given(present=st.integers(0, 4), expected=st.integers(1, 4))
def test_a_count_mismatch_always_fails_and_a_match_always_applies(present: int, expected: int) -> None:
    # `present` calls of g in a function; the edit expects `expected` of them.
    lines = "".join(f"    a{i} = g({i})\n" for i in range(present))
    func = cst.parse_module(f"def f():\n{lines}    return 0\n").body[0]
    assert isinstance(func, cst.FunctionDef)
    cfg = _config()
    cfg.replace_call("f", "g", "h(__args__, 1)", count=expected, description="g to h")
    if present != expected:
        with pytest.raises(PatchgenError, match=f"expected {expected} calls of 'g', found {present}"):
            apply_edits(func, cfg.edits)
        return
    code = cst.Module(body=[apply_edits(func, cfg.edits)]).code
    assert "g(" not in code
    assert [f"a{i} = h({i}, 1)" in code for i in range(present)] == [True] * present
    assert code.count("# [PATCHED] g to h") == present


def test_add_import_skips_names_an_earlier_import_already_binds() -> None:
    # A shared helper (rope_via_kernels) declares the import its edit needs; a config that already imports
    # that name on a broader line must not get a second, redundant import statement.
    cfg = _config()
    cfg.add_import("from json import dumps, loads")
    cfg.add_import("from json import dumps")
    cfg.add_import("from json import dumps as d")
    cfg.add_import("import json")
    cfg.add_import("import json")
    assert cfg.imports == ["from json import dumps, loads", "from json import dumps as d", "import json"]
