"""Preference pairs (``data.kind: preference``): one row, a prompt with a chosen and a rejected answer, becomes one
sample of two attention segments, ``prompt + chosen`` then ``prompt + rejected``.

Both answers of a pair thus land in the same micro-batch, on the same rank, in order: the pair loss needs both
log-probabilities and nothing has to be gathered. Position ids restart at the rejected segment
(`veomni.train.data.packing.sample_positions`), so the packed attention keeps the two answers apart exactly as two
separate rows would be (`veomni.train.tasks.preference` relies on segment ``2i`` being pair i's chosen answer and
``2i + 1`` its rejected one).

Row layouts (TRL's):

- conversational, explicit prompt: ``{"prompt": [messages], "chosen": [messages], "rejected": [messages]}``; the
  answers' assistant messages are trained, rendered after the prompt by the tokenizer's chat template;
- conversational, implicit prompt: ``{"chosen": [messages], "rejected": [messages]}`` whose leading messages
  agree: the shared messages are the prompt;
- standard: ``{"prompt": str, "chosen": str, "rejected": str}``: the prompt tokenised with the tokenizer's special
  tokens, the answer after it without, then EOS; the answer tokens are trained.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
from transformers import PreTrainedTokenizerBase

from veomni.train.data.encode import ConversationEncoder
from veomni.train.data.sources import DataError, RowRef

PAIR_COLUMNS = ("chosen", "rejected")


@attrs.frozen
class PairSegments:
    """The ``media`` of a pair sample: where its rejected segment starts (``segment_starts``: one offset)."""

    segment_starts: tuple[int, ...]
    uncuttable: str = (
        "a preference pair cannot be truncated (the cut would drop the rejected answer): set data.overlong to drop "
        "or error, or raise data.max_seq_len"
    )


class PairEncoder:
    """Encodes a preference row into ``(input_ids, trained, PairSegments)`` (module docstring).

    Args:
        tokenizer: the run's tokenizer (a chat template for conversational rows, an EOS token for standard ones).
        prompt_field: the row field of the prompt (absent: an implicit prompt).
    """

    optional_columns: tuple[str, ...] = ()

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_field: str = "prompt") -> None:
        self.tokenizer, self.prompt_field = tokenizer, prompt_field
        self.columns = PAIR_COLUMNS
        self.optional_columns = (prompt_field,)
        self._chat = (
            ConversationEncoder(tokenizer, "messages", None, assistant_only=True)
            if getattr(tokenizer, "chat_template", None) and getattr(tokenizer, "is_fast", False)
            else None
        )

    def __call__(self, row: dict[str, Any], ref: RowRef) -> tuple[np.ndarray, np.ndarray, PairSegments]:
        for field in PAIR_COLUMNS:
            if row.get(field) is None:
                raise DataError(f"{ref}: a preference row needs {field!r}; the row has {sorted(row)}")
        chosen, rejected = row["chosen"], row["rejected"]
        prompt = row.get(self.prompt_field)
        if isinstance(chosen, str) and isinstance(rejected, str):
            if not isinstance(prompt, str):
                raise DataError(
                    f"{ref}: string answers need a string {self.prompt_field!r}, found {type(prompt).__name__}"
                )
            first, second = self._standard(prompt, chosen, ref), self._standard(prompt, rejected, ref)
        elif isinstance(chosen, list) and isinstance(rejected, list):
            if prompt is None:
                prompt, chosen, rejected = _split_implicit_prompt(chosen, rejected, ref)
            if not isinstance(prompt, list) or not prompt:
                raise DataError(
                    f"{ref}: conversational answers need {self.prompt_field!r} as a non-empty list of messages, "
                    f"found {prompt!r:.80}"
                )
            first, second = self._conversation(prompt, chosen, ref), self._conversation(prompt, rejected, ref)
        else:
            raise DataError(
                f"{ref}: 'chosen' and 'rejected' must both be strings or both lists of messages, found "
                f"{type(chosen).__name__} and {type(rejected).__name__}"
            )
        for (_, trained), name in zip((first, second), PAIR_COLUMNS, strict=True):
            if not trained.any():
                raise DataError(f"{ref}: the {name} answer has no trained token (is it empty?)")
        ids = np.concatenate([first[0], second[0]])
        trained = np.concatenate([first[1], second[1]])
        return ids, trained, PairSegments((len(first[0]),))

    def filler_media(self, n: int) -> PairSegments:
        """The segments of a bad row's stand-in of ``n`` tokens (``data.on_bad_row: skip``): two, as every pair."""
        return PairSegments((max(1, n // 2),))

    def _standard(self, prompt: str, answer: str, ref: RowRef) -> tuple[np.ndarray, np.ndarray]:
        eos = self.tokenizer.eos_token_id
        if eos is None:
            raise DataError("preference rows with string answers need a tokenizer with an eos_token")
        prompt_ids = list(self.tokenizer(prompt, add_special_tokens=True, verbose=False)["input_ids"])
        answer_ids = [*self.tokenizer(answer, add_special_tokens=False, verbose=False)["input_ids"], eos]
        if not prompt_ids:
            raise DataError(f"{ref}: the prompt produced no tokens")
        ids = np.asarray(prompt_ids + answer_ids, dtype=np.int64)
        trained = np.zeros(len(ids), dtype=bool)
        trained[len(prompt_ids) :] = True
        return ids, trained

    def _conversation(
        self, prompt: list[dict[str, Any]], answer: Any, ref: RowRef
    ) -> tuple[np.ndarray, np.ndarray]:
        if self._chat is None:
            raise DataError(
                "conversational preference rows need a fast tokenizer with a chat_template (data.chat_template)"
            )
        if not isinstance(answer, list) or not answer:
            raise DataError(f"{ref}: an answer must be a non-empty list of messages, found {answer!r:.80}")
        messages, _ = self._chat._messages({"messages": [*prompt, *answer]}, ref)
        flags = [False] * len(prompt) + [m["role"] == "assistant" for m in messages[len(prompt) :]]
        ids, trained = self._chat._tokens(messages, flags, ref)
        return ids, trained


def _split_implicit_prompt(chosen: list[Any], rejected: list[Any], ref: RowRef) -> tuple[list[Any], ...]:
    """``(prompt, chosen answer, rejected answer)`` of two whole conversations: the prompt is their common leading
    messages, which must end before either conversation's last message."""
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0 or shared == len(chosen) or shared == len(rejected):
        raise DataError(
            f"{ref}: without a 'prompt' field, 'chosen' and 'rejected' must be conversations that share their "
            f"leading messages (the prompt) and differ after them; they share {shared} of {len(chosen)} and "
            f"{len(rejected)} messages"
        )
    return chosen[:shared], chosen[shared:], rejected[shared:]


def preference_encoder(data: Any, tokenizer: PreTrainedTokenizerBase, **options: Any) -> PairEncoder:
    """The ``data.kind: preference`` factory (`veomni.train.data.kinds`)."""
    if options.get("vision_metadata") is not None:
        raise DataError("data.kind=preference trains text pairs; pairs with images are not supported yet")
    return PairEncoder(tokenizer)


__all__ = ["PAIR_COLUMNS", "PairEncoder", "PairSegments", "preference_encoder"]
