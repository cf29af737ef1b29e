"""The AST call/signature checker, alone and as part of generation."""

from __future__ import annotations

import pytest
from patchgen.codegen import generate
from patchgen.config import PatchConfig
from patchgen.signatures import check_source
from patchgen.source import PatchgenError

SOURCE = """
from dataclasses import dataclass, field


def f(a, b, c=1, *, d, e=2):
    return a


@dataclass
class Out:
    x: int
    y: int = 0
    z: list = field(default_factory=list)


class Layer:
    def __init__(self, hidden, eps=1e-6):
        self.hidden = hidden


class Sub(Layer):
    pass


def caller(f_like, **kw):
    f(1, 2, d=3)                # ok
    f(1, 2, 3, 4, d=5)          # line 26: too many positionals
    f(1, 2, d=3, bogus=4)       # line 27: unknown keyword
    f(1, d=3)                   # line 28: missing b
    f(1, 2, **kw)               # ok: ** may carry d
    Out(x=1, y=2, w=3)          # line 30: unknown field
    Out(y=2)                    # line 31: missing x
    Layer(4, eps=1e-5)          # ok
    Sub(4, 5, 6)                # line 33: inherited __init__
    Sub(hidden=4)               # ok


def shadowing(f):
    return f(1)                 # ok: local f shadows the top-level one
"""


def test_checker_flags_bad_calls_with_file_and_line() -> None:
    violations = check_source(SOURCE.lstrip("\n"), "mod.py")
    found = {(v.line, v.message.split("(")[0]) for v in violations}
    assert [str(v).split(":")[:2] for v in violations] == [["mod.py", str(v.line)] for v in violations]
    lines = sorted(v.line for v in violations)
    assert lines == [26, 27, 28, 30, 31, 33], violations
    assert any("unexpected keyword argument 'bogus'" in v.message for v in violations)
    assert any("missing required argument(s): b" in v.message for v in violations)
    assert any("unexpected keyword argument 'w'" in v.message for v in violations)
    assert found


def test_generation_refuses_a_patch_with_a_bad_call() -> None:
    cfg = PatchConfig("fakeup.modeling_fake", "out.py", "test")

    def model_init(self, config) -> None:
        self.config = config
        self.mlp = FakeMLP(config.hidden, 2)  # noqa: F821 - FakeMLP lives in the generated module

    cfg.modify_init("FakeModel", description="passes one argument too many")(model_init)
    with pytest.raises(PatchgenError, match=r"out.py:\d+: FakeMLP\(\) takes at most 1 positional"):
        generate(cfg)
