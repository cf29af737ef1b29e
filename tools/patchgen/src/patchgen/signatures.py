"""Static call/signature checks over one module's source, without importing it.

Generated files splice code written against one upstream version (or a sibling model) into another; a
call whose arguments no longer fit the callee fails only at run time, possibly only on one device. This
module reads signatures of the module's own top-level functions and classes (``__init__``, or dataclass
fields) and checks every direct call ``Name(...)`` to them.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

# Bases known to contribute no constructor fields, so a dataclass deriving from them is fully known.
_FIELDLESS_BASES = frozenset({"object", "ModelOutput", "Generic", "ABC"})


@dataclass(frozen=True)
class Signature:
    """What a callable accepts. ``positional`` excludes ``self``; ``required`` names mandatory params."""

    name: str
    positional: tuple[str, ...]
    keyword_only: tuple[str, ...]
    required: frozenset[str]
    varargs: bool
    varkw: bool

    @property
    def params(self) -> frozenset[str]:
        """Every name that can be passed by keyword."""
        return frozenset(self.positional) | frozenset(self.keyword_only)


@dataclass(frozen=True)
class Violation:
    """One call that does not fit its callee."""

    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


def _from_arguments(name: str, args: ast.arguments, drop_first: bool) -> Signature:
    positional = [a.arg for a in (*args.posonlyargs, *args.args)]
    # Defaults align with the tail of the positional list.
    n_required_pos = len(positional) - len(args.defaults)
    required = set(positional[:n_required_pos])
    if drop_first and positional:
        required.discard(positional[0])
        positional = positional[1:]
    kwonly = [a.arg for a in args.kwonlyargs]
    required |= {a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is None}
    return Signature(
        name,
        tuple(positional),
        tuple(kwonly),
        frozenset(required),
        args.vararg is not None,
        args.kwarg is not None,
    )


def _decorator_name(node: ast.expr) -> str:
    target = node.func if isinstance(node, ast.Call) else node
    if isinstance(target, ast.Attribute):
        return target.attr
    return target.id if isinstance(target, ast.Name) else ""


def _dataclass_fields(cls: ast.ClassDef) -> tuple[list[str], set[str]] | None:
    """Fields (in order) and required fields of a ``@dataclass`` body, or None if it is not one."""
    if not any(_decorator_name(d) == "dataclass" for d in cls.decorator_list):
        return None
    names: list[str] = []
    required: set[str] = set()
    for stmt in cls.body:
        if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
            continue
        ann = ast.unparse(stmt.annotation)
        # ClassVar annotations are class attributes, not constructor fields.
        if ann.startswith(("ClassVar", "typing.ClassVar")):
            continue
        value = stmt.value
        if isinstance(value, ast.Call) and _decorator_name(value) == "field":
            kws = {k.arg: k.value for k in value.keywords}
            init = kws.get("init")
            if isinstance(init, ast.Constant) and init.value is False:
                continue
            if "default" not in kws and "default_factory" not in kws:
                required.add(stmt.target.id)
        elif value is None:
            required.add(stmt.target.id)
        names.append(stmt.target.id)
    return names, required


def collect_signatures(tree: ast.Module) -> dict[str, Signature | None]:
    """Signatures of the module's top-level functions and classes.

    A name maps to None when its signature cannot be known statically (defined twice, a class whose
    constructor comes from an external base, ``__new__``, ...): callers skip those rather than guess.
    """
    defs: dict[str, list[ast.stmt]] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defs.setdefault(stmt.name, []).append(stmt)
    out: dict[str, Signature | None] = {}

    def resolve(name: str, seen: frozenset[str]) -> Signature | None:
        if name in out:
            return out[name]
        nodes = defs.get(name)
        if not nodes or len(nodes) != 1 or name in seen:
            return None
        node = nodes[0]
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return _from_arguments(name, node.args, drop_first=False)
        assert isinstance(node, ast.ClassDef)
        methods = {s.name: s for s in node.body if isinstance(s, ast.FunctionDef)}
        if "__new__" in methods:
            return None
        if "__init__" in methods:
            return _from_arguments(name, methods["__init__"].args, drop_first=True)
        base_names = [ast.unparse(b) for b in node.bases]
        fields = _dataclass_fields(node)
        if fields is not None:
            inherited: list[str] = []
            inherited_req: set[str] = set()
            for base in base_names:
                if base in _FIELDLESS_BASES:
                    continue
                base_sig = resolve(base, seen | {name})
                if base_sig is None or base_sig.varargs or base_sig.varkw:
                    return None
                inherited += [p for p in base_sig.positional if p not in inherited]
                inherited_req |= base_sig.required
            names = inherited + [f for f in fields[0] if f not in inherited]
            required = (inherited_req - set(fields[0])) | fields[1]
            return Signature(name, tuple(names), (), frozenset(required), False, False)
        # No __init__ and not a dataclass: the constructor is the first base's, if that base is ours.
        local_bases = [b for b in base_names if b in defs]
        if len(base_names) == 1 and local_bases:
            base_sig = resolve(local_bases[0], seen | {name})
            if base_sig is not None:
                return Signature(
                    name,
                    base_sig.positional,
                    base_sig.keyword_only,
                    base_sig.required,
                    base_sig.varargs,
                    base_sig.varkw,
                )
        return None

    for name in defs:
        out[name] = resolve(name, frozenset())
    return out


def check_call(call: ast.Call, sig: Signature) -> list[str]:
    """Problems with one call against one signature (empty when it fits)."""
    problems: list[str] = []
    has_star = any(isinstance(a, ast.Starred) for a in call.args)
    has_dstar = any(k.arg is None for k in call.keywords)
    n_pos = len([a for a in call.args if not isinstance(a, ast.Starred)])
    if not sig.varargs and n_pos > len(sig.positional):
        problems.append(
            f"{sig.name}() takes at most {len(sig.positional)} positional argument(s), got {n_pos}"
        )
    bound = set(sig.positional[:n_pos])
    for kw in call.keywords:
        if kw.arg is None:
            continue
        if kw.arg not in sig.params and not sig.varkw:
            problems.append(f"{sig.name}() got an unexpected keyword argument {kw.arg!r}")
        elif kw.arg in bound:
            problems.append(f"{sig.name}() got multiple values for argument {kw.arg!r}")
        bound.add(kw.arg)
    if not has_star and not has_dstar:
        missing = sorted(sig.required - bound)
        if missing:
            problems.append(f"{sig.name}() missing required argument(s): {', '.join(missing)}")
    return problems


class _CallChecker(ast.NodeVisitor):
    """Walks the module, tracking names that shadow top-level definitions inside functions."""

    def __init__(self, sigs: dict[str, Signature | None], path: str) -> None:
        self.sigs = sigs
        self.path = path
        self.shadowed: list[set[str]] = []
        self.violations: list[Violation] = []

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        args = node.args
        local = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}
        local |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                local.add(sub.id)
        self.shadowed.append(local)
        self.generic_visit(node)
        self.shadowed.pop()

    visit_FunctionDef = _visit_function
    visit_AsyncFunctionDef = _visit_function
    visit_Lambda = _visit_function

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and not any(func.id in s for s in self.shadowed):
            sig = self.sigs.get(func.id)
            if sig is not None:
                for problem in check_call(node, sig):
                    self.violations.append(Violation(self.path, node.lineno, problem))
        self.generic_visit(node)


def check_source(source: str, path: str = "<generated>") -> list[Violation]:
    """Every direct call to a top-level function/class of ``source`` checked against its signature."""
    tree = ast.parse(source, filename=path)
    checker = _CallChecker(collect_signatures(tree), path)
    checker.visit(tree)
    return checker.violations
