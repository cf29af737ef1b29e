"""Tests hold on any box: none of them runs a subprocess under a wall-time limit.

A `subprocess.run(..., timeout=900)` turned a loaded 2-core box into a red CI (the VLM quickstart hit its own
limit) without anything being wrong. Time budgets belong in `tools/bench/`, never in the suite; a hang is caught
by CI's own limit. Checked by reading every call in tests/.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SUBPROCESS_CALLS = {"run", "call", "check_call", "check_output"}


def timed_subprocess_calls(path: Path, root: Path = TESTS.parent) -> list[str]:
    """`file:line` (relative to root) of each `subprocess.<call>(..., timeout=...)` in one source file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value
        if not (
            isinstance(owner, ast.Name) and owner.id == "subprocess" and node.func.attr in SUBPROCESS_CALLS
        ):
            continue
        if any(keyword.arg == "timeout" for keyword in node.keywords):
            found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_no_test_runs_a_subprocess_under_a_wall_time_limit():
    offenders = [hit for path in sorted(TESTS.rglob("*.py")) for hit in timed_subprocess_calls(path)]
    assert not offenders, f"subprocess calls with a timeout (a slow box fails them): {offenders}"


def test_the_check_finds_a_timed_call(tmp_path):
    sample = tmp_path / "timed.py"
    sample.write_text("import subprocess\nsubprocess.run(['true'], timeout=5)\nsubprocess.run(['true'])\n")
    assert timed_subprocess_calls(sample, tmp_path) == ["timed.py:2"]
