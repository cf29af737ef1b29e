"""Row formats of multimodal data: the shapes users have, converted to the native row or refused.

The native row (`veomni.train.data.multimodal`) is ``{"messages": [{"role", "content": str | [parts]}]}`` with
parts ``{"type": "text", "text"}``, ``{"type": "image", "image": path | bytes}``, ``{"type": "video", ...}`` and
(omni) ``{"type": "audio", "audio": path | bytes}``. `native_row` also accepts, and converts:

- **LLaVA / ShareGPT(4V)**: ``{"conversations": [{"from": "human" | "gpt" | "system", "value": str}], "images":
  [...]}`` (also ``"image": path``, ``videos`` / ``video``, ``audios`` / ``audio``), where ``<image>``,
  ``<video>`` and ``<audio>`` in the text mark where each medium goes, in list order.
- The same placeholders in ``role`` / ``content`` messages beside top-level media lists (LLaMA-Factory's layout).
- **OpenAI chat parts**: ``{"type": "image_url", "image_url": {"url": path | file:// URL | data: URL}}`` and
  ``{"type": "input_audio", "input_audio": {"data": base64, "format": "wav"}}``.
- Payload-free ``{"type": "image"}`` (``video``, ``audio``) parts filled, in order, from the top-level lists.

The placeholders (and payload-free parts) of each medium must match the row's list of it one to one; a
mismatch either way is a `DataError` naming the row, as is a remote URL (nothing is downloaded), bad base64 or an
unknown ShareGPT role. `refuse_media` stops media at the door of text-only (``conversation``) data, and
`check_some_media` stops a ``multimodal`` dataset whose rows hold no medium at all.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from veomni.train.data.sources import DataError, RowRef, RowSource

KINDS = ("image", "video", "audio")
LISTS = {"image": ("images", "image"), "video": ("videos", "video"), "audio": ("audios", "audio")}
"""Medium -> its top-level row keys (plural list, singular value)."""
MEDIA_COLUMNS = tuple(key for keys in LISTS.values() for key in keys)
CONVERSATIONS = "conversations"
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
PLACEHOLDER = re.compile(r"<(image|video|audio)>")
SAMPLED_ROWS = 16


def native_row(row: dict[str, Any], field: str, ref: RowRef) -> dict[str, Any]:
    """``{field: messages}`` in the native multimodal layout (module docstring) for any accepted row shape.

    Args:
        row: the row as read (jsonl object, or parquet columns with None where a column is absent).
        field: ``data.messages_field``; LLaVA / ShareGPT rows give ``conversations`` instead.
        ref: where the row comes from (for errors).
    Raises:
        DataError: naming the row and what was expected, for every shape that cannot be converted.
    """
    raw = row.get(field)
    if raw is None and row.get(CONVERSATIONS) is not None:
        raw = row[CONVERSATIONS]
    elif raw is None:
        present = sorted(k for k, v in row.items() if v is not None)
        raise DataError(
            f"{ref}: no field {field!r} (data.messages_field) or {CONVERSATIONS!r} (LLaVA / ShareGPT rows); the "
            f"row has {present}"
        )
    if not isinstance(raw, list):
        return {field: raw}  # the conversation checks name what a message list must be
    media = _top_level_media(row, ref)
    slots: dict[str, list[tuple[int, int]]] = {
        kind: [] for kind in KINDS
    }  # (message, part) of payload-free parts
    messages = []
    for i, message in enumerate(raw):
        message = _role_and_content(message, i, ref)
        content = message.get("content")
        if isinstance(content, str) and PLACEHOLDER.search(content):
            content = _split(content)
        if isinstance(content, list):
            parts = []
            for k, part in enumerate(content):
                for new in _part(part, i, k, ref):
                    kind = new.get("type")
                    if kind in KINDS and new.get(kind) is None:
                        slots[kind].append((i, len(parts)))
                    parts.append(new)
            content = parts
        messages.append({**message, "content": content})
    for kind in KINDS:
        given, expected_slots = media[kind], slots[kind]
        if len(given) != len(expected_slots):
            key = LISTS[kind][0]
            raise DataError(
                f"{ref}: {len(expected_slots)} <{kind}> placeholder(s) or payload-free {kind} part(s) in the conversation "
                f"but {len(given)} {kind}(s) in the row's {key!r} list; they must match one to one"
            )
        for value, (i, k) in zip(given, expected_slots, strict=True):
            messages[i]["content"][k] = {"type": kind, kind: value}
    return {field: messages}


def _top_level_media(row: dict[str, Any], ref: RowRef) -> dict[str, list[Any]]:
    """Each medium's top-level list (``images`` or a single ``image``), empty where the row gives none."""
    out: dict[str, list[Any]] = {}
    for kind, (plural, singular) in LISTS.items():
        many, one = row.get(plural), row.get(singular)
        if many is not None and one is not None:
            raise DataError(
                f"{ref}: the row gives both {plural!r} and {singular!r}; give one list {plural!r}"
            )
        if one is not None:
            many = [one]
        if many is None:
            many = []
        if not isinstance(many, list):
            raise DataError(
                f"{ref}: {plural!r} must be a list of {kind}s (paths or bytes), found {type(many).__name__}"
            )
        if any(item is None for item in many):
            raise DataError(f"{ref}: {plural!r} holds a null entry at position {many.index(None)}")
        out[kind] = many
    return out


def _role_and_content(message: Any, i: int, ref: RowRef) -> Any:
    """A ShareGPT ``{"from", "value"}`` message as ``{"role", "content"}`` (other keys kept); others as given."""
    if not isinstance(message, dict) or "role" in message or "from" not in message:
        return message
    speaker = message["from"]
    if speaker not in SHAREGPT_ROLES:
        raise DataError(
            f"{ref}: message {i} is from {speaker!r}; ShareGPT messages must be from one of {sorted(SHAREGPT_ROLES)}"
        )
    rest = {k: v for k, v in message.items() if k not in ("from", "value")}
    return {**rest, "role": SHAREGPT_ROLES[speaker], "content": message.get("value")}


def _split(text: str) -> list[dict[str, Any]]:
    """``text`` as text parts and payload-free media parts, one per placeholder."""
    parts: list[dict[str, Any]] = []
    previous = 0
    for match in PLACEHOLDER.finditer(text):
        if match.start() > previous:
            parts.append({"type": "text", "text": text[previous : match.start()]})
        parts.append({"type": match.group(1)})
        previous = match.end()
    if previous < len(text):
        parts.append({"type": "text", "text": text[previous:]})
    return parts


def _part(part: Any, i: int, k: int, ref: RowRef) -> list[dict[str, Any]]:
    """One content part in native form (a text part holding placeholders becomes several); unknown parts are
    passed on for the encoder to refuse with the list of accepted ones."""
    if not isinstance(part, dict):
        return [part]
    kind = part.get("type")
    where = f"{ref}: message {i} part {k}"
    if kind == "text" and isinstance(part.get("text"), str) and PLACEHOLDER.search(part["text"]):
        return _split(part["text"])
    if kind == "image_url":
        value = part.get("image_url")
        url = value.get("url") if isinstance(value, dict) else value
        if not isinstance(url, str) or not url:
            raise DataError(
                f"{where}: an image_url part needs {{'image_url': {{'url': str}}}}, found {part!r:.80}"
            )
        return [{"type": "image", "image": _image_url(url, where)}]
    if kind == "input_audio":
        value = part.get("input_audio")
        data = value.get("data") if isinstance(value, dict) else None
        if not isinstance(data, str) or not data:
            raise DataError(
                f"{where}: an input_audio part needs {{'input_audio': {{'data': base64 str, 'format': 'wav'}}}}, "
                f"found {part!r:.80}"
            )
        return [{"type": "audio", "audio": _base64(data, f"{where} (input_audio data)")}]
    return [part]


def _image_url(url: str, where: str) -> str | bytes:
    """A local path (``file://`` stripped) or a ``data:`` URL's bytes; remote URLs are refused."""
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if not header.endswith(";base64") or not payload:
            raise DataError(
                f"{where}: a data URL must be 'data:<mime>;base64,<payload>', found {url[:40]!r}..."
            )
        return _base64(payload, f"{where} (image_url data URL)")
    if url.startswith(("http://", "https://")):
        raise DataError(
            f"{where}: image_url {url[:80]!r} is remote; nothing is downloaded during training: save the image "
            "and give its path (relative to data.media_root) or a data: URL"
        )
    return url.removeprefix("file://")


def _base64(payload: str, what: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise DataError(f"{what}: not valid base64 ({err})") from None


def row_media(messages: Any) -> dict[str, int]:
    """Count of each medium's parts in native ``messages`` (`native_row`'s output)."""
    counts = dict.fromkeys(KINDS, 0)
    for message in messages if isinstance(messages, list) else []:
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and part.get("type") in KINDS:
                counts[part["type"]] += 1
    return counts


def refuse_media(row: dict[str, Any], field: str, ref: RowRef) -> None:
    """Raise a `DataError` when a row of text-only (``conversation``) data carries media, which it would drop."""
    found = [
        f"{key!r} ({len(v) if isinstance(v, list) else 1})" for key in MEDIA_COLUMNS if (v := row.get(key))
    ]
    messages = row.get(field)
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        content = message.get("content") if isinstance(message, dict) else None
        for k, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") not in (None, "text"):
                found.append(f"message {i} part {k} of type {part.get('type')!r}")
    if found:
        raise DataError(
            f"{ref}: the row carries media ({', '.join(found[:3])}) but data.kind is conversation, which trains "
            "text only and would drop them; use data.kind: multimodal with a vlm or omni model, or remove the media"
        )


def check_some_media(source: RowSource, field: str, rows: Sequence[int], what: str) -> None:
    """A ``multimodal`` dataset must hold media: `SAMPLED_ROWS` rows spread over ``rows`` (the good rows) are
    converted, and a `DataError` names the files when none holds an image, video or audio."""
    if not len(rows):
        return
    picks = np.unique(np.linspace(0, len(rows) - 1, min(SAMPLED_ROWS, len(rows))).round().astype(np.int64))
    for j in picks.tolist():
        index = int(rows[j])
        try:
            counts = row_media(native_row(source[index], field, source.ref(index))[field])
        except DataError:
            continue  # a bad row is reported by the encoder under data.on_bad_row
        if any(counts.values()):
            return
    files = [f.path for f in source.files]
    raise DataError(
        f"{what}: data.kind is multimodal but none of {len(picks)} rows sampled from {files} holds an image, video "
        f"or audio; for text conversations set data.kind: conversation, else check the row format (docs/train.md, "
        "Row formats: native parts, LLaVA/ShareGPT 'images' + '<image>', OpenAI image_url / input_audio parts)"
    )
