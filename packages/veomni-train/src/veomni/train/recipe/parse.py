"""Strict loading of a tree of frozen attrs classes from plain data and command-line overrides.

Generic machinery behind `veomni.train.recipe`: it knows nothing about the recipe's sections. A *tree* is an
attrs class whose fields are either nested attrs classes (sections) or leaves of the supported types: bool, int,
float, str, dict, ``Literal[...]``, ``tuple[X, ...]`` / ``tuple[X, Y]`` (lists in YAML) and unions with None.
Leaf metadata: ``help`` (one line), ``required`` (no default), ``path`` (run through the caller's resolver;
``path="hub"``: called with ``hub_ids=True``, for fields that may also name a Hugging Face Hub repository; a
callable ``path``: called as ``path(value, resolver)``, for values holding paths among other things).
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import attrs
import yaml


class RecipeError(ValueError):
    """A recipe that cannot be loaded: unknown keys, wrong types, missing or inconsistent values."""


def iter_fields(cls: type, prefix: str = "") -> list[tuple[str, attrs.Attribute]]:
    """Every leaf field of the tree rooted at ``cls`` as ``(dotted key, attrs attribute)``, in declaration order."""
    out: list[tuple[str, attrs.Attribute]] = []
    hints = typing.get_type_hints(cls)
    for field in attrs.fields(cls):
        tp = hints[field.name]
        if attrs.has(tp):
            out.extend(iter_fields(tp, f"{prefix}{field.name}."))
        else:
            out.append((f"{prefix}{field.name}", field))
    return out


def field_type(cls: type, dotted: str) -> Any:
    """The annotated type of the leaf ``dotted`` (``"optim.lr"`` -> float) below ``cls``."""
    *sections, leaf = dotted.split(".")
    for section in sections:
        cls = typing.get_type_hints(cls)[section]
    return typing.get_type_hints(cls)[leaf]


def build(cls: type, raw: Any, resolve_path: Callable[[Any], Any]) -> Any:
    """Build and validate ``cls`` from nested plain data, reporting every problem at once.

    Raises:
        RecipeError: one line per problem (unknown keys with a did-you-mean, wrong types, missing fields,
            failed validators).
    """
    problems: list[str] = []
    values = _build_fields(cls, raw, "", problems, cls, resolve_path)
    if not problems:
        try:
            return cls(**values)
        except RecipeError as err:
            problems.append(str(err))
    raise RecipeError("\n".join(f"  - {p}" for p in problems))


def _build_fields(
    cls: type, raw: Any, prefix: str, problems: list[str], root: type, resolve_path: Callable[[Any], Any]
) -> dict[str, Any]:
    where = prefix.rstrip(".") or "the top level"
    if not isinstance(raw, Mapping):
        problems.append(f"{where}: expected a mapping, found {type(raw).__name__} {raw!r}")
        return {}
    fields = {f.name: f for f in attrs.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in raw:
        if key not in fields:
            problems.append(f"unknown key {prefix}{key}{_did_you_mean(f'{prefix}{key}', root)}")
    values: dict[str, Any] = {}
    for name, field in fields.items():
        key = f"{prefix}{name}"
        if name not in raw:
            if field.metadata.get("required"):
                problems.append(f"{key}: required, missing")
            continue
        tp = hints[name]
        if attrs.has(tp):
            before = len(problems)
            section = {} if raw[name] is None else raw[name]
            sub = _build_fields(tp, section, f"{key}.", problems, root, resolve_path)
            if len(problems) == before:  # run a section's validators only when its fields are sound
                try:
                    values[name] = tp(**sub)
                except RecipeError as err:
                    problems.append(str(err))
            continue
        try:
            value = convert(raw[name], tp, key)
            path_kind = field.metadata.get("path")
            if callable(path_kind):
                value = path_kind(value, resolve_path)
            elif path_kind == "hub":
                value = resolve_path(value, hub_ids=True)
            elif path_kind:
                value = resolve_path(value)
            values[name] = value
        except RecipeError as err:
            problems.append(str(err))
    return values


def _did_you_mean(dotted: str, root: type, dashes: str = "") -> str:
    """`` (did you mean X?)`` for an unknown dotted key, or the keys known at that level."""
    known = [k for k, _ in iter_fields(root)] + [f.name for f in attrs.fields(root)]
    leaf = dotted.rsplit(".", 1)[-1]
    section = dotted.rsplit(".", 1)[0] + "." if "." in dotted else ""
    siblings = [k for k in known if k.startswith(section) and "." not in k[len(section) :]]
    # A one-letter slip of a name in the same section first (optim.beta -> optim.betas, not dpo.beta), then the
    # same field name in another section (train.lr -> optim.lr), then a close name in the same section, then
    # anything close.
    by_leaf = {k[len(section) :]: k for k in siblings}
    close = [by_leaf[m] for m in difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.85)]
    close = close or [k for k in known if k.rsplit(".", 1)[-1] == leaf and k != dotted]
    close = close or difflib.get_close_matches(dotted, siblings, n=1, cutoff=0.6)
    close = close or difflib.get_close_matches(dotted, known, n=1, cutoff=0.6)
    if close:
        return f" (did you mean {dashes}{close[0]}?)"
    return f"; known here: {sorted(k[len(section) :] for k in siblings)}"


# --- typed conversion -------------------------------------------------------------------------------------------


def type_name(tp: Any) -> str:
    """A short human name of a field type (``list[str]``, ``'cosine' | 'linear'``, ``int | null``)."""
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        args = typing.get_args(tp)
        if args[-1] is Ellipsis:
            return f"list[{type_name(args[0])}]"
        return f"list of {len(args)} {type_name(args[0])}"
    return getattr(tp, "__name__", str(tp))


def _found(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def convert(value: Any, tp: Any, key: str) -> Any:
    """Check a plain value (from YAML or `parse_cli_value`) against the type ``tp``; lists become tuples.

    Raises:
        RecipeError: naming ``key``, the expected type and what was found.
    """
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is not type(None):
                try:
                    return convert(value, arg, key)
                except RecipeError:
                    continue
        raise RecipeError(f"{key}: expected {type_name(tp)}, found {_found(value)}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value in choices and type(value) is type(choices[choices.index(value)]):
            return value
        if isinstance(value, bool):
            # YAML 1.1 reads a bare on/off (yes/no) as a bool: `compile: off` means the choice 'off'.
            words = [w for w in (("on", "yes", "true") if value else ("off", "no", "false")) if w in choices]
            if words:
                return words[0]
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise RecipeError(f"{key}: expected one of {list(choices)}, found {value!r}{hint}")
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise RecipeError(f"{key}: expected {type_name(tp)}, found {_found(value)}")
        args = typing.get_args(tp)
        if args[-1] is Ellipsis:
            return tuple(convert(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise RecipeError(f"{key}: expected {type_name(tp)}, found {len(value)} items {list(value)!r}")
        return tuple(convert(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True)))
    if _matches_scalar(value, tp):
        return float(value) if tp is float else value
    if tp is float and isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if tp not in (bool, int, float, str, dict):
        raise TypeError(f"recipe field {key} has an unsupported type {tp!r}")
    raise RecipeError(f"{key}: expected {type_name(tp)}, found {_found(value)}")


def _matches_scalar(value: Any, tp: Any) -> bool:
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if tp is dict:
        return isinstance(value, dict) and all(isinstance(k, str) for k in value)
    return False


_NULLS = {"null", "none", "~"}
_YAML_BOOLS = {"true": True, "yes": True, "on": True, "false": False, "no": False, "off": False}
_BOOLS = {
    "true": True,
    "yes": True,
    "on": True,
    "1": True,
    "false": False,
    "no": False,
    "off": False,
    "0": False,
}


def parse_cli_value(text: str, tp: Any, key: str) -> Any:
    """Parse a command-line string for a field of type ``tp`` into the plain value `convert` expects.

    ``null``/``none``/``~`` is None for optional fields; bools take true/false/yes/no/on/off/1/0; lists take
    ``a,b,c`` or a flow list ``[a, b]``; dict fields take a YAML/JSON flow mapping ``{a: 1}``.
    """
    origin = typing.get_origin(tp)
    stripped = text.strip()
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if type(None) in args and stripped.lower() in _NULLS:
            return None
        if dict in args and stripped.startswith("{"):
            return parse_flow(text, key)
        for arg in args:
            if arg is not type(None):
                try:
                    return convert(parse_cli_value(text, arg, key), arg, key)
                except RecipeError:
                    continue
        raise RecipeError(f"{key}: expected {type_name(tp)}, found {text!r}")
    if origin is tuple:
        if stripped.startswith("["):
            items = parse_flow(stripped, key)
            if not isinstance(items, list):
                raise RecipeError(f"{key}: expected {type_name(tp)}, found {text!r}")
            return items
        args = typing.get_args(tp)
        parts = [p.strip() for p in stripped.split(",")] if stripped else []
        item_types = [args[0]] * len(parts) if args[-1] is Ellipsis else list(args)
        if len(item_types) != len(parts):
            raise RecipeError(f"{key}: expected {type_name(tp)}, found {len(parts)} items in {text!r}")
        return [
            parse_cli_value(p, t, f"{key}[{i}]")
            for i, (p, t) in enumerate(zip(parts, item_types, strict=True))
        ]
    if tp is bool:
        if stripped.lower() in _BOOLS:
            return _BOOLS[stripped.lower()]
        raise RecipeError(f"{key}: expected true or false, found {text!r}")
    if tp is int:
        try:
            return int(stripped)
        except ValueError:
            raise RecipeError(f"{key}: expected an int, found {text!r}") from None
    if tp is float:
        try:
            return float(stripped)
        except ValueError:
            raise RecipeError(f"{key}: expected a float, found {text!r}") from None
    if tp is dict:
        return parse_flow(text, key)
    bool_words = {w for w in _YAML_BOOLS if w in typing.get_args(tp)} if origin is Literal else set()
    if bool_words and stripped not in typing.get_args(tp) and stripped.lower() in _YAML_BOOLS:
        # What YAML reads as a bool in a file (`compile: false`), `convert` maps to the choice of that meaning;
        # for choices with no such word the typed text stays, so an error quotes what was typed.
        return _YAML_BOOLS[stripped.lower()]
    return text  # str and Literal (checked by convert)


class _Loader(yaml.SafeLoader):
    """Safe YAML that also reads ``1e-4`` and ``1e6`` as floats (YAML 1.2 does; PyYAML's 1.1 needs a dot)."""


class _Dumper(yaml.SafeDumper):
    """Block mappings and flow lists (reads like a hand-written recipe); quotes what `_Loader` would misread."""


_EXP_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _EXP_FLOAT, list("-+0123456789"))
_Dumper.add_implicit_resolver("tag:yaml.org,2002:float", _EXP_FLOAT, list("-+0123456789"))
_Dumper.add_representer(
    list, lambda dumper, data: dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True)
)


def dump_yaml(data: Any) -> str:
    """YAML text that `load_yaml` reads back to ``data`` (keys in insertion order)."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=110)


def load_yaml(text: str) -> Any:
    """Parse YAML text safely, with exponent floats (see `_Loader`)."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader


def parse_flow(text: str, key: str) -> Any:
    """YAML (hence also JSON) parse of one override value."""
    try:
        return load_yaml(text)
    except yaml.YAMLError as err:
        raise RecipeError(f"{key}: cannot parse {text!r} as YAML/JSON: {err}") from None


# --- overrides --------------------------------------------------------------------------------------------------


def split_overrides(items: Sequence[str]) -> list[tuple[str, str]]:
    """``["--a.b=1", "--c.d", "2"]`` -> ``[("a.b", "1"), ("c.d", "2")]``; anything else is a RecipeError."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(items):
        item = items[i]
        if not item.startswith("--") or len(item) == 2:
            raise RecipeError(f"override {item!r}: expected --section.field=value or --section.field value")
        body = item[2:]
        if "=" in body:
            key, value = body.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(items):
                raise RecipeError(f"override {item!r} has no value (expected --{body}=VALUE)")
            key, value = body, items[i + 1]
            i += 2
        pairs.append((key, value))
    return pairs


def apply_overrides(root: type, raw: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of the nested ``raw`` data with each ``--section.field=value`` override set, typed.

    A key below a dict-typed field whose value is a mapping (``--model.config.num_hidden_layers=2``) sets that
    entry of the mapping, its value parsed as YAML.
    """
    known = dict(iter_fields(root))
    out: dict[str, Any] = {k: dict(v) if isinstance(v, Mapping) else v for k, v in raw.items()}
    for key, text in split_overrides(overrides):
        inline = _inline_mapping_entry(root, out, key, known)
        if inline is not None:
            mapping, entry = inline
            mapping[entry] = parse_flow(text, key)
            continue
        if key not in known:
            raise RecipeError(
                f"unknown override --{key}{_did_you_mean(key, root, '--')}; --help lists every field"
            )
        tp = field_type(root, key)
        value = convert(parse_cli_value(text, tp, key), tp, key)
        *sections, leaf = key.split(".")
        target = out
        for section in sections:
            if target.get(section) is None:
                target[section] = {}
            if not isinstance(target[section], dict):
                raise RecipeError(f"{section}: expected a mapping, found {_found(target[section])}")
            target = target[section]
        target[leaf] = to_plain(value)
    return out


def _inline_mapping_entry(
    root: type, out: dict[str, Any], key: str, known: Mapping[str, attrs.Attribute]
) -> tuple[dict[str, Any], str] | None:
    """For a key below a known dict-typed leaf: (a fresh copy of the nested mapping to edit, entry name)."""
    parts = key.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        leaf = ".".join(parts[:cut])
        if leaf in known:
            break
    else:
        return None
    if dict not in (field_type(root, leaf), *typing.get_args(field_type(root, leaf))):
        return None
    holder: Any = out
    for section in parts[: cut - 1]:
        holder = holder.get(section) if isinstance(holder, dict) else None
    current = holder.get(parts[cut - 1]) if isinstance(holder, dict) else None
    if current is None and isinstance(holder, dict) and parts[cut - 1] not in holder:
        # Not in the recipe file: the field's default mapping (e.g. model.config_overrides' {}) takes the entry.
        default = known[leaf].default
        default = default.factory() if isinstance(default, attrs.Factory) else default  # type: ignore[arg-type]
        current = dict(default) if isinstance(default, dict) else None
    if not isinstance(current, dict):
        raise RecipeError(
            f"override --{key}: {leaf} is not an inline mapping here (found {current!r}), so it has no entry to set"
        )
    mapping = dict(current)
    holder[parts[cut - 1]] = mapping
    if known[leaf].metadata.get("dotted_keys"):
        # Keys that are dotted names themselves (optim.lr_multipliers' module globs): the rest is one key.
        return mapping, ".".join(parts[cut:])
    for part in parts[cut:-1]:
        inner = mapping.get(part)
        mapping[part] = dict(inner) if isinstance(inner, dict) else {}
        mapping = mapping[part]
    return mapping, parts[-1]


# --- output -----------------------------------------------------------------------------------------------------


def to_plain(value: Any) -> Any:
    """Nested plain data: attrs trees become dicts and tuples become lists (what YAML writes)."""
    if attrs.has(type(value)):
        return {f.name: to_plain(getattr(value, f.name)) for f in attrs.fields(type(value))}
    if isinstance(value, tuple | list):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    return value


def help_text(root: type, title: str) -> str:
    """Every leaf field with its type, default and help line, grouped by section."""
    lines = [title]
    current = None
    for key, field in iter_fields(root):
        section = key.rsplit(".", 1)[0] if "." in key else ""
        if section != current:
            current = section
            lines.append(f"\n{section}:")
        if field.metadata.get("required"):
            default = "required"
        else:
            value = field.default.factory() if isinstance(field.default, attrs.Factory) else field.default
            default = f"default {to_plain(value)!r}"
        lines.append(f"  --{key}  ({type_name(field_type(root, key))}; {default})")
        lines.append(f"      {field.metadata.get('help', '')}")
    return "\n".join(lines) + "\n"
