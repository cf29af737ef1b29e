"""``patchgen`` command line: generate one config, list/generate all registered ones, or check drift."""

from __future__ import annotations

import argparse
import difflib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from . import registry
from .codegen import Generated, generate
from .config import PatchConfigError
from .loader import LoadedConfig, load_config
from .source import PatchgenError

EXIT_OK, EXIT_DRIFT, EXIT_ERROR = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="patchgen",
        description="Generate patched modeling files from installed upstream source plus a patch config.",
    )
    p.add_argument("config_module", nargs="?", help="dotted name of a patch-config module")
    p.add_argument("-o", "--output", type=Path, help="output directory (default: <config dir>/generated)")
    p.add_argument("-c", "--config-var", help="module attribute holding the PatchConfig (default: config)")
    p.add_argument("--diff", action="store_true", help="also print the unified diff against upstream")
    p.add_argument("--dry-run", action="store_true", help="print the generated module, write nothing")
    p.add_argument("-v", "--verbose", action="store_true", help="log every step")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--list", action="store_true", help="list registered config modules")
    mode.add_argument("--all", action="store_true", help="regenerate every registered config")
    mode.add_argument("--check", action="store_true", help="fail if a checked-in generated file drifted")
    p.add_argument("--fix", action="store_true", help="with --check: rewrite drifted files")
    return p


def output_paths(loaded: LoadedConfig, out_dir: Path | None = None) -> tuple[Path, Path]:
    """The generated module path and its ``.diff`` sibling."""
    target = (out_dir / loaded.config.target_file) if out_dir else loaded.default_output()
    return target, target.with_suffix(".diff")


def write_outputs(gen: Generated, py_path: Path, diff_path: Path) -> None:
    """Write the generated module and its diff (creating the directory)."""
    py_path.parent.mkdir(parents=True, exist_ok=True)
    py_path.write_text(gen.code, encoding="utf-8")
    diff_path.write_text(gen.diff, encoding="utf-8")


def _generate_one(name: str, args: argparse.Namespace) -> int:
    loaded = load_config(name, args.config_var)
    gen = generate(loaded.config, name)
    py_path, diff_path = output_paths(loaded, args.output)
    if args.dry_run:
        sys.stdout.write(gen.code)
    else:
        write_outputs(gen, py_path, diff_path)
        print(f"wrote {py_path} and {diff_path.name}")
    if args.diff:
        sys.stdout.write(gen.diff)
    for w in gen.warnings:
        print(f"warning: {w}", file=sys.stderr)
    return EXIT_OK


def _drift(path: Path, expected: str) -> str | None:
    if not path.exists():
        return f"{path}: missing"
    actual = path.read_text(encoding="utf-8")
    if actual == expected:
        return None
    excerpt = "".join(
        list(
            difflib.unified_diff(actual.splitlines(True), expected.splitlines(True), str(path), "regenerated")
        )[:40]
    )
    return f"{path}: differs from regeneration\n{excerpt}"


def _orphans(produced: set[Path]) -> list[Path]:
    """Module/diff files in the generated directories that no registered config writes.

    ``generated/`` is patchgen's alone: a file left there by a renamed ``target_file`` stays importable but is
    never regenerated, so ``--check`` would otherwise call a stale module up to date.
    """
    found = set()
    for directory in {p.parent for p in produced}:
        found |= {
            p
            for p in directory.iterdir()
            if p.suffix in (".py", ".diff") and p.is_file() and p.name != "__init__.py"
        }
    return sorted(found - produced)


def _check(names: Sequence[str], fix: bool) -> int:
    if not names:
        print(
            "patchgen --check: no registered configs (patchgen.registry.CONFIG_MODULES is empty); "
            "nothing to check"
        )
        return EXIT_OK
    drifted: list[str] = []
    produced: set[Path] = set()
    for name in names:
        loaded = load_config(name)
        gen = generate(loaded.config, name)
        py_path, diff_path = output_paths(loaded)
        produced |= {py_path, diff_path}
        problems = [d for d in (_drift(py_path, gen.code), _drift(diff_path, gen.diff)) if d]
        if problems and fix:
            write_outputs(gen, py_path, diff_path)
            print(f"fixed {py_path}")
        elif problems:
            drifted += problems
        else:
            print(f"ok {py_path}")
    for orphan in _orphans(produced):
        if fix:
            orphan.unlink()
            print(f"removed {orphan}")
        else:
            drifted.append(f"{orphan}: not produced by any registered config (an old target_file?)")
    if drifted:
        print("patchgen --check: generated files drifted from their configs:", file=sys.stderr)
        for d in drifted:
            print(d, file=sys.stderr)
        print(
            "Regenerate with `patchgen --check --fix` (never edit generated files by hand).", file=sys.stderr
        )
        return EXIT_DRIFT
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 1 drift, 2 error)."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s"
    )
    names = registry.registered_configs()
    try:
        if args.list:
            for name in names:
                print(name)
            if not names:
                print("(no registered configs)", file=sys.stderr)
            return EXIT_OK
        if args.check:
            return _check(names, args.fix)
        if args.fix:
            raise PatchgenError("--fix only works with --check")
        if args.all:
            for name in names:
                _generate_one(name, args)
            return EXIT_OK
        if not args.config_module:
            _parser().print_usage(sys.stderr)
            print("patchgen: error: give a CONFIG_MODULE, or --list/--all/--check", file=sys.stderr)
            return EXIT_ERROR
        return _generate_one(args.config_module, args)
    except (PatchgenError, PatchConfigError) as exc:
        print(f"patchgen: error: {exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
