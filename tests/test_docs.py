"""Claims of the user docs that can rot silently: the kernel table of docs/kernels.md lists what the registry
holds, and every recipe name the docs cite is a shipped recipe."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from veomni.kernels import KERNELS
from veomni.train.recipe import builtin_recipes

ROOT = Path(__file__).resolve().parents[1]
USER_DOCS = ["README.md", "docs/train.md", "docs/models.md", "docs/core.md", "docs/kernels.md"]


def documented_backends(cell: str) -> set[str]:
    """The backend names of one cell of the op table: parenthesised notes dropped, ``flash_attn_2/3/4`` expanded,
    and what follows a ``;`` (notes on other variants) ignored."""
    while re.search(r"\([^()]*\)", cell):
        cell = re.sub(r"\([^()]*\)", "", cell)
    names: set[str] = set()
    for item in cell.split(";")[0].split(","):
        name = item.strip().strip("`")
        match = re.fullmatch(r"(\w+_)(\d(?:/\d)+)", name)
        names |= {match.group(1) + d for d in match.group(2).split("/")} if match else {name}
    return names


def test_kernels_md_op_table_lists_exactly_the_registered_backends():
    text = (ROOT / "docs/kernels.md").read_text()
    table = text[text.index("| op | variants | backends |") :].split("\n\n")[0]
    rows = re.findall(r"^\| `(\w+)` \| .*? \| ([^|]*) \|$", table, flags=re.MULTILINE)
    ops = [op for op, _ in rows]
    # One row per op: a second, stale row is how the table drifted before.
    assert sorted(ops) == sorted(KERNELS.ops()), ops
    for op, cell in rows:
        assert documented_backends(cell) == set(KERNELS.backends(op)), op


RECIPE_NAME = re.compile(r"`([a-z][a-z0-9_.]*_\d+(?:\.\d+)?b(?:_[a-z0-9]+)*)`")
RECIPE_COMMAND = re.compile(
    r"(?:veomni-train|veomni\.train\.cli|veomni-data-preview|veomni-dit-embed) ([a-z][\w.-]*)"
)


@pytest.mark.parametrize("doc", USER_DOCS)
def test_recipe_names_in_the_docs_are_shipped(doc):
    """`qwen3_8b`-style names and the recipe of every ``veomni-train NAME`` command resolve to a built-in recipe
    (``-`` standing for ``_``, as `load_recipe` accepts)."""
    text = (ROOT / doc).read_text()
    cited = set(RECIPE_NAME.findall(text)) | set(RECIPE_COMMAND.findall(text))
    shipped = set(builtin_recipes())
    assert {name for name in cited if name.replace("-", "_") not in shipped} == set()
