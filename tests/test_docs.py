"""Claims of the user docs that can rot silently: the kernel table of docs/kernels.md lists what the registry
holds, every recipe name the docs cite is a shipped recipe, and the launch commands in a recipe's comments fit
its parallel layout."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

from veomni.core import ParallelDims
from veomni.kernels import KERNELS
from veomni.train.recipe import RECIPES_DIR, builtin_recipes, load_recipe

ROOT = Path(__file__).resolve().parents[1]
USER_DOCS = [
    "README.md",
    "docs/train.md",
    "docs/launch.md",
    "docs/models.md",
    "docs/core.md",
    "docs/kernels.md",
    "docs/architecture.md",
    "docs/benchmarks.md",
    "docs/guides/add-a-model-family.md",
    "docs/guides/add-a-kernel-backend.md",
    "docs/guides/add-a-data-format-or-task.md",
    "CONTRIBUTING.md",
]


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


# Pages whose links and repository paths must resolve: the user docs, the contributor docs and the changelogs.
# The dated notebook (notebook/) is a record of its day and is not held to today's tree.
def linked_pages() -> list[Path]:
    pages = [
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
        ROOT / "tools/README.md",
        ROOT / "tools/bench/README.md",
    ]
    pages += sorted((ROOT / "docs").rglob("*.md"))
    pages += sorted(ROOT.glob("packages/*/CHANGELOG.md")) + sorted(ROOT.glob("tools/*/CHANGELOG.md"))
    return [page for page in pages if page.exists()]


MD_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*$", flags=re.MULTILINE)
FENCE = re.compile(r"^```.*?^```", flags=re.MULTILINE | re.DOTALL)
# A path into the repository written in prose or code spans (`docs/train.md`, tests/train/test_loop.py). A path
# containing `*`, `{` or `<` is a pattern, not a file, and is not matched at all (no shorter prefix of it either); a
# full stop after a path ends the sentence.
REPO_PATH = re.compile(
    r"(?<![\w./-])((?:docs|notebook|tools|tests|packages|examples)/[\w./-]*[\w/])(?![*{<\w/-]|\.[\w*{<])"
)


def heading_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, every character but letters, digits, ``_``, ``-``
    and spaces dropped (backticks, ``—``, ``×``, ``:``, ``.``), spaces turned into ``-``."""
    kept = "".join(ch for ch in heading.strip().lower() if ch.isalnum() or ch in " _-")
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of ``page``; a repeated heading gets GitHub's ``-1``, ``-2`` suffixes."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        anchor = heading_anchor(heading)
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def broken_links(page: Path) -> list[str]:
    """Relative Markdown links of ``page`` whose file, or whose ``#anchor`` in a Markdown file, does not exist."""
    problems = []
    for target in MD_LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ... are not checked offline
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.exists():
            problems.append(
                f"{target}: no file {resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved}"
            )
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{target}: no heading with anchor #{anchor} in {resolved.relative_to(ROOT)}")
    return problems


@pytest.mark.parametrize("page", linked_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_markdown_links_resolve(page):
    """Every relative link of the docs points at a file of the tree, and at a heading of it where it names one."""
    assert broken_links(page) == [], f"{page.relative_to(ROOT)} has broken links"


@pytest.mark.parametrize("page", linked_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_repository_paths_named_in_the_docs_exist(page):
    """A path the docs name in prose (``docs/train.md``, ``tests/train/test_loop.py``) is a file or folder of
    the tree: moving one (as the notebook moved out of docs/) must update what cites it."""
    text = page.read_text()
    missing = sorted({path for path in REPO_PATH.findall(text) if not (ROOT / path).exists()})
    assert missing == [], f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_link_checker_reports_missing_files_and_anchors(tmp_path, monkeypatch):
    """The checker above fails where it should: a missing file and a missing heading are reported, a good link
    and a repeated heading's suffixed anchor are not."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "other.md").write_text("# Title — `x` × 2\n\n## Notes\n\n## Notes\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#title--x--2) [dup](other.md#notes-1) [web](https://example.com/x)\n"
        "[gone](missing.md) [bad anchor](other.md#nope)\n```\n[in a fence](ignored.md)\n```\n"
    )
    assert broken_links(page) == [
        "missing.md: no file missing.md",
        "other.md#nope: no heading with anchor #nope in other.md",
    ]


def test_benchmarks_page_is_the_current_table_not_a_logbook():
    """docs/benchmarks.md holds one row per benchmark; dated entries belong in notebook/benchmarks-log.md."""
    text = (ROOT / "docs/benchmarks.md").read_text()
    dated = re.findall(r"^#+ +\d{4}-\d{2}-\d{2}.*$", text, flags=re.MULTILINE)
    assert dated == [], (
        f"dated entries in docs/benchmarks.md (move them to notebook/benchmarks-log.md): {dated}"
    )
    assert len(text.splitlines()) <= 120, (
        "docs/benchmarks.md grew past 120 lines: keep it the table of latest figures"
    )


def test_repository_path_pattern_skips_globs_and_placeholders():
    """A named path is matched whole (a sentence's full stop excluded); a glob or a ``<placeholder>`` path is not
    matched at all, not even a prefix of it, so the path check neither misses real paths nor flags patterns."""
    text = (
        "see docs/train.md. Then tests/train/test_loop.py), `notebook/runs/2026-11-25-e2e-t1-*.json`, "
        "`packages/veomni-models/src/veomni/models/*/generated/` and notebook/runs/<date>-x.json"
    )
    assert REPO_PATH.findall(text) == ["docs/train.md", "tests/train/test_loop.py"]


# The contributor docs name real modules and functions; a module moved or renamed must take its citations along.
CONTRIBUTOR_DOCS = [
    "CONTRIBUTING.md",
    "docs/architecture.md",
    *sorted(p.name for p in (ROOT / "docs/guides").glob("*.md")),
]
DOTTED_NAME = re.compile(r"`((?:veomni|patchgen)(?:\.[A-Za-z_]\w*)+)`")
NOT_PYTHON_NAMES = {
    "veomni.tasks"
}  # the entry-point group of users' tasks (veomni.train.tasks.ENTRY_POINT_GROUP)


def unresolved_names(text: str) -> list[str]:
    """The backticked ``veomni.*`` / ``patchgen.*`` dotted names in ``text`` that are neither a module nor an
    attribute path from one (``veomni.train.loop.build_run``, ``veomni.kernels.OpsConfig``)."""
    missing = []
    for dotted in sorted(set(DOTTED_NAME.findall(text)) - NOT_PYTHON_NAMES):
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                found: object = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for attribute in parts[cut:]:
                found = getattr(found, attribute, _MISSING)
            if found is _MISSING:
                missing.append(dotted)
            break
        else:
            missing.append(dotted)
    return missing


_MISSING = object()


@pytest.mark.parametrize("doc", CONTRIBUTOR_DOCS)
def test_names_the_contributor_docs_cite_exist(doc):
    path = ROOT / doc if (ROOT / doc).exists() else ROOT / "docs/guides" / doc
    assert unresolved_names(path.read_text()) == [], f"{doc} cites names that do not exist"


def test_name_checker_reports_missing_modules_and_attributes():
    text = (
        "`veomni.kernels.OpsConfig`, `veomni.kernels.NoSuchThing`, `veomni.no_such_module.f`, `veomni.tasks`"
    )
    assert unresolved_names(text) == ["veomni.kernels.NoSuchThing", "veomni.no_such_module.f"]
