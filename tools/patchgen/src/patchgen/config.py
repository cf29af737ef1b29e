"""The patch DSL: a `PatchConfig` records, in declaration order, what to change in one upstream module.

A config module is plain Python: replacement bodies are real functions and classes written next to the
decorators that register them, so editors, linters and type checkers see them. Registration returns the
decorated object unchanged, which is what lets a sibling config import and re-register the same function
(``npu_config.override_method("Qwen3Model", "forward", description=...)(gpu_forward)``).

Besides whole definitions, a config can edit inside an upstream function or method (`PatchConfig.replace_call`,
``replace_expression``, ``insert_before``/``insert_after``, ``replace_statement``, ``wrap_statement``): each edit's
anchor must match a stated number of times, so a config states only its delta and an upstream change that moves
the anchor fails generation. The vocabulary is tabled in ``tools/patchgen/README.md``; edits.py applies them.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

T = TypeVar("T")

PatchKind = Literal[
    "replace_class",
    "override_method",
    "add_method",
    "replace_function",
    "modify_init",
    "external",
]

# Method names of PatchConfig whose use as a decorator must be removed from extracted source. The
# extractor matches decorator *nodes* against these names (see source.py) rather than scanning text.
PATCH_DECORATOR_NAMES = frozenset(
    {"replace_class", "override_method", "add_method", "replace_function", "modify_init", "add_helper"}
)


class PatchConfigError(ValueError):
    """A patch was declared inconsistently (duplicate target, bad name, missing description)."""


@dataclass(frozen=True)
class Patch:
    """One declared change to a top-level class, a method or a module-level function.

    ``replacement`` is the Python object whose source becomes the new definition, or, for ``external``
    patches, ``None`` until resolved from ``external_module``/``external_name`` at generation time (so
    declaring an external patch does not import a possibly heavy optional dependency).
    """

    kind: PatchKind
    target: str
    method: str | None
    description: str
    replacement: Any = None
    name_map: Mapping[str, str] | None = None
    keep_decorators: bool = True
    external_module: str | None = None
    external_name: str | None = None

    @property
    def label(self) -> str:
        """A human-readable target: ``Cls`` or ``Cls.method``."""
        return f"{self.target}.{self.method}" if self.method else self.target


@dataclass(frozen=True)
class Helper:
    """A module-level object (function, class) or raw code emitted into the generated file."""

    description: str
    obj: Any = None
    code: str | None = None
    after: str | None = None
    name_map: Mapping[str, str] | None = None


EditKind = Literal[
    "replace_call",
    "replace_expression",
    "insert_before",
    "insert_after",
    "replace_statement",
    "wrap_statement",
]

# The placeholders an edit's replacement code may use (see edits.py): the matched node itself, the matched call's
# arguments (inside a call of the template), and the matched statement (inside a wrap template).
MATCH, ARGS, BODY = "__match__", "__args__", "__body__"


@dataclass(frozen=True)
class Edit:
    """One change inside an upstream function or method, located by an anchor that must match ``count`` times.

    ``target`` is a top-level class (``method`` set) or a top-level function (``method`` None). ``anchor`` is a
    callee's dotted name (``replace_call``), an expression (``replace_expression``) or a statement, or a
    compound statement's header ending in ``:`` (the statement edits); ``code`` is the replacement expression or
    the statements to insert.
    """

    kind: EditKind
    target: str
    method: str | None
    anchor: str
    code: str
    count: int
    description: str

    @property
    def label(self) -> str:
        """A human-readable target: ``func`` or ``Cls.method``."""
        return f"{self.target}.{self.method}" if self.method else self.target


def _import_bindings(statement: str) -> set[tuple[str, str, str]]:
    """(module, name, bound as) for each name one import statement binds."""
    node = ast.parse(statement).body[0]
    if isinstance(node, ast.ImportFrom):
        module = "." * node.level + (node.module or "")
        return {(module, a.name, a.asname or a.name) for a in node.names}
    assert isinstance(node, ast.Import)
    return {(a.name, "", a.asname or a.name) for a in node.names}


def _require_description(description: str | None, what: str) -> str:
    if not description or not description.strip():
        raise PatchConfigError(f"{what}: a non-empty description is required (it goes into the header)")
    return description.strip()


@dataclass
class PatchConfig:
    """The declarative patch set for one upstream module and one generated file.

    Args:
        source_module: dotted name of the upstream module (read from disk, never imported).
        target_file: file name of the generated module, written under ``<config dir>/generated/`` unless
            the CLI is given ``-o``.
        description: one line for the generated header.
    """

    source_module: str
    target_file: str
    description: str
    patches: list[Patch] = field(default_factory=list)
    imports: list[str] = field(default_factory=list)
    dropped_import_names: list[str] = field(default_factory=list)
    post_import_blocks: list[str] = field(default_factory=list)
    helpers: list[Helper] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)
    edits: list[Edit] = field(default_factory=list)
    names: dict[str, str] = field(default_factory=dict)
    name_map_origin: str | None = None

    def __post_init__(self) -> None:
        if not self.target_file.endswith(".py"):
            raise PatchConfigError(f"target_file must end in .py, got {self.target_file!r}")

    # -- registration helpers -------------------------------------------------------------------------

    def _add(self, patch: Patch) -> None:
        # Two patches on one target would make the output depend on declaration order, and a whole-class
        # replacement plus a method override of that class is ambiguous: refuse both. A statement-level edit
        # of a method that is also replaced whole would edit code that is never emitted.
        for edit in self.edits:
            if edit.target == patch.target and (patch.method is None or edit.method in (None, patch.method)):
                raise PatchConfigError(
                    f"{patch.kind} {patch.label!r} conflicts with earlier {edit.kind} on {edit.label!r}"
                )
        for other in self.patches:
            if other.target != patch.target:
                continue
            if other.method is None or patch.method is None or other.method == patch.method:
                raise PatchConfigError(
                    f"{patch.kind} {patch.label!r} conflicts with earlier {other.kind} {other.label!r}"
                )
        self.patches.append(patch)

    # -- primitives -----------------------------------------------------------------------------------

    def replace_class(
        self, name: str, *, description: str, name_map: Mapping[str, str] | None = None
    ) -> Callable[[T], T]:
        """Decorator: the decorated class replaces upstream top-level class ``name`` (renamed to it).

        The upstream class's decorators go away with it; the replacement's own decorators are kept.
        """
        desc = _require_description(description, f"replace_class({name!r})")

        def register(obj: T) -> T:
            self._add(Patch("replace_class", name, None, desc, obj, name_map))
            return obj

        return register

    def override_method(
        self,
        class_name: str,
        method_name: str | None = None,
        *,
        description: str,
        keep_decorators: bool = True,
        name_map: Mapping[str, str] | None = None,
    ) -> Callable[[T], T]:
        """Decorator: the decorated function replaces upstream's ``class_name.method_name``.

        ``class_name`` may be dotted (``"Qwen3Model.forward"``); without a method name the function's own
        name is used. With ``keep_decorators`` the upstream method's decorators (``@can_return_tuple``,
        ``@auto_docstring``...) stay on the new method, followed by the replacement's own decorators.
        The method must exist upstream (a mistyped name is an error naming the class's methods); a method
        upstream lacks is added with `add_method`.
        """
        return self._method_patch(
            "override_method", class_name, method_name, description, keep_decorators, name_map
        )

    def add_method(
        self,
        class_name: str,
        method_name: str | None = None,
        *,
        description: str,
        name_map: Mapping[str, str] | None = None,
    ) -> Callable[[T], T]:
        """Decorator: the decorated function becomes a new method ``class_name.method_name``, appended.

        The method must *not* exist upstream (use `override_method` for that): so that an upstream
        release which adds a method of that name is noticed instead of silently shadowed.
        """
        return self._method_patch("add_method", class_name, method_name, description, True, name_map)

    def _method_patch(
        self,
        kind: PatchKind,
        class_name: str,
        method_name: str | None,
        description: str,
        keep_decorators: bool,
        name_map: Mapping[str, str] | None,
    ) -> Callable[[T], T]:
        if method_name is None and "." in class_name:
            class_name, method_name = class_name.split(".", 1)

        def register(obj: T) -> T:
            method = method_name or getattr(obj, "__name__", None)
            if not method:
                raise PatchConfigError(f"{kind}({class_name!r}): cannot tell the method name")
            desc = _require_description(description, f"{kind}({class_name}.{method})")
            self._add(Patch(kind, class_name, method, desc, obj, name_map, keep_decorators))
            return obj

        return register

    def replace_function(
        self, name: str, *, description: str, name_map: Mapping[str, str] | None = None
    ) -> Callable[[T], T]:
        """Decorator: the decorated function replaces upstream module-level function ``name``."""
        desc = _require_description(description, f"replace_function({name!r})")

        def register(obj: T) -> T:
            self._add(Patch("replace_function", name, None, desc, obj, name_map))
            return obj

        return register

    def modify_init(
        self,
        class_name: str,
        *,
        description: str,
        keep_decorators: bool = True,
        name_map: Mapping[str, str] | None = None,
    ) -> Callable[[T], T]:
        """Decorator: the decorated function replaces upstream's ``class_name.__init__`` (which must exist)."""
        desc = _require_description(description, f"modify_init({class_name!r})")

        def register(obj: T) -> T:
            self._add(Patch("modify_init", class_name, "__init__", desc, obj, name_map, keep_decorators))
            return obj

        return register

    def create_patch_from_external(
        self,
        target: str,
        module: str,
        name: str | None = None,
        *,
        description: str,
        name_map: Mapping[str, str] | None = None,
    ) -> None:
        """Replace ``target`` (a top-level class/function, or ``Cls.method``) with the source of
        ``module.name`` (default: the target's last component), copied into the generated file.

        The module is imported only when the file is generated.
        """
        cls, _, method = target.partition(".")
        desc = _require_description(description, f"create_patch_from_external({target!r})")
        ext_name = name or (method or cls)
        self._add(Patch("external", cls, method or None, desc, None, name_map, True, module, ext_name))

    def add_import(self, statement: str) -> None:
        """Add one import statement (``"from veomni.kernels import OpSlot"``) after upstream's imports.

        A statement whose names an earlier one already imports the same way is dropped, so shared helpers can
        declare what their code needs without duplicating a config's own, broader import line.
        """
        text = statement.strip()
        if not text.startswith(("import ", "from ")) or "\n" in text:
            raise PatchConfigError(f"add_import expects one import statement, got {statement!r}")
        if not _import_bindings(text) <= {b for i in self.imports for b in _import_bindings(i)}:
            self.imports.append(text)

    def drop_import_names(self, *names: str) -> None:
        """Remove these bound names from upstream's top-level imports (emptied statements go away)."""
        for n in names:
            if n not in self.dropped_import_names:
                self.dropped_import_names.append(n)

    def add_post_import_block(self, code: str) -> None:
        """Raw module-level code placed after the imports (and the added imports)."""
        self.post_import_blocks.append(textwrap.dedent(code).strip("\n") + "\n")

    def add_helper(
        self,
        func_or_code: Any = None,
        *,
        description: str,
        after: str | None = None,
        name_map: Mapping[str, str] | None = None,
    ) -> Any:
        """Emit a helper: a function/class (its source) or a code string. Usable as a decorator.

        Helpers go after the post-import blocks, or right after top-level definition ``after``.
        """
        desc = _require_description(description, "add_helper")

        def register(obj: T) -> T:
            if isinstance(obj, str):
                self.helpers.append(Helper(desc, code=textwrap.dedent(obj), after=after, name_map=name_map))
            else:
                self.helpers.append(Helper(desc, obj=obj, after=after, name_map=name_map))
            return obj

        if func_or_code is None:
            return register
        return register(func_or_code)

    def exclude_from_output(self, *names: str) -> None:
        """Drop these top-level definitions from the output; ``__all__`` is rebuilt without them."""
        for n in names:
            if n not in self.excluded:
                self.excluded.append(n)

    def name_map(self, mapping: Mapping[str, str], *, origin_module: str | None = None) -> None:
        """Rename identifiers in every object-sourced replacement and helper of this config.

        A key matches an identifier exactly or as a prefix (``{"Qwen3VL": "Qwen3VLMoe"}`` maps
        ``Qwen3VLTextModel`` to ``Qwen3VLMoeTextModel``); identifiers already carrying the new prefix are
        left alone. ``origin_module`` is the upstream module the reused code was written against: codegen
        reads it to prove that every renamed call keeps its keyword/field set, and refuses otherwise.
        """
        for old, new in mapping.items():
            if not old.isidentifier() or not new.isidentifier():
                raise PatchConfigError(f"name_map keys and values must be identifiers: {old!r} -> {new!r}")
            self.names[old] = new
        if origin_module is not None:
            self.name_map_origin = origin_module

    # -- edits inside upstream functions --------------------------------------------------------------------

    def _edit(self, kind: EditKind, where: str, anchor: str, code: str, count: int, description: str) -> None:
        desc = _require_description(description, f"{kind}({where!r})")
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise PatchConfigError(
                f"{kind}({where!r}): count is how often the anchor must match, >= 1; got {count!r}"
            )
        if not anchor.strip():
            raise PatchConfigError(f"{kind}({where!r}): the anchor is empty")
        target, _, method = where.partition(".")
        edit = Edit(kind, target, method or None, textwrap.dedent(anchor).strip(), textwrap.dedent(code).strip("\n"),
                    count, desc)  # fmt: skip
        for patch in self.patches:
            if patch.target == target and (patch.method is None or patch.method == edit.method):
                raise PatchConfigError(
                    f"{kind} on {edit.label!r} conflicts with earlier {patch.kind} {patch.label!r}"
                )
        self.edits.append(edit)

    def replace_call(self, where: str, callee: str, new: str, *, count: int = 1, description: str) -> None:
        """In function/method ``where`` (``"Cls.method"`` or ``"func"``), replace every call of ``callee``
        (a dotted name: ``"apply_rotary_pos_emb"``, ``"torch.cat"``) by the expression ``new``.

        In ``new``, ``__args__`` as an argument of a call stands for the matched call's arguments and
        ``__match__`` for the whole matched call: ``"apply_rope(self, __args__, apply_rotary_pos_emb)"``. It is
        an error (at generation) unless exactly ``count`` calls match.
        """
        if not all(part.isidentifier() for part in callee.split(".")):
            raise PatchConfigError(f"replace_call({where!r}): callee must be a dotted name, got {callee!r}")
        self._edit("replace_call", where, callee, new, count, description)

    def replace_expression(self, where: str, old: str, new: str, *, count: int = 1, description: str) -> None:
        """In ``where``, replace each expression equal to ``old`` (compared as syntax trees, so layout and
        parentheses do not matter) by ``new``, which may use ``__match__`` for the matched expression."""
        self._edit("replace_expression", where, old, new, count, description)

    def insert_before(self, where: str, anchor: str, code: str, *, count: int = 1, description: str) -> None:
        """In ``where``, insert the statements ``code`` before each statement matching ``anchor``.

        ``anchor`` is one whole simple statement (``"cos, sin = position_embeddings"``) or the header of a
        compound statement ending in ``:`` (``"if past_key_values is not None:"``), matched at any depth.
        """
        self._edit("insert_before", where, anchor, code, count, description)

    def insert_after(self, where: str, anchor: str, code: str, *, count: int = 1, description: str) -> None:
        """In ``where``, insert the statements ``code`` after each statement matching ``anchor``."""
        self._edit("insert_after", where, anchor, code, count, description)

    def replace_statement(
        self, where: str, anchor: str, code: str, *, count: int = 1, description: str
    ) -> None:
        """In ``where``, replace each statement matching ``anchor`` (a compound one with its whole body) by the
        statements ``code``; empty ``code`` deletes it."""
        self._edit("replace_statement", where, anchor, code, count, description)

    def wrap_statement(
        self, where: str, anchor: str, template: str, *, count: int = 1, description: str
    ) -> None:
        """In ``where``, wrap each statement matching ``anchor``: ``template`` is a compound statement with one
        line ``__body__`` standing for the matched statement (``"with torch.no_grad():\n    __body__"``)."""
        if BODY not in template:
            raise PatchConfigError(
                f"wrap_statement({where!r}): the template has no {BODY} line: {template!r}"
            )
        self._edit("wrap_statement", where, anchor, template, count, description)
