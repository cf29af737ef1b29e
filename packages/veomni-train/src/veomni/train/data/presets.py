"""Format presets (``data.format``): the row shapes users have, converted to the rows ``data.kind`` encodes.

A preset names the columns it reads (canonical names, renamed per dataset by ``data.columns``) and converts each
row as it is read (`FormattedSource`), so the encoders, the index and the preview see the native rows of their
kind: ``{data.messages_field: [{"role", "content"}, ...]}`` plus the row's top-level media lists for
``conversation`` and ``multimodal``, ``{data.text_field: str}`` for ``text``. Errors name the file, the row and the
preset. The presets:

- ``sharegpt``: ``{"conversations": [{"from": "human" | "gpt" | "system" | "observation" | ..., "value"}],
  "system"?}``, media lists (``images`` ...) kept for ``multimodal``;
- ``alpaca``: ``{"instruction", "input"?, "output", "system"?, "history"?: [[prompt, answer], ...]}``;
- ``openai``: ``{"messages": [{"role", "content": str | [parts], "weight"?: 0 | 1}]}`` (``weight``, OpenAI's
  per-message training switch, becomes ``data.loss_mask_field``; text parts are joined for ``conversation``);
- ``llava``: ``{"image"? | "images"?, "conversations": [{"from", "value"}]}`` with ``<image>`` marking the image:
  multimodal rows with the image in place (``data.kind: multimodal`` only: LLaVA rows never train as text);
- ``messages``: the native conversation row (``data.messages_field``);
- ``text``: the native text row (``data.text_field``);
- ``pretokenized``: ``{"input_ids", "labels"? | "loss_mask"?}``, encoded without the tokenizer
  (`veomni.train.data.pretokenized`).

In ``conversation`` data a ``<image>``, ``<video>`` or ``<audio>`` placeholder is refused: such a row is
multimodal, and training its text would drop the medium without a word.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from veomni.train.data.row_formats import MEDIA_COLUMNS, PLACEHOLDER, native_row
from veomni.train.data.sources import DataError, RowRef, RowSource

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "function_call": "assistant",
    "observation": "tool",
    "tool": "tool",
}
OPENAI_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


@attrs.frozen
class RowFormat:
    """How one dataset's rows are converted: its preset, the column of each canonical name, and the target rows.

    Attributes:
        preset: the ``data.format`` name.
        names: canonical name -> the dataset's column (or message key) for every name ``data.columns`` renames.
        messages_field, text_field: the keys of the converted rows (``data.messages_field``, ``data.text_field``).
        loss_mask_field: ``data.loss_mask_field`` (where an ``openai`` message's ``weight`` goes).
        multimodal: whether the rows feed ``data.kind: multimodal`` (media kept) or text-only data.
    """

    preset: str
    names: Mapping[str, str]
    messages_field: str = "messages"
    text_field: str = "text"
    loss_mask_field: str | None = "loss_mask"
    multimodal: bool = False

    def name(self, canonical: str) -> str:
        """The dataset's name for the canonical column or message key ``canonical``."""
        if canonical in self.names:
            return self.names[canonical]
        # The native presets read the fields the kind reads unless data.columns renames them.
        return {"messages": self.messages_field, "text": self.text_field}.get(canonical, canonical)

    @property
    def columns(self) -> tuple[str, ...]:
        """Columns every row must have (a parquet file lacking one is refused when opened)."""
        return tuple(self.name(c) for c in PRESETS[self.preset].required)

    @property
    def optional_columns(self) -> tuple[str, ...]:
        """Columns read where a file has them."""
        return tuple(self.name(c) for c in PRESETS[self.preset].optional)

    def convert(self, row: dict[str, Any], ref: RowRef) -> dict[str, Any]:
        """``row`` as the native row of its kind; a `DataError` naming ``ref`` and the preset otherwise."""
        return PRESETS[self.preset].convert(row, self, _Where(ref, self.preset))


@attrs.frozen
class _Where:
    """A row's place for error messages: ``<file> line N: <what> (data.format: <preset>)``."""

    ref: RowRef
    preset: str

    def error(self, what: str) -> DataError:
        return DataError(f"{self.ref}: {what} (data.format: {self.preset})")


@attrs.frozen
class Preset:
    """One ``data.format``: the canonical columns it reads, the data kinds it feeds, and its conversion.

    Attributes:
        required: row columns every row must have.
        optional: row columns read where present.
        message_keys: keys inside each message that ``data.columns`` may rename too (``from``, ``value``, ...).
        kinds: the built-in ``data.kind`` values the converted rows are for.
        convert: ``convert(row, row_format, where) -> native row``.
    """

    required: tuple[str, ...]
    optional: tuple[str, ...]
    message_keys: tuple[str, ...]
    kinds: tuple[str, ...]
    convert: Callable[[dict[str, Any], RowFormat, _Where], dict[str, Any]]

    @property
    def names(self) -> tuple[str, ...]:
        """Every canonical name ``data.columns`` may map."""
        return (*self.required, *self.optional, *self.message_keys)


def _column(row: dict[str, Any], fmt: RowFormat, canonical: str, where: _Where) -> Any:
    """The value of a required column, or an error listing the columns the row has."""
    key = fmt.name(canonical)
    value = row.get(key)
    if value is None:
        present = sorted(k for k, v in row.items() if v is not None)
        renamed = f" ({canonical!r} renamed by data.columns)" if key != canonical else ""
        raise where.error(f"no column {key!r}{renamed}; the row has {present}; data.columns maps others")
    return value


def _text(value: Any, what: str, where: _Where, optional: bool = False) -> str:
    if optional and value is None:
        return ""
    if not isinstance(value, str):
        raise where.error(f"{what} must be a string, found {type(value).__name__} {value!r:.60}")
    return value


def _media(row: dict[str, Any], fmt: RowFormat) -> dict[str, Any]:
    """The row's top-level media columns under their canonical names, where present (`native_row` and
    `veomni.train.data.row_formats.refuse_media` read them)."""
    return {key: row[fmt.name(key)] for key in MEDIA_COLUMNS if row.get(fmt.name(key)) is not None}


def _finish(
    messages: list[dict[str, Any]], row: dict[str, Any], fmt: RowFormat, where: _Where
) -> dict[str, Any]:
    """The converted conversation row; text-only data refuses media placeholders (the module docstring)."""
    if not fmt.multimodal:
        for i, message in enumerate(messages):
            content = message.get("content")
            found = PLACEHOLDER.search(content) if isinstance(content, str) else None
            if found:
                raise where.error(
                    f"message {i} holds a {found.group(0)} placeholder, but data.kind is conversation, which trains "
                    "text only and would drop the medium; use data.kind: multimodal with a vlm or omni model"
                )
    return {fmt.messages_field: messages, **_media(row, fmt)}


def _speaker_messages(raw: Any, fmt: RowFormat, where: _Where, what: str) -> list[dict[str, Any]]:
    """ShareGPT / LLaVA ``{"from", "value"}`` messages as ``{"role", "content"}`` (other keys kept)."""
    if not isinstance(raw, list) or not raw:
        raise where.error(f"{what} must be a non-empty list of messages, found {raw!r:.80}")
    speaker_key, value_key = fmt.name("from"), fmt.name("value")
    messages = []
    for i, message in enumerate(raw):
        if not isinstance(message, dict):
            raise where.error(f"message {i} must be an object, found {type(message).__name__}")
        speaker = message.get(speaker_key)
        if speaker not in SHAREGPT_ROLES:
            raise where.error(
                f"message {i} has {speaker_key}={speaker!r}; expected one of {sorted(SHAREGPT_ROLES)}"
            )
        content = _text(message.get(value_key), f"message {i} {value_key!r}", where)
        rest = {k: v for k, v in message.items() if k not in (speaker_key, value_key)}
        messages.append({**rest, "role": SHAREGPT_ROLES[speaker], "content": content})
    return messages


def _system(row: dict[str, Any], fmt: RowFormat, where: _Where) -> list[dict[str, Any]]:
    """A system message from the row's ``system`` column, when it holds a non-empty string."""
    system = _text(row.get(fmt.name("system")), f"column {fmt.name('system')!r}", where, optional=True)
    return [{"role": "system", "content": system}] if system else []


def _sharegpt(row: dict[str, Any], fmt: RowFormat, where: _Where) -> dict[str, Any]:
    conversations = _column(row, fmt, "conversations", where)
    messages = _speaker_messages(conversations, fmt, where, f"column {fmt.name('conversations')!r}")
    if messages[0]["role"] == "system" and row.get(fmt.name("system")):
        raise where.error(f"both a system message and a {fmt.name('system')!r} column; give one")
    return _finish([*_system(row, fmt, where), *messages], row, fmt, where)


def _llava(row: dict[str, Any], fmt: RowFormat, where: _Where) -> dict[str, Any]:
    messages = _speaker_messages(
        _column(row, fmt, "conversations", where), fmt, where, f"column {fmt.name('conversations')!r}"
    )
    # The image goes where its <image> placeholder is: native_row puts each medium of the row's lists in place.
    try:
        return native_row({fmt.messages_field: messages, **_media(row, fmt)}, fmt.messages_field, where.ref)
    except DataError as err:
        raise DataError(f"{err} (data.format: {where.preset})") from None


def _alpaca(row: dict[str, Any], fmt: RowFormat, where: _Where) -> dict[str, Any]:
    instruction = _text(_column(row, fmt, "instruction", where), f"column {fmt.name('instruction')!r}", where)
    extra = _text(row.get(fmt.name("input")), f"column {fmt.name('input')!r}", where, optional=True)
    output = _text(_column(row, fmt, "output", where), f"column {fmt.name('output')!r}", where)
    history = row.get(fmt.name("history")) or []
    if not isinstance(history, list):
        raise where.error(f"column {fmt.name('history')!r} must be a list of [prompt, answer] pairs")
    messages = _system(row, fmt, where)
    for i, turn in enumerate(history):
        if not (isinstance(turn, list | tuple) and len(turn) == 2 and all(isinstance(t, str) for t in turn)):
            raise where.error(
                f"history turn {i} must be a [prompt, answer] pair of strings, found {turn!r:.80}"
            )
        messages += [{"role": "user", "content": turn[0]}, {"role": "assistant", "content": turn[1]}]
    # LLaMA-Factory's and Stanford Alpaca's joining: the input follows the instruction on a new line.
    prompt = f"{instruction}\n{extra}" if extra else instruction
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]
    return _finish(messages, row, fmt, where)


def _openai(row: dict[str, Any], fmt: RowFormat, where: _Where) -> dict[str, Any]:
    raw = _column(row, fmt, "messages", where)
    if not isinstance(raw, list) or not raw:
        raise where.error(
            f"column {fmt.name('messages')!r} must be a non-empty list of messages, found {raw!r:.80}"
        )
    role_key, content_key = fmt.name("role"), fmt.name("content")
    messages = []
    for i, message in enumerate(raw):
        if not isinstance(message, dict):
            raise where.error(f"message {i} must be an object, found {type(message).__name__}")
        role = message.get(role_key)
        if role not in OPENAI_ROLES:
            raise where.error(f"message {i} has {role_key}={role!r}; expected one of {sorted(OPENAI_ROLES)}")
        content = message.get(content_key)
        if content is None and message.get("tool_calls"):
            content = ""  # an assistant turn that only calls tools; its template renders the calls
        if isinstance(content, list) and not fmt.multimodal and all(_is_text_part(p) for p in content):
            content = "".join(p["text"] for p in content)
        rest = {k: v for k, v in message.items() if k not in (role_key, content_key, "weight")}
        out = {**rest, "role": OPENAI_ROLES[role], "content": content}
        if message.get("weight") is not None:
            if message["weight"] not in (0, 1) or fmt.loss_mask_field is None:
                raise where.error(
                    f"message {i} has weight={message['weight']!r}; expected 0 or 1, read as "
                    f"data.loss_mask_field ({fmt.loss_mask_field!r}), which must be set"
                )
            out[fmt.loss_mask_field] = int(message["weight"])
        messages.append(out)
    return _finish(messages, row, fmt, where)


def _is_text_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


def _messages(row: dict[str, Any], fmt: RowFormat, where: _Where) -> dict[str, Any]:
    raw = _column(row, fmt, "messages", where)
    role_key, content_key = fmt.name("role"), fmt.name("content")
    if not isinstance(raw, list):
        return {fmt.messages_field: raw, **_media(row, fmt)}  # the encoder names what a message list must be
    messages = [
        {
            **{k: v for k, v in m.items() if k not in (role_key, content_key)},
            "role": m.get(role_key),
            "content": m.get(content_key),
        }
        if isinstance(m, dict)
        else m
        for m in raw
    ]
    return _finish(messages, row, fmt, where)


def _plain_text(row: dict[str, Any], fmt: RowFormat, where: _Where) -> dict[str, Any]:
    return {fmt.text_field: _column(row, fmt, "text", where)}


def _pretokenized(row: dict[str, Any], fmt: RowFormat, where: _Where) -> dict[str, Any]:
    out = {"input_ids": _column(row, fmt, "input_ids", where)}
    for key in ("labels", "loss_mask", "attention_mask"):
        if row.get(fmt.name(key)) is not None:
            out[key] = row[fmt.name(key)]
    return out


CONVERSATION_KINDS = ("conversation", "multimodal")
PRESETS: Mapping[str, Preset] = {
    "sharegpt": Preset(
        ("conversations",), ("system", *MEDIA_COLUMNS), ("from", "value"), CONVERSATION_KINDS, _sharegpt
    ),
    "alpaca": Preset(
        ("instruction", "output"),
        ("input", "system", "history", *MEDIA_COLUMNS),
        (),
        CONVERSATION_KINDS,
        _alpaca,
    ),
    "openai": Preset(("messages",), MEDIA_COLUMNS, ("role", "content"), CONVERSATION_KINDS, _openai),
    "llava": Preset(("conversations",), MEDIA_COLUMNS, ("from", "value"), ("multimodal",), _llava),
    "messages": Preset(("messages",), MEDIA_COLUMNS, ("role", "content"), CONVERSATION_KINDS, _messages),
    "text": Preset(("text",), (), (), ("text",), _plain_text),
    "pretokenized": Preset(
        ("input_ids",), ("labels", "loss_mask", "attention_mask"), (), ("text", "conversation"), _pretokenized
    ),
}
"""``data.format`` name -> `Preset` (module docstring)."""


def row_format(data: Any) -> RowFormat | None:
    """The `RowFormat` of a recipe's data section (or one source of a mixture); None when ``data.format`` is None
    (rows already have the shape of ``data.kind``)."""
    if data.format is None:
        return None
    return RowFormat(
        preset=data.format,
        names=dict(data.columns),
        messages_field=data.messages_field,
        text_field=data.text_field,
        loss_mask_field=data.loss_mask_field,
        multimodal=data.kind == "multimodal",
    )


class FormattedSource:
    """A `RowSource` whose rows are converted by a `RowFormat` as they are read (same length, refs and files)."""

    def __init__(self, source: RowSource, fmt: RowFormat) -> None:
        self.source, self.format = source, fmt

    @property
    def files(self) -> Sequence[Any]:
        return self.source.files

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.format.convert(self.source[index], self.source.ref(index))

    def ref(self, index: int) -> RowRef:
        """Where row ``index`` lives (file and row/line)."""
        return self.source.ref(index)


def open_rows(data: Any, files: Sequence[str], encoder: Any) -> RowSource | FormattedSource:
    """The rows ``encoder`` reads: of ``files``, or of ``data.dataset`` when ``files`` is empty (through
    ``datasets.load_dataset``); a `RowSource` of the encoder's columns, or of the preset's columns converted by
    `FormattedSource` when ``data.format`` is set."""
    fmt = row_format(data)
    if fmt is None:
        columns, optional = encoder.columns, getattr(encoder, "optional_columns", ())
    else:
        columns, optional = fmt.columns, fmt.optional_columns
    if files:
        source = RowSource(files, data.file_format, columns, optional)
    else:
        from veomni.train.data.hf_sources import HFRows, describe_spec, load_dataset_spec

        if data.dataset.get("streaming"):
            raise DataError(
                "data.dataset: a streaming dataset has no random access to index; it is read by the stream "
                "pipeline (veomni.train.data.stream), not as rows"
            )
        what = describe_spec(data.dataset)
        source = RowSource.of([HFRows(load_dataset_spec(data.dataset), what, columns, optional)], what)
    return source if fmt is None else FormattedSource(source, fmt)
