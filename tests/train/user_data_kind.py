"""A user's own data kind, as it would live in their package (imported by name in the tests, like any module on
the path): prompt/completion rows, the prompt never trained, the completion and its end token trained.

It is the worked example of `veomni.train.data.kinds`: registered by name with `register_data_kind` (then
``data.kind: prompt_completion``), or named by import path (``data.kind: user_data_kind:PromptCompletionEncoder``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from veomni.train.data import DataError, RowRef, register_data_kind


@register_data_kind("prompt_completion")
class PromptCompletionEncoder:
    """``{"prompt": str, "completion": str}`` rows: the prompt's tokens then the completion's and the EOS token;
    only the completion and the EOS token are trained.

    Args:
        data: the recipe's data section (this kind reads no field of it).
        tokenizer: the run's tokenizer (it must have an EOS token).
    """

    tasks = ("text",)  # what the import-path form reads; the decorator says the same with its default

    def __init__(self, data: Any, tokenizer: Any) -> None:
        if tokenizer.eos_token_id is None:
            raise DataError("data.kind=prompt_completion needs a tokenizer with an eos_token")
        self.tokenizer = tokenizer
        self.columns = ("prompt", "completion")

    def __call__(self, row: dict[str, Any], ref: RowRef) -> tuple[np.ndarray, np.ndarray]:
        for field in self.columns:
            if not isinstance(row.get(field), str) or not row[field]:
                raise DataError(f"{ref}: {field!r} must be a non-empty string, found {row.get(field)!r:.60}")
        prompt = self.tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        completion = self.tokenizer(row["completion"], add_special_tokens=False)["input_ids"]
        ids = np.asarray([*prompt, *completion, self.tokenizer.eos_token_id], dtype=np.int64)
        trained = np.zeros(len(ids), dtype=bool)
        trained[len(prompt) :] = True  # the completion's tokens, predicted from the prompt onwards
        return ids, trained
