"""Data kinds by name: what ``data.kind`` selects, i.e. how a row becomes a token sample.

Built in: ``text``, ``conversation`` (`veomni.train.data.encode`), ``preference`` (chosen/rejected pairs,
`veomni.train.data.pairs`), ``multimodal`` (`veomni.train.data.encoders`:
the encoder the model's family declares), and ``dit`` / ``dit_latents``, which the dit task reads with its own
pipeline (`veomni.train.data.dit`). A user adds a kind without editing this package, either way:

- ``@register_data_kind("my_kind")`` on a factory in their own module (imported before the recipe is read, e.g.
  by the module of their ``model.task``), then ``data.kind: my_kind``;
- ``data.kind: my_pkg.data:MyEncoder`` (imported when the recipe is read).

A data kind's factory is called as ``factory(data, tokenizer, **options)``: ``data`` the recipe's data section
(`veomni.train.recipe.DataSection`), ``tokenizer`` the run's tokenizer, ``options`` the model-side inputs the task
gives that are set (`veomni.train.tasks.vision.VlmTask.data_options`; none for the text task). It returns an
encoder: ``columns`` / ``optional_columns`` (the row fields it reads), ``tokenizer``, and ``encoder(row, ref) ->
(input_ids int64 [n], trained bool [n])`` (``trained[0]`` False), raising `DataError` for a bad row. A kind trains
with the tasks whose ``data_kinds`` list it, and with those it names itself (``tasks``, default ``("text",)``).
docs/train.md ("Your own data kind") has a worked example; tests/train/test_data_kinds.py runs it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs

from veomni.train.data.sources import DataError


@attrs.frozen
class DataKind:
    """One ``data.kind``.

    Attributes:
        name: the ``data.kind`` value (a registered name or ``"package.module:attribute"``).
        factory: ``factory(data, tokenizer, **options) -> encoder`` (module docstring); None for a kind its task
            reads with its own pipeline (the dit kinds).
        tasks: task names (``model.task``) this kind trains with beyond the tasks whose ``data_kinds`` list it.
    """

    name: str
    factory: Callable[..., Any] | None
    tasks: tuple[str, ...] = ()


def _text(data: Any, tokenizer: Any, **options: Any) -> Any:
    from veomni.train.data.encode import build_encoder

    # Text rows have no images: a model-side vision layout would be silently unused.
    if options.get("vision_metadata") is not None:
        raise ValueError(
            f"a vision layout function was given for data.kind={data.kind!r}, which has no images"
        )
    if getattr(data, "format", None) == "pretokenized":
        from veomni.train.data.pretokenized import PretokenizedEncoder

        return PretokenizedEncoder(tokenizer)
    return build_encoder(
        tokenizer,
        data.kind,
        text_field=data.text_field,
        messages_field=data.messages_field,
        loss_mask_field=data.loss_mask_field,
        assistant_only_loss=data.assistant_only_loss,
        add_eos=data.add_eos,
    )


def _multimodal(data: Any, tokenizer: Any, **options: Any) -> Any:
    from veomni.train.data.encoders import multimodal_encoder

    return multimodal_encoder(data, tokenizer, **options)


def _preference(data: Any, tokenizer: Any, **options: Any) -> Any:
    from veomni.train.data.pairs import preference_encoder

    return preference_encoder(data, tokenizer, **options)


BUILTIN_DATA_KINDS: Mapping[str, DataKind] = {
    "text": DataKind("text", _text),
    "preference": DataKind("preference", _preference),
    "conversation": DataKind("conversation", _text),
    "multimodal": DataKind("multimodal", _multimodal),
    "dit": DataKind("dit", None),
    "dit_latents": DataKind("dit_latents", None),
}
"""veomni's data kinds (module docstring)."""

_REGISTERED: dict[str, DataKind] = {}

F = TypeVar("F", bound=Callable[..., Any])


def register_data_kind(name: str, *, tasks: tuple[str, ...] = ("text",)) -> Callable[[F], F]:
    """Decorator: make ``factory`` (a class or function, module docstring) the data kind ``data.kind: name``,
    trained with the tasks ``tasks`` (and any whose ``data_kinds`` list ``name``). A taken name is an error."""
    if not name or ":" in name:
        raise ValueError(
            f"register_data_kind: expected a plain name, found {name!r} (':' marks an import path)"
        )

    def register(factory: F) -> F:
        if name in BUILTIN_DATA_KINDS or name in _REGISTERED:
            taken = _REGISTERED.get(name) or BUILTIN_DATA_KINDS[name]
            raise ValueError(f"data kind {name!r} is already registered ({_describe(taken.factory)})")
        if not callable(factory):
            raise TypeError(f"register_data_kind({name!r}): expected a class or function, found {factory!r}")
        _REGISTERED[name] = DataKind(name, factory, tuple(tasks))
        return factory

    return register


def data_kind_names() -> list[str]:
    """Every registered data kind name (built in and `register_data_kind`'s), sorted."""
    return sorted({*BUILTIN_DATA_KINDS, *_REGISTERED})


def data_kind(name: str) -> DataKind:
    """The data kind ``name``: a registered name, or ``"package.module:attribute"`` (imported now; the attribute's
    ``tasks``, if it has one, lists the tasks it trains with, else ``("text",)``). Errors name the registered kinds,
    or what the import path holds instead."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name in BUILTIN_DATA_KINDS:
        return BUILTIN_DATA_KINDS[name]
    module_name, colon, attribute = name.partition(":")
    if not colon or not module_name or not attribute:
        raise ValueError(
            f"data.kind: expected one of {data_kind_names()} or a data kind as 'package.module:attribute', "
            f"found {name!r}"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"data.kind={name!r}: cannot import {module_name!r}: {err}") from err
    factory = getattr(module, attribute, None)
    if factory is None or not callable(factory):
        raise ValueError(f"data.kind={name!r}: {module_name} has no class or function {attribute!r}")
    tasks = getattr(factory, "tasks", ("text",))
    if isinstance(tasks, str) or not all(isinstance(t, str) for t in tasks):
        raise ValueError(f"data.kind={name!r}: its `tasks` must be a tuple of task names, found {tasks!r}")
    return DataKind(name, factory, tuple(tasks))


def build_row_encoder(data: Any, tokenizer: Any, **options: Any) -> Any:
    """The encoder of ``data.kind`` for this run: the kind's factory called with the recipe's data section, the
    tokenizer and the ``options`` that are set (module docstring)."""
    try:
        kind = data_kind(data.kind)
    except ValueError as err:
        raise DataError(str(err)) from None
    if kind.factory is None:
        raise DataError(
            f"data.kind={data.kind!r} rows are read by their task's own pipeline (model.task=dit), not a row encoder"
        )
    encoder = kind.factory(data, tokenizer, **{k: v for k, v in options.items() if v is not None})
    if not callable(encoder) or not hasattr(encoder, "columns"):
        raise DataError(
            f"data.kind={data.kind!r}: {_describe(kind.factory)} returned {type(encoder).__name__}, not an encoder "
            "(callable as encoder(row, ref) -> (input_ids, trained), with the `columns` it reads)"
        )
    return encoder


def _describe(factory: Any) -> str:
    if factory is None:
        return "read by its task's own pipeline"
    return f"{getattr(factory, '__module__', '?')}:{getattr(factory, '__qualname__', repr(factory))}"


__all__ = [
    "BUILTIN_DATA_KINDS",
    "DataKind",
    "build_row_encoder",
    "data_kind",
    "data_kind_names",
    "register_data_kind",
]
