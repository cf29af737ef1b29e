"""``data.chat_template``: the Jinja chat template conversations are rendered with, in place of the tokenizer's own.

A value is a built-in name (`BUILTIN_CHAT_TEMPLATES`, shipped as package data in ``chat_templates/``) or the path
of a Jinja file. The template is set on the tokenizer when it is loaded (`veomni.train.data.encode.load_tokenizer`),
so the HF export saves it (``chat_template.jinja``) and the exported model chats the way it was trained.

Built-ins:

- ``chatml``: ``<|im_start|>role\\ncontent<|im_end|>\\n`` per message; no default system prompt.
- ``qwen3``: Qwen3's published template: an earlier assistant turn loses its ``<think>`` block, so only the turns
  after the last user query train their reasoning.
- ``qwen3_keep_thinking``: Qwen3's template with every assistant turn keeping its reasoning (the thinking of every
  turn is trained; what a Qwen3 model sees at inference differs only in the earlier turns' history).
"""

from __future__ import annotations

from pathlib import Path

from veomni.train.data.sources import DataError

TEMPLATES_DIR = Path(__file__).resolve().parent / "chat_templates"


def builtin_chat_templates() -> list[str]:
    """The names of the packaged chat templates."""
    return sorted(p.stem for p in TEMPLATES_DIR.glob("*.jinja"))


BUILTIN_CHAT_TEMPLATES: tuple[str, ...] = tuple(builtin_chat_templates())


def resolve_chat_template(value: str) -> str:
    """The Jinja source of ``value``: a built-in name, else the path of a template file.

    Raises:
        DataError: ``value`` is neither a built-in name nor an existing file (the message lists the built-ins), or
            the file is empty.
    """
    if value in BUILTIN_CHAT_TEMPLATES:
        return (TEMPLATES_DIR / f"{value}.jinja").read_text(encoding="utf-8")
    path = Path(value).expanduser()
    if not path.is_file():
        raise DataError(
            f"data.chat_template: expected a built-in name ({', '.join(BUILTIN_CHAT_TEMPLATES)}) or a Jinja file, "
            f"found {value!r} (no such built-in or file)"
        )
    source = path.read_text(encoding="utf-8")
    if not source.strip():
        raise DataError(f"data.chat_template: the template file {path} is empty")
    return source
