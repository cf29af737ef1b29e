"""Apply statement- and expression-level `Edit`s to one upstream function, through libcst.

An edit names an anchor (a callee, an expression, a statement or a compound statement's header) and how often
it must match inside the function. Anchors are compared as Python syntax trees (``ast.dump``), so line breaks,
parentheses and comments in upstream do not matter, while any change of the code itself does: an upstream
release that renames, duplicates or drops the anchor makes generation fail with the count found and the
closest statements, instead of silently patching the wrong place or nothing.

Everything the edits do not touch keeps upstream's text; each changed statement gets a ``# [PATCHED] ...``
comment line.
"""

from __future__ import annotations

import ast
import difflib
import textwrap
from collections.abc import Callable, Sequence

import libcst as cst

from .config import ARGS, BODY, MATCH, Edit
from .source import PatchgenError
from .transform import no_such_method, node_code

_STATEMENT_KINDS = ("insert_before", "insert_after", "replace_statement", "wrap_statement")
_COMPOUND = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try, ast.FunctionDef,
             ast.AsyncFunctionDef, ast.ClassDef)  # fmt: skip


def _expr_key(code: str) -> str:
    # Parenthesised so that a sub-expression which spans lines only inside its parent's brackets still parses.
    return ast.dump(ast.parse(f"({code.strip()})", mode="eval").body)


def _header_only(node: ast.stmt) -> ast.stmt:
    """``node`` with every nested block emptied: what a compound statement's header says."""
    for name in ("body", "orelse", "finalbody", "handlers"):
        if hasattr(node, name):
            setattr(node, name, [])
    return node


def _stmt_key(code: str, header: bool) -> str:
    tree = ast.parse(textwrap.dedent(code).strip() + ("\n    pass\n" if header else "\n"))
    if len(tree.body) != 1:
        raise ValueError(f"expected one statement, found {len(tree.body)}")
    node = tree.body[0]
    return ast.dump(_header_only(node) if header else node)


def _candidate_key(stmt: cst.BaseStatement, header: bool) -> str | None:
    # A simple-statement anchor never equals a compound statement, nor a header a simple line: skip the parse.
    if header == isinstance(stmt, cst.SimpleStatementLine):
        return None
    code = node_code(stmt.with_changes(leading_lines=[]))
    try:
        if header:
            node = ast.parse(textwrap.dedent(code)).body[0]
            return ast.dump(_header_only(node)) if isinstance(node, _COMPOUND) else None
        return _stmt_key(code, False)
    except (SyntaxError, ValueError):
        return None


def _marker(node: cst.BaseStatement, text: str) -> cst.BaseStatement:
    comment = cst.EmptyLine(comment=cst.Comment(f"# [PATCHED] {text}"))
    return node.with_changes(leading_lines=[*node.leading_lines, comment])


def _parse_statements(code: str, edit: Edit) -> list[cst.BaseStatement]:
    try:
        return list(cst.parse_module(textwrap.dedent(code).strip("\n") + "\n").body) if code.strip() else []
    except cst.ParserSyntaxError as exc:
        raise PatchgenError(f"{edit.kind} {edit.label}: code does not parse: {exc}") from exc


def _parse_expression(code: str, edit: Edit) -> cst.BaseExpression:
    try:
        return cst.parse_expression(code.strip())
    except cst.ParserSyntaxError as exc:
        raise PatchgenError(f"{edit.kind} {edit.label}: expression {code!r} does not parse: {exc}") from exc


class _Fill(cst.CSTTransformer):
    """Put the matched expression (``__match__``) and a matched call's arguments (``__args__``) into a template."""

    def __init__(self, match: cst.BaseExpression) -> None:
        super().__init__()
        self.match = match

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if not any(
            isinstance(a.value, cst.Name) and a.value.value == ARGS and a.keyword is None
            for a in updated.args
        ):
            return updated
        if not isinstance(self.match, cst.Call):
            raise PatchgenError(f"{ARGS} in a template needs a matched call, got {node_code(self.match)!r}")
        args: list[cst.Arg] = []
        for arg in updated.args:
            spliced = (
                self.match.args if isinstance(arg.value, cst.Name) and arg.value.value == ARGS else [arg]
            )
            args += [a.with_changes(comma=cst.MaybeSentinel.DEFAULT) for a in spliced]
        return updated.with_changes(args=args)

    def leave_Name(self, original: cst.Name, updated: cst.BaseExpression) -> cst.BaseExpression:
        return self.match if original.value == MATCH else updated


def _dotted(expr: cst.BaseExpression) -> str | None:
    if isinstance(expr, cst.Name):
        return expr.value
    if isinstance(expr, cst.Attribute):
        base = _dotted(expr.value)
        return None if base is None else f"{base}.{expr.attr.value}"
    return None


class _ExpressionEdit(cst.CSTTransformer):
    """Replace matching expressions; mark the innermost statement holding each replacement."""

    def __init__(self, edit: Edit, matches: Callable[[cst.BaseExpression], bool]) -> None:
        super().__init__()
        self.edit = edit
        self.matches = matches
        self.template = _parse_expression(edit.code, edit)
        self.found: list[str] = []
        # Per open statement: the match count when it was entered, and whether a statement inside it got the mark.
        self._open: list[list[int]] = []

    def on_visit(self, node: cst.CSTNode) -> bool:
        if isinstance(node, cst.BaseStatement):
            self._open.append([len(self.found), 0])
        return True

    def on_leave(self, original: cst.CSTNode, updated: cst.CSTNode) -> cst.CSTNode | cst.RemovalSentinel:
        result = super().on_leave(original, updated)
        if isinstance(original, cst.BaseExpression) and self.matches(original):
            self.found.append(node_code(original).strip())
            assert isinstance(result, cst.BaseExpression)
            result = self.template.deep_clone().visit(_Fill(result))
        if isinstance(original, cst.BaseStatement):
            before, inner_marked = self._open.pop()
            if len(self.found) > before and not inner_marked and isinstance(result, cst.BaseStatement):
                result = _marker(result, self.edit.description)
            if len(self.found) > before and self._open:
                self._open[-1][1] = 1
        return result


def _matcher(edit: Edit) -> Callable[[cst.BaseExpression], bool]:
    if edit.kind == "replace_call":
        return lambda node: isinstance(node, cst.Call) and _dotted(node.func) == edit.anchor
    try:
        want = _expr_key(edit.anchor)
        kind = type(cst.parse_expression(edit.anchor))
    except (SyntaxError, cst.ParserSyntaxError) as exc:
        raise PatchgenError(
            f"replace_expression {edit.label}: anchor {edit.anchor!r} is not an expression"
        ) from exc

    def matches(node: cst.BaseExpression) -> bool:
        if not isinstance(node, kind):
            return False
        try:
            return _expr_key(node_code(node)) == want
        except SyntaxError:
            return False

    return matches


class _StatementEdit(cst.CSTTransformer):
    """Insert around, replace or wrap the statements of every indented block that match the anchor."""

    def __init__(self, edit: Edit) -> None:
        super().__init__()
        self.edit = edit
        self.header = edit.anchor.rstrip().endswith(":")
        try:
            self.want = _stmt_key(edit.anchor, self.header)
        except (SyntaxError, ValueError) as exc:
            raise PatchgenError(
                f"{edit.kind} {edit.label}: anchor {edit.anchor!r} is not one statement (or a header ending in "
                f"':'): {exc}"
            ) from exc
        self.code = [] if edit.kind == "wrap_statement" else _parse_statements(edit.code, edit)
        if edit.kind == "wrap_statement":
            self.template = _parse_statements(edit.code, edit)
        self.found: list[str] = []
        self.seen: list[str] = []

    def _rewrite(self, stmt: cst.BaseStatement) -> list[cst.BaseStatement]:
        new = [s.deep_clone() for s in self.code]
        marked = [_marker(new[0], self.edit.description), *new[1:]] if new else []
        if self.edit.kind == "insert_before":
            return [*marked, stmt]
        if self.edit.kind == "insert_after":
            return [stmt, *marked]
        if self.edit.kind == "replace_statement":
            if marked:
                marked[0] = marked[0].with_changes(
                    leading_lines=[*stmt.leading_lines, *marked[0].leading_lines]
                )
            return marked
        wrapped = [s.visit(_PutBody(stmt)) for s in self.template]
        wrapped[0] = _marker(wrapped[0].with_changes(leading_lines=stmt.leading_lines), self.edit.description)
        return wrapped  # type: ignore[return-value]

    def leave_IndentedBlock(
        self, original: cst.IndentedBlock, updated: cst.IndentedBlock
    ) -> cst.IndentedBlock:
        body: list[cst.BaseStatement] = []
        for stmt in updated.body:
            key = _candidate_key(stmt, self.header)
            if key == self.want:
                self.found.append(node_code(stmt.with_changes(leading_lines=[])).strip().splitlines()[0])
                body += self._rewrite(stmt)
            else:
                self.seen.append(node_code(stmt.with_changes(leading_lines=[])).strip().splitlines()[0])
                body.append(stmt)
        return updated.with_changes(body=body)


class _PutBody(cst.CSTTransformer):
    """Replace the template's ``__body__`` line by the wrapped statement."""

    def __init__(self, stmt: cst.BaseStatement) -> None:
        super().__init__()
        self.stmt = stmt.with_changes(leading_lines=[])

    def leave_SimpleStatementLine(
        self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine
    ) -> cst.BaseStatement:
        small = original.body
        is_body = len(small) == 1 and isinstance(small[0], cst.Expr) and isinstance(small[0].value, cst.Name)
        return self.stmt if is_body and small[0].value.value == BODY else updated


def _count_error(edit: Edit, found: Sequence[str], seen: Sequence[str]) -> PatchgenError:
    what = {"replace_call": "calls of", "replace_expression": "expressions equal to"}.get(
        edit.kind, "statements matching"
    )
    msg = f"{edit.kind} {edit.label}: expected {edit.count} {what} {edit.anchor!r}, found {len(found)}" + (
        f": {list(found)}" if found else ""
    )
    if not found and seen:
        close = difflib.get_close_matches(edit.anchor, list(dict.fromkeys(seen)), n=3, cutoff=0.4)
        msg += f" (closest statements: {close})" if close else ""
    return PatchgenError(msg + ". Has upstream changed? Update the anchor or the count.")


def _all_lines(func: cst.FunctionDef) -> list[str]:
    lines = node_code(func.body).splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def apply_edits(func: cst.FunctionDef, edits: Sequence[Edit]) -> cst.FunctionDef:
    """Apply ``edits`` to ``func`` in order; each must match exactly its ``count`` times."""
    for edit in edits:
        if edit.kind in _STATEMENT_KINDS:
            stmt_edit = _StatementEdit(edit)
            new_body = func.body.visit(stmt_edit)
            found, seen = stmt_edit.found, stmt_edit.seen
        else:
            expr_edit = _ExpressionEdit(edit, _matcher(edit))
            new_body = func.body.visit(expr_edit)
            found, seen = expr_edit.found, _all_lines(func)
        if len(found) != edit.count:
            raise _count_error(edit, found, seen)
        assert isinstance(new_body, cst.BaseSuite)
        func = func.with_changes(body=new_body)
    return func


def edit_definition(stmt: cst.BaseStatement, edits: Sequence[Edit]) -> cst.BaseStatement:
    """Apply ``edits`` (all on one top-level name) to a top-level function or to methods of a class."""
    first = edits[0]
    if isinstance(stmt, cst.FunctionDef):
        if any(e.method is not None for e in edits):
            raise PatchgenError(
                f"{first.kind} {first.label}: upstream {first.target!r} is a function, not a class"
            )
        return apply_edits(stmt, edits)
    if not isinstance(stmt, cst.ClassDef) or not isinstance(stmt.body, cst.IndentedBlock):
        raise PatchgenError(
            f"{first.kind} {first.label}: upstream {first.target!r} is not a function or class"
        )
    by_method: dict[str, list[Edit]] = {}
    for edit in edits:
        if edit.method is None:
            raise PatchgenError(f"{edit.kind} {edit.label}: a class is edited per method; name 'Cls.method'")
        by_method.setdefault(edit.method, []).append(edit)
    body = list(stmt.body.body)
    for method, method_edits in by_method.items():
        index = next(
            (i for i, s in enumerate(body) if isinstance(s, cst.FunctionDef) and s.name.value == method), None
        )
        if index is None:
            raise no_such_method(method_edits[0].kind, stmt, method)
        func = body[index]
        assert isinstance(func, cst.FunctionDef)
        body[index] = apply_edits(func, method_edits)
    return stmt.with_changes(body=stmt.body.with_changes(body=body))
