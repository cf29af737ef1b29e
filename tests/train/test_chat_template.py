"""``data.chat_template`` and the loss masks of templates that are not prefix-stable.

Qwen3's published template (``fixtures/qwen3_chat_template.jinja``) drops the ``<think>`` block of every assistant
turn before the last user query, so rendering a conversation's first k messages is not a prefix of rendering them
all. The masks come from the one full rendering: what each assistant writes (as rendered) is trained, everything
else (system, user, the ``<|im_start|>assistant\\n`` headers) is not.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from data_helpers import TOKENIZER_DIR, write_jsonl

from veomni.train.data import DataError, RowSource, build_encoder, encode_row, load_tokenizer
from veomni.train.data.chat_template import BUILTIN_CHAT_TEMPLATES, resolve_chat_template
from veomni.train.recipe import RecipeError, load_recipe

QWEN3_TEMPLATE = Path(__file__).parent / "fixtures" / "qwen3_chat_template.jinja"

THINKING_ROW = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "<think>\nadd two and two\n</think>\n\n4."},
        {"role": "user", "content": "And 3 + 3?"},
        {"role": "assistant", "content": "<think>\nadd three and three\n</think>\n\n6."},
    ]
}


def encode_with(template: str | None, row: dict, tmp_path: Path, **kwargs):
    tokenizer = load_tokenizer(TOKENIZER_DIR, template)
    encoder = build_encoder(tokenizer, "conversation", **kwargs)
    path = write_jsonl(tmp_path / "rows.jsonl", [row])
    source = RowSource([str(path)], "auto", encoder.columns)
    return tokenizer, encode_row(source, encoder, 0, 4096, "error")


def runs(tokenizer, sample, trained: bool) -> list[str]:
    """Decoded maximal runs of tokens whose trained flag equals ``trained``."""
    out, current = [], []
    for token, flag in zip(sample.input_ids.tolist(), sample.trained.tolist(), strict=True):
        if flag == trained:
            current.append(token)
        elif current:
            out.append(tokenizer.decode(current))
            current = []
    if current:
        out.append(tokenizer.decode(current))
    return out


def test_qwen3_template_multi_turn_with_thinking_trains_what_each_assistant_writes(tmp_path):
    tokenizer, sample = encode_with(str(QWEN3_TEMPLATE), THINKING_ROW, tmp_path)
    rendered = tokenizer.apply_chat_template(THINKING_ROW["messages"], tokenize=False)
    # The template is not prefix-stable: the first assistant turn loses its thinking once a later query follows.
    first_two = tokenizer.apply_chat_template(THINKING_ROW["messages"][:3], tokenize=False)
    assert not rendered.startswith(first_two) and "add two and two" not in rendered
    assert sample.input_ids.tolist() == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert runs(tokenizer, sample, True) == [
        "4.<|im_end|>\n",
        "<think>\nadd three and three\n</think>\n\n6.<|im_end|>\n",
    ]
    assert runs(tokenizer, sample, False) == [
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>user\nAnd 3 + 3?<|im_end|>\n<|im_start|>assistant\n",
    ]


def test_qwen3_keep_thinking_trains_every_turns_reasoning(tmp_path):
    tokenizer, sample = encode_with("qwen3_keep_thinking", THINKING_ROW, tmp_path)
    assert runs(tokenizer, sample, True) == [
        "<think>\nadd two and two\n</think>\n\n4.<|im_end|>\n",
        "<think>\nadd three and three\n</think>\n\n6.<|im_end|>\n",
    ]
    # A final answer without reasoning opens an empty thinking block, as Qwen3's own template writes it.
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    tokenizer, sample = encode_with("qwen3_keep_thinking", row, tmp_path)
    assert runs(tokenizer, sample, True) == ["<think>\n\n</think>\n\nHello.<|im_end|>\n"]


def test_qwen3_tool_calls_and_responses(tmp_path):
    row = {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "<think>\nask the tool\n</think>\n\n",
                "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Paris"}}}],
            },
            {"role": "tool", "content": "sunny"},
            {"role": "assistant", "content": "<think>\nit said sunny\n</think>\n\nSunny."},
        ]
    }
    tokenizer, sample = encode_with("qwen3", row, tmp_path, loss_mask_field=None)
    trained = runs(tokenizer, sample, True)
    assert trained == [
        '<think>\nask the tool\n</think>\n\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n",
        "<think>\nit said sunny\n</think>\n\nSunny.<|im_end|>\n",
    ]
    assert "sunny" in runs(tokenizer, sample, False)[1]


def test_builtins_and_a_file_path(tmp_path):
    assert set(BUILTIN_CHAT_TEMPLATES) >= {"chatml", "qwen3", "qwen3_keep_thinking"}
    # The shipped qwen3 template is Qwen3's published one.
    assert resolve_chat_template("qwen3") == QWEN3_TEMPLATE.read_text()
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    qwen3 = "<think>\n\n</think>\n\nHello.<|im_end|>\n"  # Qwen3's final turn always opens a thinking block
    for template, trained in (
        ("chatml", "Hello.<|im_end|>\n"),
        ("qwen3", qwen3),
        (str(QWEN3_TEMPLATE), qwen3),
    ):
        tokenizer, sample = encode_with(template, row, tmp_path)
        assert tokenizer.chat_template == resolve_chat_template(template)
        assert runs(tokenizer, sample, True) == [trained]
    own = tmp_path / "mine.jinja"
    own.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}"
                   "{% if add_generation_prompt %}<assistant>{% endif %}")  # fmt: skip
    tokenizer, sample = encode_with(str(own), row, tmp_path)
    assert runs(tokenizer, sample, True) == ["Hello.</s>"]


def test_unknown_template_is_an_error_listing_the_builtins(tmp_path):
    with pytest.raises(DataError, match="expected a built-in name \\(chatml, qwen3, qwen3_keep_thinking\\)"):
        load_tokenizer(TOKENIZER_DIR, "qwen9")
    with pytest.raises(RecipeError, match="data.chat_template: expected a built-in name \\(chatml, qwen3, "):
        load_recipe("quickstart", ["--data.chat_template=qwen9"])
    with pytest.raises(RecipeError, match="data.chat_template: conversations are rendered for data.kind"):
        load_recipe("quickstart", ["--data.chat_template=chatml", "--data.kind=text"])
    assert load_recipe("quickstart", ["--data.chat_template=qwen3"]).data.chat_template == "qwen3"


def test_templates_whose_message_ends_cannot_be_found_are_errors(tmp_path):
    row = {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}
    dropped = tmp_path / "dropped.jinja"  # renders no content at all
    dropped.write_text("{% for m in messages %}<{{ m.role }}>{% endfor %}")
    with pytest.raises(
        DataError, match="line 1: cannot find where message 0 \\(user\\) ends in the rendered"
    ):
        encode_with(str(dropped), row, tmp_path)
    reversed_ = tmp_path / "reversed.jinja"
    reversed_.write_text("{% for m in messages|reverse %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    with pytest.raises(DataError, match="line 1: message 1 \\(assistant\\) is rendered before message 0"):
        encode_with(str(reversed_), row, tmp_path)


def test_the_export_carries_the_template_it_was_trained_with(tmp_path):
    from transformers import AutoTokenizer

    out = tmp_path / "run"
    overrides = ["--data.chat_template=qwen3", "--train.steps=1", "--train.epochs=null", "--optim.warmup_steps=0",
                 "--data.eval_files=[]", "--train.eval_interval=null", "--checkpoint.save_final=false"]  # fmt: skip
    cmd = [sys.executable, "-m", "veomni.train.cli", "quickstart", f"--checkpoint.dir={out}", *overrides]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    exported = AutoTokenizer.from_pretrained(out / "hf")
    assert exported.chat_template == resolve_chat_template("qwen3")
