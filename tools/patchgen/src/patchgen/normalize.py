"""The one normalisation every generated file and every upstream baseline goes through: ruff.

Ruff runs ``--isolated`` with explicit settings so the output depends only on the ruff version (pinned by
the workspace lock), never on whichever ``pyproject.toml`` happens to be above the output directory.
"""

from __future__ import annotations

import difflib
import re
import subprocess

from .source import PatchgenError

LINE_LENGTH = 110
TARGET_VERSION = "py311"
# Only unused-import removal is auto-fixed: patches and exclusions orphan upstream imports, and nothing
# else should rewrite upstream code behind the reader's back.
FIX_RULES = "F401"


def _ruff(args: list[str], code: str) -> subprocess.CompletedProcess[str]:
    # The ruff package's executable (what ``python -m ruff`` execs), called directly: one generation runs ruff
    # six times, and a Python interpreter start per call was most of their cost.
    try:
        from ruff import find_ruff_bin

        cmd = [find_ruff_bin(), *args, "--isolated", "--stdin-filename", "generated.py", "-"]
        return subprocess.run(cmd, input=code, capture_output=True, text=True, check=False)
    except (ImportError, OSError) as exc:  # pragma: no cover - ruff is a declared dependency
        raise PatchgenError(f"cannot run ruff ({' '.join(args)}): {exc}") from exc


def normalise(code: str) -> str:
    """``ruff check --fix`` (unused imports) then ``ruff format``."""
    fixed = _ruff(["check", "--fix-only", "--select", FIX_RULES, "--target-version", TARGET_VERSION], code)
    if fixed.returncode != 0:
        raise PatchgenError(f"ruff check --fix failed:\n{fixed.stderr}")
    formatted = _ruff(
        ["format", "--line-length", str(LINE_LENGTH), "--target-version", TARGET_VERSION], fixed.stdout
    )
    if formatted.returncode != 0:
        raise PatchgenError(f"ruff format failed (is the generated code valid Python?):\n{formatted.stderr}")
    return formatted.stdout


_UNDEFINED = re.compile(r"F821 Undefined name `([^`]+)`")


def undefined_names(code: str) -> dict[str, int]:
    """Names ruff reports as undefined (F821), each with the first line it occurs on."""
    result = _ruff(
        ["check", "--select", "F821", "--ignore-noqa", "--output-format", "concise", "--no-fix"], code
    )
    found: dict[str, int] = {}
    for line in result.stdout.splitlines():
        match = _UNDEFINED.search(line)
        if match:
            lineno = int(line.split(":")[1])
            found.setdefault(match.group(1), lineno)
    return found


def unified_diff(before: str, after: str, before_label: str, after_label: str) -> str:
    """A deterministic unified diff (no timestamps, trailing whitespace stripped)."""
    lines = difflib.unified_diff(
        before.splitlines(keepends=True),
        after.splitlines(keepends=True),
        fromfile=f"a/{before_label}",
        tofile=f"b/{after_label}",
    )
    out = []
    for line in lines:
        stripped = line.rstrip()
        out.append(stripped + "\n")
    return "".join(out)
