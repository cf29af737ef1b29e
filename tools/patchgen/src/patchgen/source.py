"""Turn replacement objects (functions, classes, code strings) into libcst nodes ready to splice.

Source comes from ``inspect.getsource`` (plus the comment block right above the definition, which is
where patch authors explain their change) and is parsed by libcst, so decorators are real nodes: the
patchgen registration decorators are removed by matching those nodes, every other decorator survives.
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import libcst as cst

from .config import PATCH_DECORATOR_NAMES


class PatchgenError(RuntimeError):
    """Generation cannot proceed; the message says what was expected and what was found."""


Definition = cst.FunctionDef | cst.ClassDef


@dataclass(frozen=True)
class RenamedCall:
    """A call whose callee name a name_map changed: codegen proves old and new accept the same arguments."""

    old: str
    new: str
    line: int
    where: str


def object_source(obj: Any) -> str:
    """The dedented source of ``obj`` including the comment block directly above it."""
    try:
        src = inspect.getsource(obj)
    except (OSError, TypeError) as exc:
        raise PatchgenError(f"cannot read the source of {obj!r}: {exc}") from exc
    comments = inspect.getcomments(obj) or ""
    return textwrap.dedent(comments) + textwrap.dedent(src)


def _is_patch_decorator(dec: cst.Decorator) -> bool:
    expr = dec.decorator
    if isinstance(expr, cst.Call):
        expr = expr.func
    return isinstance(expr, cst.Attribute) and expr.attr.value in PATCH_DECORATOR_NAMES


def strip_patch_decorators(node: Definition) -> Definition:
    """Remove ``@config.replace_class(...)``-style registration decorators; keep every other one.

    If the first decorator goes, the comment lines attached to it move onto the definition so that a
    header comment written between a registration decorator and ``def`` is not lost.
    """
    kept: list[cst.Decorator] = []
    carried: list[cst.EmptyLine] = []
    for dec in node.decorators:
        if _is_patch_decorator(dec):
            carried.extend(line for line in dec.leading_lines if line.comment is not None)
            continue
        if carried:
            dec = dec.with_changes(leading_lines=[*carried, *dec.leading_lines])
            carried = []
        kept.append(dec)
    leading = list(node.leading_lines)
    if carried:
        if kept:
            kept[0] = kept[0].with_changes(leading_lines=[*carried, *kept[0].leading_lines])
        else:
            # Comments between the last registration decorator and `def` sit on the `def` line's
            # leading lines already; any carried from decorators go in front of them.
            leading += carried
    return node.with_changes(decorators=kept, leading_lines=leading)


def _rename_identifier(ident: str, mapping: Mapping[str, str]) -> str:
    for old in sorted(mapping, key=len, reverse=True):
        new = mapping[old]
        if ident == old:
            return new
        if ident.startswith(old):
            # Idempotence: code already written against the new prefix must not be mapped twice.
            if new.startswith(old) and ident.startswith(new):
                return ident
            return new + ident[len(old) :]
    return ident


class _Params(cst.CSTVisitor):
    def __init__(self) -> None:
        self.names: set[str] = set()

    def visit_Param(self, node: cst.Param) -> None:
        self.names.add(node.name.value)


class _NameMapper(cst.CSTTransformer):
    """Symbol renaming: module-level identifiers only, never parameters, keywords or attributes."""

    METADATA_DEPENDENCIES = (cst.metadata.PositionProvider,)

    def __init__(self, mapping: Mapping[str, str], skip: set[str], where: str) -> None:
        super().__init__()
        self.mapping = mapping
        self.skip = skip
        self.where = where
        self.calls: list[RenamedCall] = []

    def leave_Name(self, original: cst.Name, updated: cst.Name) -> cst.Name:
        if original.value in self.skip:
            return updated
        return updated.with_changes(value=_rename_identifier(original.value, self.mapping))

    def leave_Param(self, original: cst.Param, updated: cst.Param) -> cst.Param:
        return updated.with_changes(name=original.name)

    def leave_Arg(self, original: cst.Arg, updated: cst.Arg) -> cst.Arg:
        return updated.with_changes(keyword=original.keyword)

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute) -> cst.Attribute:
        return updated.with_changes(attr=original.attr)

    def visit_Call(self, node: cst.Call) -> None:
        if isinstance(node.func, cst.Name) and node.func.value not in self.skip:
            new = _rename_identifier(node.func.value, self.mapping)
            if new != node.func.value:
                line = self.get_metadata(cst.metadata.PositionProvider, node).start.line
                self.calls.append(RenamedCall(node.func.value, new, line, self.where))


def apply_name_map(
    module: cst.Module, mapping: Mapping[str, str], where: str
) -> tuple[cst.Module, list[RenamedCall]]:
    """Rename identifiers of ``module`` by ``mapping``; also return the calls whose callee changed."""
    if not mapping:
        return module, []
    params = _Params()
    module.visit(params)
    wrapper = cst.metadata.MetadataWrapper(module)
    mapper = _NameMapper(mapping, params.names, where)
    return wrapper.visit(mapper), mapper.calls


def definition_from_object(
    obj: Any, new_name: str | None, mapping: Mapping[str, str], where: str
) -> tuple[Definition, list[RenamedCall]]:
    """Parse ``obj``'s source into one definition node, mapped, stripped and renamed to ``new_name``."""
    module = cst.parse_module(object_source(obj))
    defs = [s for s in module.body if isinstance(s, cst.FunctionDef | cst.ClassDef)]
    if len(defs) != 1:
        raise PatchgenError(f"{where}: expected one def/class in the source of {obj!r}, found {len(defs)}")
    module, calls = apply_name_map(module, mapping, where)
    node = next(s for s in module.body if isinstance(s, cst.FunctionDef | cst.ClassDef))
    node = strip_patch_decorators(node)
    if new_name is not None:
        node = node.with_changes(name=cst.Name(new_name))
    return node, calls


def statements_from_code(
    code: str, mapping: Mapping[str, str], where: str
) -> tuple[list[cst.BaseStatement], list[RenamedCall]]:
    """Parse a code string into top-level statements (name-mapped)."""
    try:
        module = cst.parse_module(textwrap.dedent(code))
    except cst.ParserSyntaxError as exc:
        raise PatchgenError(f"{where}: code does not parse: {exc}") from exc
    module, calls = apply_name_map(module, mapping, where)
    body = list(module.body)
    # libcst puts comments above the first statement into the module header; keep them with the code.
    header = [line for line in module.header if line.comment is not None]
    if body and header:
        body[0] = body[0].with_changes(leading_lines=[*header, *body[0].leading_lines])
    return body, calls


def with_marker(node: cst.BaseStatement, text: str) -> cst.BaseStatement:
    """Prefix ``node`` with a ``# [PATCHED] ...`` comment line (kept through ruff format)."""
    comment = cst.EmptyLine(comment=cst.Comment(f"# [PATCHED] {text}"))
    # Blank lines are dropped (ruff format re-creates the standard spacing); comments stay under the marker.
    comments = [line for line in node.leading_lines if line.comment is not None]
    return node.with_changes(leading_lines=[comment, *comments])


def defined_name(stmt: cst.BaseStatement) -> str | None:
    """The name a top-level statement defines (def, class, or single-target assignment)."""
    if isinstance(stmt, cst.FunctionDef | cst.ClassDef):
        return stmt.name.value
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        small = stmt.body[0]
        if isinstance(small, cst.Assign) and len(small.targets) == 1:
            target = small.targets[0].target
            if isinstance(target, cst.Name):
                return target.value
        if isinstance(small, cst.AnnAssign) and isinstance(small.target, cst.Name):
            return small.target.value
    return None
