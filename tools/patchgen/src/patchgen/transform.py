"""libcst transforms applied to the upstream module: imports, class bodies, ``__all__``.

Each function takes and returns an immutable libcst tree, so comments and formatting of everything the
patches do not touch survive verbatim.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import libcst as cst

from .source import PatchgenError, with_marker

_EMPTY = cst.Module(body=[])


def node_code(node: cst.CSTNode) -> str:
    """Source text of one node."""
    return _EMPTY.code_for_node(node)


def _dotted(expr: cst.BaseExpression | None) -> str:
    if expr is None:
        return ""
    if isinstance(expr, cst.Name):
        return expr.value
    if isinstance(expr, cst.Attribute):
        return f"{_dotted(expr.value)}.{expr.attr.value}"
    raise PatchgenError(f"unexpected import module expression {node_code(expr)!r}")


class _Absolutize(cst.CSTTransformer):
    def __init__(self, package: str) -> None:
        super().__init__()
        self.package = package.split(".") if package else []

    # An import is a small statement, so it sits directly in a statement line or a one-line suite; expressions
    # hold none. Not descending into lines without one skips most of the tree (the visit of every upstream
    # expression was the bulk of patchgen's time).
    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> bool:
        return any(isinstance(small, cst.ImportFrom) for small in node.body)

    def visit_SimpleStatementSuite(self, node: cst.SimpleStatementSuite) -> bool:
        return any(isinstance(small, cst.ImportFrom) for small in node.body)

    def leave_ImportFrom(self, original: cst.ImportFrom, updated: cst.ImportFrom) -> cst.ImportFrom:
        level = len(updated.relative)
        if level == 0:
            return updated
        if level - 1 > len(self.package) or (level - 1 == len(self.package) and updated.module is None):
            raise PatchgenError(f"relative import {node_code(original)!r} goes above the top-level package")
        base = self.package[: len(self.package) - (level - 1)]
        target = ".".join([*base, _dotted(updated.module)] if updated.module else base)
        return updated.with_changes(relative=[], module=cst.parse_expression(target))


def absolutize_imports(module: cst.Module, source_module: str, is_package: bool) -> cst.Module:
    """Rewrite ``from ..x import y`` into absolute imports resolved against ``source_module``."""
    package = source_module if is_package else source_module.rpartition(".")[0]
    return module.visit(_Absolutize(package))


def _bound_name(alias: cst.ImportAlias) -> str:
    if alias.asname is not None:
        return node_code(alias.asname.name)
    # `import a.b` binds `a`.
    return _dotted(alias.name).split(".")[0]


def _filter_import(
    small: cst.BaseSmallStatement, drop: set[str], seen: set[str]
) -> cst.BaseSmallStatement | None:
    if not isinstance(small, cst.Import | cst.ImportFrom) or isinstance(small.names, cst.ImportStar):
        return small
    kept = []
    for alias in small.names:
        if _bound_name(alias) in drop:
            seen.add(_bound_name(alias))
        else:
            kept.append(alias)
    if not kept:
        return None
    if len(kept) == len(small.names):
        return small
    # The last alias must not keep a trailing comma that belonged to a removed neighbour.
    kept[-1] = kept[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
    return small.with_changes(names=kept)


def drop_import_names(module: cst.Module, names: Sequence[str]) -> cst.Module:
    """Remove bound names from top-level imports; statements left empty are removed.

    A name that no top-level import binds is an error: a stale ``drop_import_names`` would otherwise
    hide that upstream changed.
    """
    if not names:
        return module
    drop, seen = set(names), set()
    body: list[cst.BaseStatement] = []
    for stmt in module.body:
        if isinstance(stmt, cst.SimpleStatementLine):
            smalls = [s for s in (_filter_import(s, drop, seen) for s in stmt.body) if s is not None]
            if not smalls:
                continue
            stmt = stmt.with_changes(body=smalls)
        body.append(stmt)
    missing = sorted(drop - seen)
    if missing:
        raise PatchgenError(f"drop_import_names: no top-level import binds {missing}")
    return module.with_changes(body=body)


class _Lines(cst.CSTVisitor):
    def __init__(self) -> None:
        self.smalls: list[cst.BaseSmallStatement] = []
        self.has_def = False

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> None:
        self.smalls.extend(node.body)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.has_def = True

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.has_def = True


def _only_imports(stmt: cst.BaseStatement) -> bool:
    """An import line, or an if/try block holding nothing but imports (and ``pass``)."""
    if not isinstance(stmt, cst.SimpleStatementLine | cst.If | cst.Try):
        return False
    lines = _Lines()
    stmt.visit(lines)
    imports = [s for s in lines.smalls if isinstance(s, cst.Import | cst.ImportFrom)]
    others = [s for s in lines.smalls if not isinstance(s, cst.Import | cst.ImportFrom | cst.Pass)]
    return bool(imports) and not others and not lines.has_def


def import_section_end(module: cst.Module) -> int:
    """Index just after the last top-level import (or import-only if/try block) before the first def."""
    end = 0
    for i, stmt in enumerate(module.body):
        if isinstance(stmt, cst.FunctionDef | cst.ClassDef):
            break
        if _only_imports(stmt):
            end = i + 1
    if end == 0 and module.body and _is_docstring(module.body[0]):
        end = 1
    return end


def _is_docstring(stmt: cst.BaseStatement) -> bool:
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], cst.Expr)
        and isinstance(stmt.body[0].value, cst.SimpleString | cst.ConcatenatedString)
    )


@dataclass(frozen=True)
class MethodPatch:
    """A resolved method replacement for `patch_class`."""

    method: str
    node: cst.FunctionDef
    description: str
    keep_decorators: bool
    kind: str


def _merge_decorators(old: Iterable[cst.Decorator], new: Iterable[cst.Decorator]) -> list[cst.Decorator]:
    merged = list(old)
    present = {node_code(d.decorator) for d in merged}
    merged += [d for d in new if node_code(d.decorator) not in present]
    return merged


def class_methods(cls: cst.ClassDef) -> list[str]:
    """Names of the methods defined in ``cls``'s own body, in order."""
    body = cls.body.body if isinstance(cls.body, cst.IndentedBlock) else []
    return [s.name.value for s in body if isinstance(s, cst.FunctionDef)]


def no_such_method(kind: str, cls: cst.ClassDef, method: str) -> PatchgenError:
    """The error for a patch or edit naming a method that ``cls`` does not define upstream."""
    names = class_methods(cls)
    close = difflib.get_close_matches(method, names, n=3)
    hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
    add = (
        " To add a method upstream lacks, use add_method."
        if kind in ("override_method", "modify_init")
        else ""
    )
    return PatchgenError(
        f"{kind} {cls.name.value}.{method}: upstream class {cls.name.value!r} defines no method {method!r} "
        f"(it defines {names}).{hint}{add}"
    )


def patch_class(cls: cst.ClassDef, patches: Sequence[MethodPatch]) -> cst.ClassDef:
    """Replace (in place) the given methods of one class, or append those patched with ``add_method``."""
    body = cls.body
    if isinstance(body, cst.SimpleStatementSuite):
        body = cst.IndentedBlock(body=[cst.SimpleStatementLine(body=list(body.body))])
    stmts = list(body.body)
    for p in patches:
        index = next(
            (i for i, s in enumerate(stmts) if isinstance(s, cst.FunctionDef) and s.name.value == p.method),
            None,
        )
        if p.kind == "add_method":
            if index is not None:
                raise PatchgenError(
                    f"add_method {cls.name.value}.{p.method}: upstream class {cls.name.value!r} already defines "
                    f"{p.method!r}; replace it with override_method (or pick a new name)"
                )
            stmts.append(with_marker(p.node, f"{p.description} (injected: not in upstream)"))
            continue
        if index is None:
            raise no_such_method(p.kind, cls, p.method)
        old = stmts[index]
        assert isinstance(old, cst.FunctionDef)
        decorators = (
            _merge_decorators(old.decorators, p.node.decorators) if p.keep_decorators else p.node.decorators
        )
        stmts[index] = with_marker(p.node.with_changes(decorators=decorators), p.description)
    return cls.with_changes(body=body.with_changes(body=stmts))


def rebuild_all(stmt: cst.SimpleStatementLine, excluded: set[str]) -> cst.SimpleStatementLine:
    """``__all__ = [...]`` without the excluded names."""
    small = stmt.body[0]
    assert isinstance(small, cst.Assign)
    value = small.value
    if not isinstance(value, cst.List | cst.Tuple):
        raise PatchgenError("exclude_from_output: __all__ is not a literal list/tuple; cannot rebuild it")
    kept = [
        cst.Element(e.value)
        for e in value.elements
        if not (isinstance(e.value, cst.SimpleString) and e.value.evaluated_value in excluded)
    ]
    return stmt.with_changes(body=[small.with_changes(value=cst.List(elements=kept))])
