"""Hand-written runtime modules stay small: at most 500 lines each (CONTRIBUTING.md, "Files stay small").

Counted: every ``packages/*/src/**/*.py``. Not counted: ``generated/`` (patchgen writes it from upstream source)
and ``patch_config.py`` (a patchgen input that quotes upstream methods). A module that must stay larger for a
while is listed in ``ALLOWED`` with its current ceiling and the reason; the list is meant to shrink.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 500

# path (from the repository root) -> (ceiling in lines, why it may exceed LIMIT for now). Empty on 2026-12-02: no
# runtime module is over the limit. An entry's ceiling is the size when it was added, so the file cannot grow.
ALLOWED: dict[str, tuple[int, str]] = {}


def runtime_modules(root: Path) -> list[Path]:
    """The hand-written Python modules of every package's ``src/`` tree under ``root``."""
    return sorted(
        path
        for path in root.glob("packages/*/src/**/*.py")
        if "generated" not in path.relative_to(root).parts and path.name != "patch_config.py"
    )


def line_count(path: Path) -> int:
    return len(path.read_text().splitlines())


def oversized(root: Path, allowed: dict[str, tuple[int, str]]) -> list[str]:
    """One message per module over its limit (``LIMIT``, or its ``allowed`` ceiling), naming the file, its size
    and the limit."""
    problems = []
    for path in runtime_modules(root):
        rel = path.relative_to(root).as_posix()
        limit = allowed[rel][0] if rel in allowed else LIMIT
        size = line_count(path)
        if size > limit:
            where = "its allow-list ceiling" if rel in allowed else "the limit for hand-written modules"
            problems.append(f"{rel}: {size} lines, over {where} of {limit}; split it by responsibility")
    return problems


def stale_allowances(root: Path, allowed: dict[str, tuple[int, str]]) -> list[str]:
    """Allow-list entries that no longer earn their place: the file is gone or back under ``LIMIT``."""
    stale = []
    for rel in sorted(allowed):
        path = root / rel
        if not path.exists():
            stale.append(f"{rel}: allow-listed but does not exist; remove the entry")
        elif line_count(path) <= LIMIT:
            stale.append(f"{rel}: {line_count(path)} lines, within {LIMIT}; remove its allow-list entry")
    return stale


def test_runtime_modules_are_found():
    modules = runtime_modules(ROOT)
    names = {path.relative_to(ROOT).as_posix() for path in modules}
    assert "packages/veomni-train/src/veomni/train/loop.py" in names, "the scan missed the package sources"
    assert not any("/generated/" in name or name.endswith("/patch_config.py") for name in names)


def test_hand_written_runtime_modules_stay_under_the_limit():
    problems = oversized(ROOT, ALLOWED)
    assert problems == [], "\n".join(problems)


def test_allow_list_entries_are_still_needed():
    for rel, (ceiling, reason) in ALLOWED.items():
        assert ceiling > LIMIT and reason.strip(), (
            f"{rel}: an entry needs a ceiling over {LIMIT} and a reason"
        )
    assert stale_allowances(ROOT, ALLOWED) == []


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    src = tmp_path / "packages" / "veomni-x" / "src" / "veomni" / "x"
    (src / "generated").mkdir(parents=True)
    (src / "small.py").write_text("x = 1\n" * LIMIT)
    (src / "big.py").write_text("x = 1\n" * (LIMIT + 1))
    (src / "generated" / "huge.py").write_text("x = 1\n" * 3 * LIMIT)
    (src / "patch_config.py").write_text("x = 1\n" * 3 * LIMIT)
    return tmp_path


def test_checker_names_the_file_its_size_and_the_limit(tree: Path):
    assert oversized(tree, {}) == [
        "packages/veomni-x/src/veomni/x/big.py: 501 lines, over the limit for hand-written modules of 500; "
        "split it by responsibility"
    ]


def test_allow_list_caps_a_file_at_its_ceiling_and_goes_stale_when_it_shrinks(tree: Path):
    big = "packages/veomni-x/src/veomni/x/big.py"
    assert oversized(tree, {big: (501, "being split")}) == []
    assert oversized(tree, {big: (501, "being split")}) == oversized(tree, {big: (600, "being split")})
    (tree / big).write_text("x = 1\n" * 502)
    assert oversized(tree, {big: (501, "being split")}) == [
        f"{big}: 502 lines, over its allow-list ceiling of 501; split it by responsibility"
    ]
    (tree / big).write_text("x = 1\n")
    assert stale_allowances(tree, {big: (501, "being split")}) == [
        f"{big}: 1 lines, within 500; remove its allow-list entry"
    ]
