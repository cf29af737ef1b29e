"""The trainer never names a model family, and a text run imports no multimodal or DiT code.

Family names are every family folder's name and every model type the families declare
(`veomni.models.families.FAMILIES`). They must not appear in `veomni.train` nor in the shared modules of
`veomni.models` (outside the family folders) as an import, an identifier or a string literal; docstrings and
comments may cite a model as an example. A text run importing `veomni.train.loop` and building a text task must
not import a VLM, omni or DiT module (the family folders are imported only for the model being trained).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

from veomni.models.families import FAMILIES

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "packages" / "veomni-train" / "src" / "veomni" / "train"
MODELS = ROOT / "packages" / "veomni-models" / "src" / "veomni" / "models"
FAMILY_FOLDERS = {family.name for family in FAMILIES}
# Shared model-layer modules that are allowed to know families: the list itself.
MODELS_ALLOWED = {MODELS / "families.py"}


def family_names() -> set[str]:
    """Every family folder's name and every model type the families declare, as written (``qwen2_vl``)."""
    names = {family.name for family in FAMILIES}
    return names | {spec.model_type for family in FAMILIES for spec in family.model_types}


def _tokens(name: str) -> list[str]:
    """Lower-case words of a name, split at ``_ . :`` and at case and digit boundaries: ``Qwen2VLEncoder`` ->
    ``qwen 2 vl encoder``, like ``qwen2_vl`` -> ``qwen 2 vl`` (``wanted`` is one word, not ``wan``)."""
    return [
        word.lower()
        for part in re.split(r"[_.:,]", name)
        for word in re.findall(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+", part)
    ]


def _docstring_nodes(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
        # A bare string statement anywhere (attribute docstrings) is documentation too.
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            found.add(id(node.value))
    return found


def mentions(source: str, names: set[str], filename: str = "<src>") -> list[str]:
    """``line: what`` for every import, identifier or non-docstring string constant naming a family.

    Identifiers and import paths match where a name's words appear in a row among theirs (`_tokens`:
    ``Qwen2VLPositions`` names ``qwen2_vl``, ``wanted`` does not name ``wan``). A string constant matches where one of its words is a name or a
    ``veomni.models.*`` / ``transformers.models.*`` path through a family's folder; a message citing a model by its
    human name ("Qwen2.5-VL") is documentation, like a docstring: strings with whitespace are not read."""
    tree = ast.parse(source, filename=filename)
    docs = _docstring_nodes(tree)
    sequences = {tuple(_tokens(name)) for name in names}
    lowered = {name.lower() for name in names}

    def identifier(text: str) -> bool:
        tokens = _tokens(text)
        return any(
            tuple(tokens[i : i + len(seq)]) == seq for seq in sequences for i in range(len(tokens) - len(seq) + 1)
        )

    def literal(text: str) -> bool:
        if any(c.isspace() for c in text):
            return False  # a sentence (a message, a help text) cites models as documentation does
        for word in re.findall(r"[A-Za-z0-9_.:]+", text):
            word = word.lower().strip(".:")
            if word in lowered:
                return True
            if word.startswith(("veomni.models.", "transformers.models.")) and any(
                segment in lowered for segment in re.split(r"[.:]", word)
            ):
                return True
        return False

    found = []
    for node in ast.walk(tree):
        what, hit = None, False
        if isinstance(node, ast.Import):
            what = ",".join(alias.name for alias in node.names)
            hit = any(identifier(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            what = (node.module or "") + ":" + ",".join(alias.name for alias in node.names)
            hit = identifier(what)
        elif isinstance(node, (ast.Name, ast.Attribute, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.arg)):
            what = getattr(node, "id", None) or getattr(node, "attr", None) or getattr(node, "name", None) or node.arg
            hit = identifier(what)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            what = node.value
            hit = literal(what)
        if hit:
            found.append(f"{getattr(node, 'lineno', '?')}: {what[:80]!r}")
    return found


def shared_model_modules() -> list[Path]:
    return sorted(
        path
        for path in MODELS.rglob("*.py")
        if path.relative_to(MODELS).parts[0] not in FAMILY_FOLDERS and path not in MODELS_ALLOWED
    )


def test_the_trainer_names_no_family():
    names = family_names()
    problems = [
        f"{path.relative_to(ROOT)}:{hit}"
        for path in sorted(TRAIN.rglob("*.py"))
        for hit in mentions(path.read_text(), names, str(path))
    ]
    assert not problems, "veomni.train names model families (ask the family spec instead):\n" + "\n".join(problems)


def test_shared_model_modules_name_no_family():
    names = family_names()
    problems = [
        f"{path.relative_to(ROOT)}:{hit}"
        for path in shared_model_modules()
        for hit in mentions(path.read_text(), names, str(path))
    ]
    assert not problems, "shared veomni.models modules name families:\n" + "\n".join(problems)


def test_the_checker_sees_imports_identifiers_and_strings_but_not_docstrings():
    names = {"qwen2_vl", "llama"}
    source = '''"""Qwen2-VL and llama in a docstring are fine."""
from veomni.models.qwen2_vl.positions import Qwen2VLPositions
def f(llama_config):
    """llama here too."""
    return {"model_type": "qwen2_vl"}
x = "veomni.models.qwen2_vl.video:Rule"
y = "qwen22"
wanted = 1
z = "see qwen2_vl's rule"
'''
    hits = mentions(source, names)
    assert sorted(int(h.split(":")[0]) for h in hits) == [2, 3, 5, 6], hits


def test_a_text_run_imports_no_multimodal_or_dit_code():
    script = """
import json, sys
import veomni.train.loop, veomni.train.step, veomni.train.cli
from veomni.train.tasks import task_class
task_class("text")
from veomni.models.registry import MODELS
families = set(json.loads(sys.argv[1]))
loaded = sorted(m for m in sys.modules if m.startswith("veomni.models.") and m.split(".")[2] in families
                and not m.endswith(".family") and m.count(".") > 2 or m.startswith("veomni.train.tasks.") and
                m.split(".")[3] in ("vision", "dit", "dit_setup") or m.startswith("diffusers"))
print("\\n".join(loaded))
"""
    folders = json.dumps(sorted(FAMILY_FOLDERS))
    out = subprocess.run([sys.executable, "-c", script, folders], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "", f"a text run imported:\n{out}"
