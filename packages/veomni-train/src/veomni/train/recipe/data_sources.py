"""``data.sources``: a mixture of datasets, each a mapping checked here (the recipe parser sees a list of dicts).

An entry names its rows (``files`` or ``dataset``, as ``data.train_files`` / ``data.dataset``), its share
(``weight`` or ``epochs``; every source gives the same one of them) and, optionally, what differs from the data
section for it (``format``, ``columns``, ``kind``, ``file_format``, ``text_field``, ``messages_field``,
``loss_mask_field``). Each source is then validated as a whole data section of its own (`source_section`), so a
source's errors are the ones a single dataset would get, prefixed with the source.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable
from typing import Any

import attrs

from veomni.train.recipe.parse import RecipeError

OVERRIDES = ("format", "columns", "kind", "file_format", "text_field", "messages_field", "loss_mask_field")
"""Data-section fields a source may set for itself."""
SOURCE_KEYS = ("name", "files", "dataset", "weight", "epochs", *OVERRIDES)


def resolve_source_paths(value: Any, resolve: Callable[[Any], Any]) -> Any:
    """``data.sources`` with each source's ``files`` and ``dataset`` paths made absolute (as the data section's)."""
    from veomni.train.recipe.data_section import resolve_dataset_paths

    if not isinstance(value, tuple):
        return value
    out = []
    for entry in value:
        entry = dict(entry)
        if isinstance(entry.get("files"), list | tuple):
            entry["files"] = [resolve(f) if isinstance(f, str) else f for f in entry["files"]]
        if isinstance(entry.get("dataset"), dict):
            entry["dataset"] = resolve_dataset_paths(entry["dataset"], resolve)
        out.append(entry)
    return tuple(out)


def source_section(data: Any, i: int) -> Any:
    """The data section of source ``i`` alone: the mixture's section with the source's rows and overrides, and
    no sources (validated as any data section is)."""
    entry = data.sources[i]
    overrides = {k: entry[k] for k in OVERRIDES if k in entry}
    if "columns" in overrides and not isinstance(overrides["columns"], dict):
        raise RecipeError(f"columns: expected a mapping, found {overrides['columns']!r}")
    return attrs.evolve(
        data,
        sources=(),
        train_files=tuple(entry.get("files") or ()),
        dataset=entry.get("dataset"),
        **overrides,
    )


def check_sources(data: Any) -> None:
    """Every entry of ``data.sources`` well formed (module docstring); a `RecipeError` naming the source."""
    names: list[str] = []
    shares, multimodal = set(), set()
    for i, entry in enumerate(data.sources):
        where = f"data.sources[{i}]"
        if not isinstance(entry, dict):
            raise RecipeError(f"{where}: expected a mapping, found {entry!r}")
        for key in entry:
            if key not in SOURCE_KEYS:
                close = difflib.get_close_matches(key, SOURCE_KEYS, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else f"; known: {list(SOURCE_KEYS)}"
                raise RecipeError(f"{where}: unknown key {key!r}{hint}")
        name = entry.get("name")
        if not isinstance(name, str) or not name or "/" in name:
            raise RecipeError(
                f"{where}: needs a name (a string without '/', used in the metrics), found {name!r}"
            )
        if name in names:
            raise RecipeError(f"{where}: the name {name!r} is taken by data.sources[{names.index(name)}]")
        names.append(name)
        where = f"{where} ({name})"
        if ("files" in entry) == ("dataset" in entry):
            raise RecipeError(
                f"{where}: give its rows as files (a list) or dataset (load_dataset's arguments), one"
            )
        if "files" in entry and (not isinstance(entry["files"], list | tuple) or not entry["files"]):
            raise RecipeError(f"{where}: files must be a non-empty list, found {entry['files']!r}")
        if "dataset" in entry and isinstance(entry["dataset"], dict) and entry["dataset"].get("streaming"):
            raise RecipeError(f"{where}: a streaming dataset cannot be mixed (it has no index to plan from)")
        share = [k for k in ("weight", "epochs") if k in entry]
        if len(share) != 1:
            raise RecipeError(
                f"{where}: give weight (a share of the tokens) or epochs (passes per round), one"
            )
        value = entry[share[0]]
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value <= 0
        ):
            raise RecipeError(f"{where}: {share[0]} must be a positive number, found {value!r}")
        shares.add(share[0])
        try:
            section = source_section(data, i)
        except RecipeError as err:
            raise RecipeError(f"{where}: {err}") from None
        multimodal.add(section.kind == "multimodal")
    if len(multimodal) > 1:
        raise RecipeError(
            "data.sources: a mixture is multimodal throughout or not at all: its batches are collated one way "
            "(give the text sources data.kind multimodal too; their rows train without media)"
        )
    if len(shares) > 1:
        raise RecipeError("data.sources: every source gives weight, or every source gives epochs; found both")
