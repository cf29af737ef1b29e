"""Rows to token samples: ``text`` (pre-training) and ``conversation`` (chat template, per-message loss choice).

A sample is ``(input_ids, trained)``: int64 token ids and a bool mask where ``trained[j]`` says that token j is a
prediction target (predicted from position j - 1). ``trained[0]`` is always False: nothing precedes it. The packer
turns the mask into shifted labels; the mask form keeps "which tokens does the model learn" visible.

Conversations are rendered with the chat template (the tokenizer's own, or ``data.chat_template``: see
`veomni.train.data.chat_template`) and tokenised in one piece (so the ids are what the model sees at inference),
then each token is attributed to the message its first character comes from. Message boundaries are found in
that one rendering, so templates that are not prefix-stable work too (Qwen3's drops the ``<think>`` block of
earlier assistant turns): where message i's content ends is found by appending a probe character to it and
rendering again (the rendering must change by an insertion there and nowhere else), and its turn runs on over the
end-of-turn text that rendering the conversation up to message i puts after it. A message whose end cannot be
found that way is an error naming the row and the message. For an assistant message, the generation header
(``<|im_start|>assistant\\n`` in ChatML: what the generation prompt adds) is never trained: only what the assistant
writes, its end-of-turn token and what the template puts after it.
"""

from __future__ import annotations

import os
from typing import Any

import attrs
import numpy as np
from transformers import PreTrainedTokenizerBase

from veomni.train.data.chat_template import resolve_chat_template
from veomni.train.data.row_formats import MEDIA_COLUMNS, refuse_media
from veomni.train.data.sources import DataError, OverlongError, RowRef, RowSource


@attrs.frozen(eq=False)
class Sample:
    """One tokenised row.

    Attributes:
        input_ids: int64 ``[n]``, n >= 1.
        trained: bool ``[n]``, ``trained[0]`` False.
        index: the row's index in its `RowSource`.
        truncated: whether the row was cut to ``max_seq_len``.
        media: a multimodal row's `veomni.train.data.multimodal_batch.MediaSample` (pixels, grids, mrope ids); None for
            text rows.
    """

    input_ids: np.ndarray
    trained: np.ndarray
    index: int
    truncated: bool = False
    media: Any = None

    @property
    def num_trained(self) -> int:
        """Tokens that are prediction targets, i.e. the sample's valid labels after the shift."""
        return int(self.trained.sum())


def load_tokenizer(path: str, chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """``AutoTokenizer.from_pretrained(path)`` for a local directory, with a clear error when it is missing.

    Args:
        path: the tokenizer directory.
        chat_template: ``data.chat_template`` (a built-in name or a Jinja file) to replace the tokenizer's own
            template with; it is what ``save_pretrained`` then writes beside an export. None keeps the tokenizer's.
    """
    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise DataError(f"tokenizer directory {path} does not exist (model.tokenizer / model.weights)")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if chat_template is not None:
        tokenizer.chat_template = resolve_chat_template(chat_template)
    return tokenizer


class TextEncoder:
    """``row[field]`` is one text; every token but the first is trained.

    The tokenizer's own special tokens are added (a BOS where its post-processor adds one); with ``add_eos``
    its EOS token ends the text (appended unless the post-processor put it there).
    """

    optional_columns: tuple[str, ...] = ()  # fields a parquet file may lack (`RowSource`)

    def __init__(self, tokenizer: PreTrainedTokenizerBase, field: str, add_eos: bool) -> None:
        if add_eos and tokenizer.eos_token_id is None:
            raise DataError("data.add_eos is true but the tokenizer has no eos_token; set data.add_eos=false")
        self.tokenizer, self.field, self.add_eos = tokenizer, field, add_eos
        self.columns = (field,)

    def __call__(self, row: dict[str, Any], ref: RowRef) -> tuple[np.ndarray, np.ndarray]:
        if self.field not in row:
            raise DataError(f"{ref}: no field {self.field!r} (data.text_field); the row has {sorted(row)}")
        text = row[self.field]
        if not isinstance(text, str):
            raise DataError(f"{ref}: field {self.field!r} must be a string, found {type(text).__name__}")
        ids = list(self.tokenizer(text, add_special_tokens=True, verbose=False)["input_ids"])
        # Not a second one where the tokenizer's post-processor already ends the text with it (T5, or Llama's
        # add_eos_token).
        if self.add_eos and (not ids or ids[-1] != self.tokenizer.eos_token_id):
            ids.append(self.tokenizer.eos_token_id)
        if not ids:
            raise DataError(f"{ref}: the text is empty and produced no tokens")
        trained = np.ones(len(ids), dtype=bool)
        trained[0] = False
        return np.asarray(ids, dtype=np.int64), trained


class ConversationEncoder:
    """``row[field]`` is a list of ``{"role", "content", ...}`` messages rendered by the tokenizer's chat template.

    Which messages are trained: ``message[loss_mask_field]`` (0/1 or bool) when present, else assistant messages
    only (``assistant_only``) or every message. A row carrying media (top-level ``images`` and the like, or
    non-text parts) is refused: this data trains text only (`veomni.train.data.row_formats.refuse_media`).
    """

    columns: tuple[str, ...]
    optional_columns: tuple[str, ...] = MEDIA_COLUMNS  # read where a parquet file has them, to refuse media

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        field: str,
        loss_mask_field: str | None,
        assistant_only: bool,
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise DataError("data.kind is conversation but the tokenizer has no chat_template")
        if not getattr(tokenizer, "is_fast", False):
            raise DataError(
                "conversation data needs a fast tokenizer (character offsets attribute tokens to messages)"
            )
        self.tokenizer, self.field = tokenizer, field
        self.loss_mask_field, self.assistant_only = loss_mask_field, assistant_only
        self.columns = (field,)

    def _render(self, messages: list[dict[str, Any]], ref: RowRef, generation_prompt: bool = False) -> str:
        if not messages:
            return ""
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as err:  # jinja raises TemplateError and friends for messages it rejects
            raise DataError(f"{ref}: the chat template failed on this conversation: {err}") from None

    def _messages(self, row: dict[str, Any], ref: RowRef) -> tuple[list[dict[str, Any]], list[bool]]:
        if self.field not in row:
            raise DataError(
                f"{ref}: no field {self.field!r} (data.messages_field); the row has {sorted(row)}"
            )
        raw = row[self.field]
        if not isinstance(raw, list) or not raw:
            raise DataError(f"{ref}: {self.field!r} must be a non-empty list of messages, found {raw!r:.80}")
        messages, flags = [], []
        for i, message in enumerate(raw):
            if not isinstance(message, dict):
                raise DataError(f"{ref}: message {i} must be an object, found {type(message).__name__}")
            role, content = message.get("role"), message.get("content")
            if not isinstance(role, str) or not isinstance(content, str):
                raise DataError(
                    f"{ref}: message {i} needs string 'role' and 'content'; found role={role!r}, "
                    f"content of type {type(content).__name__}"
                )
            flag = role == "assistant" if self.assistant_only else True
            # A null flag is an absent one: parquet gives every message of a column the same struct fields, so a
            # message that had no flag in the source reads back with loss_mask None.
            if self.loss_mask_field is not None and message.get(self.loss_mask_field) is not None:
                value = message[self.loss_mask_field]
                if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
                    flag = bool(value)
                else:
                    raise DataError(
                        f"{ref}: message {i} has {self.loss_mask_field}={value!r}; expected 0, 1, true or false"
                    )
            messages.append({k: v for k, v in message.items() if k != self.loss_mask_field})
            flags.append(flag)
        return messages, flags

    def __call__(self, row: dict[str, Any], ref: RowRef) -> tuple[np.ndarray, np.ndarray]:
        refuse_media(row, self.field, ref)
        messages, flags = self._messages(row, ref)
        return self._tokens(messages, flags, ref)

    def _tokens(
        self, messages: list[dict[str, Any]], flags: list[bool], ref: RowRef
    ) -> tuple[np.ndarray, np.ndarray]:
        full = self._render(messages, ref)
        ends = [self._content_end(messages, i, full, ref) for i in range(len(messages))]
        for i in range(1, len(ends)):
            if ends[i] < ends[i - 1]:
                raise DataError(
                    f"{ref}: message {i} ({messages[i]['role']}) is rendered before message {i - 1}: the chat "
                    "template reorders messages, so tokens cannot be attributed to them"
                )
        # prefixes[i]: the conversation rendered up to message i (what a generation prompt follows).
        prefixes = [self._render(messages[: i + 1], ref) for i in range(len(messages) - 1)]
        # Character spans of the trained parts of each message.
        char_trained = np.zeros(len(full) + 1, dtype=bool)
        start_of_message = 0
        for i, message in enumerate(messages):
            end = (
                len(full)
                if i == len(messages) - 1
                else ends[i] + _turn_end(prefixes[i], full[ends[i] : ends[i + 1]])
            )
            start = start_of_message
            if message["role"] == "assistant":
                header = self._assistant_header(messages, i, prefixes[i - 1] if i else "", ref)
                if not full.startswith(header, start) or start + len(header) > ends[i]:
                    raise DataError(
                        f"{ref}: message {i}: the assistant header {header!r} (what the generation prompt adds) does "
                        f"not open its turn in the rendered conversation, which has "
                        f"{full[start : start + len(header) + 16]!r} there"
                    )
                start += len(header)
            if flags[i]:
                char_trained[start:end] = True
            start_of_message = end
        encoding = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        ids = np.asarray(encoding["input_ids"], dtype=np.int64)
        if ids.size == 0:
            raise DataError(f"{ref}: the conversation rendered to no tokens")
        starts = np.asarray([s for s, _ in encoding["offset_mapping"]], dtype=np.int64)
        trained = char_trained[np.clip(starts, 0, len(full))]
        trained[0] = False
        return ids, trained

    def _content_end(self, messages: list[dict[str, Any]], i: int, full: str, ref: RowRef) -> int:
        """Where message ``i``'s content ends in ``full``: render again with a probe character appended to it; the
        rendering must differ from ``full`` by one insertion, and the insertion point is the end."""
        probe = [
            *messages[:i],
            {**messages[i], "content": _with_probe(messages[i]["content"])},
            *messages[i + 1 :],
        ]
        rendered = self._render(probe, ref)
        at = len(os.path.commonprefix([full, rendered]))
        grown = len(rendered) - len(full)
        if grown <= 0 or rendered[at + grown :] != full[at:] or _PROBE not in rendered[at : at + grown]:
            raise DataError(
                f"{ref}: cannot find where message {i} ({messages[i]['role']}) ends in the rendered conversation: "
                "the chat template does not render its content in one place as given (a character appended to it "
                "changed the rendering elsewhere, or not at all), so tokens cannot be attributed to messages"
            )
        return at

    def _assistant_header(self, messages: list[dict[str, Any]], i: int, before: str, ref: RowRef) -> str:
        """The text that opens assistant message ``i``'s turn: what the generation prompt adds after the earlier
        messages. An opening assistant message has no earlier turns to put a generation prompt after (templates
        refuse an empty conversation): its header is what two renderings with different one-character contents
        share (a default system prompt included)."""
        if i:
            prompt = self._render(messages[:i], ref, generation_prompt=True)
            return prompt[len(os.path.commonprefix([prompt, before])) :]
        probes = [self._render([{**messages[i], "content": c}], ref) for c in ("a", "b")]
        return os.path.commonprefix(probes)


_PROBE = "\ue000"
"""A private-use character appended to a message's content to find where the template renders it."""


def _with_probe(content: Any) -> Any:
    """``content`` with `_PROBE` after it: appended to a string, a text part after a list of parts."""
    if isinstance(content, list):
        return [*content, {"type": "text", "text": _PROBE}]
    return content + _PROBE


def _turn_end(prefix: str, gap: str) -> int:
    """How much of ``gap`` (the rendering from a message's content end on) still belongs to the message: the longest
    start of ``gap`` that ``prefix`` (the conversation rendered up to that message) ends with, its end-of-turn text."""
    if not prefix:
        return 0
    k = gap.rfind(prefix[-1])
    while k >= 0:
        if prefix.endswith(gap[: k + 1]):
            return k + 1
        k = gap.rfind(prefix[-1], 0, k)
    return 0


Encoder = TextEncoder | ConversationEncoder


def build_encoder(
    tokenizer: PreTrainedTokenizerBase,
    kind: str,
    *,
    text_field: str = "text",
    messages_field: str = "messages",
    loss_mask_field: str | None = "loss_mask",
    assistant_only_loss: bool = True,
    add_eos: bool = True,
) -> Encoder:
    """The encoder for ``kind`` (``text`` or ``conversation``), configured like the recipe's data section."""
    if kind == "text":
        return TextEncoder(tokenizer, text_field, add_eos)
    if kind == "conversation":
        return ConversationEncoder(tokenizer, messages_field, loss_mask_field, assistant_only_loss)
    raise DataError(f"data.kind must be text or conversation, found {kind!r}")


def encode_row(
    source: RowSource, encoder: Encoder, index: int, max_seq_len: int, overlong: str
) -> Sample | None:
    """Read and tokenise row ``index``; apply the over-length policy (None: the row is dropped).

    Raises:
        DataError: a bad row, naming file and row; `OverlongError` for an over-long one the policy refuses.
    """
    ref = source.ref(index)
    return encode_value(source[index], ref, index, encoder, max_seq_len, overlong)


def encode_value(
    row: dict[str, Any], ref: RowRef, index: int, encoder: Encoder, max_seq_len: int, overlong: str
) -> Sample | None:
    """`encode_row` for a row read already (``ref``: where it is from; ``index``: its number in its source)."""
    ids, trained, *rest = encoder(row, ref)
    media = rest[0] if rest else None
    truncated = False
    if len(ids) > max_seq_len:
        if media is not None and overlong == "truncate":
            why = getattr(
                media, "uncuttable", "a multimodal row cannot be truncated (the cut would split image placeholders "
                "from their pixels): set data.overlong to drop or error, or raise data.max_seq_len",
            )  # fmt: skip
            raise OverlongError(f"{ref}: {len(ids)} tokens, longer than data.max_seq_len={max_seq_len}; {why}")
        if overlong == "error":
            raise OverlongError(f"{ref}: {len(ids)} tokens, longer than data.max_seq_len={max_seq_len}")
        if overlong == "drop":
            return None
        if overlong != "truncate":
            raise OverlongError(f"data.overlong must be truncate, drop or error, found {overlong!r}")
        ids, trained, truncated = ids[:max_seq_len], trained[:max_seq_len], True
    return Sample(ids, trained, index, truncated, media)
