"""Claims of the user docs that can rot silently: the kernel table of docs/kernels.md lists what the registry
holds, every recipe name the docs cite is a shipped recipe, and the launch commands in a recipe's comments fit
its parallel layout."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from veomni.core import ParallelDims
from veomni.kernels import KERNELS
from veomni.train.recipe import RECIPES_DIR, builtin_recipes, load_recipe

ROOT = Path(__file__).resolve().parents[1]
USER_DOCS = ["README.md", "docs/train.md", "docs/launch.md", "docs/models.md", "docs/core.md", "docs/kernels.md"]


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


COMMAND = re.compile(
    r"^#[ \t]+(?:\((?:[^:\n]*: )?)?(uv run veomni-train|torchrun (?:--nnodes (\d+) )?--nproc-per-node (\d+)[^\n]*?"
    r"-m veomni\.train\.cli) ([\w.-]+)([^\n]*)$",
    flags=re.MULTILINE,
)


def recipe_commands(name: str) -> list[tuple[int, list[str]]]:
    """``(world size, overrides)`` of every ``uv run veomni-train`` (one process) or ``torchrun`` command line in
    the comments of the shipped recipe ``name`` that runs that recipe."""
    text = (RECIPES_DIR / f"{name}.yaml").read_text()
    found = []
    for launcher, nnodes, nproc, recipe, rest in COMMAND.findall(text):
        if recipe.replace("-", "_") != name:
            continue
        world = 1 if launcher.startswith("uv run") else int(nnodes or 1) * int(nproc)
        found.append((world, re.findall(r"--[a-z_]+\.[a-z_.]+=\S+", rest)))
    return found


@pytest.mark.parametrize("name", builtin_recipes())
def test_every_command_a_recipe_suggests_fits_its_parallel_layout(name):
    """A recipe's own command lines (one process, or torchrun's nodes x processes) give a valid mesh (ep divides
    dp_shard x sp) and a whole number of micro-batches per step: a suggested launch never fails at start-up."""
    for world, overrides in recipe_commands(name):
        recipe = load_recipe(name, overrides)
        p = recipe.parallel
        dims = (
            ParallelDims(dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, sp=p.sp, ep=p.ep)
            if p.dp_shard is not None
            else ParallelDims.for_world(world, dp_replicate=p.dp_replicate, sp=p.sp, ep=p.ep)
        )
        assert dims.dp_replicate * dims.dp_shard * dims.sp == world, (world, overrides)
        assert recipe.grad_accum(dims.dp_replicate * dims.dp_shard) >= 1
