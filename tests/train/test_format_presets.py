"""Format presets (``data.format``, `veomni.train.data.presets`): golden conversions of real-shaped ShareGPT,
Alpaca, OpenAI, LLaVA, messages, text and pretokenized rows; each trains exactly as its native row does; column
renames; errors naming file, row and preset; LLaVA rows train as images, never as text."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from data_helpers import tokenizer, write_jsonl, write_parquet
from test_multimodal_data import make_processor_dir, model_data, png, tiny_vlm_config

from veomni.train.data import DataError, RowRef, load_tokenizer
from veomni.train.data.build import encoder_for, index_files
from veomni.train.data.presets import PRESETS, RowFormat
from veomni.train.recipe import DataSection, RecipeError

REF = RowRef("rows.jsonl", 6, 7)

# Real shapes: ShareGPT as in the Vicuna dumps (plus a system column and a tool turn, glaive style), Alpaca as
# tatsu-lab/alpaca (its "text" column unused) with LLaMA-Factory's history, OpenAI's fine-tuning chat format with
# per-message weight, LLaVA as llava_v1_5_mix665k.
SHAREGPT = {
    "id": "QWJhYvA_0",
    "system": "You are a helpful assistant.",
    "conversations": [
        {"from": "human", "value": "Summarize the plot of Hamlet in one line."},
        {"from": "gpt", "value": "A prince avenges his father's murder and everyone dies."},
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": '{"name": "weather", "arguments": {"city": "Paris"}}'},
        {"from": "observation", "value": '{"temp": 21}'},
        {"from": "gpt", "value": "It is 21 degrees in Paris."},
    ],
}
ALPACA = {
    "instruction": "Give three tips for staying healthy.",
    "input": "Keep them short.",
    "output": "1. Eat well. 2. Exercise. 3. Sleep.",
    "text": "Below is an instruction that describes a task. ...",
    "history": [["Hi", "Hello! How can I help?"]],
}
OPENAI = {
    "messages": [
        {"role": "system", "content": "Marv is a factual chatbot that is also sarcastic."},
        {"role": "user", "content": "What's the capital of France?"},
        {"role": "assistant", "content": "Paris, as if everyone doesn't know that already.", "weight": 0},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Who wrote "}, {"type": "text", "text": "Hamlet?"}],
        },
        {"role": "assistant", "content": "Shakespeare. Ever heard of him?", "weight": 1},
    ]
}
LLAVA = {
    "id": "000000033471",
    "image": "coco/train2017/000000033471.jpg",
    "conversations": [
        {"from": "human", "value": "<image>\nWhat are the colors of the bus in the image?"},
        {"from": "gpt", "value": "The bus in the image is white and red."},
        {"from": "human", "value": "What feature can be seen on the back of the bus?"},
        {"from": "gpt", "value": "The back of the bus features an advertisement."},
    ],
}

GOLDEN = {
    "sharegpt": {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Summarize the plot of Hamlet in one line."},
            {"role": "assistant", "content": "A prince avenges his father's murder and everyone dies."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": '{"name": "weather", "arguments": {"city": "Paris"}}'},
            {"role": "tool", "content": '{"temp": 21}'},
            {"role": "assistant", "content": "It is 21 degrees in Paris."},
        ]
    },
    "alpaca": {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Give three tips for staying healthy.\nKeep them short."},
            {"role": "assistant", "content": "1. Eat well. 2. Exercise. 3. Sleep."},
        ]
    },
    "openai": {
        "messages": [
            {"role": "system", "content": "Marv is a factual chatbot that is also sarcastic."},
            {"role": "user", "content": "What's the capital of France?"},
            {
                "role": "assistant",
                "content": "Paris, as if everyone doesn't know that already.",
                "loss_mask": 0,
            },
            {"role": "user", "content": "Who wrote Hamlet?"},
            {"role": "assistant", "content": "Shakespeare. Ever heard of him?", "loss_mask": 1},
        ]
    },
}


def convert(preset: str, row: dict, **kwargs) -> dict:
    return RowFormat(preset, kwargs.pop("names", {}), **kwargs).convert(row, REF)


@pytest.mark.parametrize("preset, row", [("sharegpt", SHAREGPT), ("alpaca", ALPACA), ("openai", OPENAI)])
def test_golden_conversions(preset, row):
    assert convert(preset, json.loads(json.dumps(row))) == GOLDEN[preset]


def test_llava_rows_become_multimodal_rows_with_the_image_in_place():
    got = convert("llava", LLAVA, multimodal=True)
    image = {"type": "image", "image": "coco/train2017/000000033471.jpg"}
    question = {"type": "text", "text": "\nWhat are the colors of the bus in the image?"}
    assert got == {
        "messages": [
            {"role": "user", "content": [image, question]},
            {"role": "assistant", "content": "The bus in the image is white and red."},
            {"role": "user", "content": "What feature can be seen on the back of the bus?"},
            {"role": "assistant", "content": "The back of the bus features an advertisement."},
        ]
    }


def test_native_presets_and_pretokenized_pass_rows_through():
    chat = {"messages": GOLDEN["sharegpt"]["messages"]}
    assert convert("messages", chat) == chat
    assert convert("text", {"text": "plain words", "meta": 1}) == {"text": "plain words"}
    row = {"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "source": "x"}
    assert convert("pretokenized", row) == {"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}


def test_columns_rename_row_fields_and_message_keys():
    row = {"dialog": [{"speaker": "human", "text": "hi"}, {"speaker": "gpt", "text": "hello"}]}
    names = {"conversations": "dialog", "from": "speaker", "value": "text"}
    assert convert("sharegpt", row, names=names) == {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    }
    alpaca = {"prompt": "Add 2 and 3.", "completion": "5"}
    assert convert("alpaca", alpaca, names={"instruction": "prompt", "output": "completion"})["messages"][
        -1
    ] == {
        "role": "assistant",
        "content": "5",
    }


def _section(files: list[str], **kwargs) -> DataSection:
    return DataSection(train_files=tuple(files), num_workers=0, max_seq_len=512, **kwargs)


def _index(section: DataSection, tok=None, **options):
    enc = encoder_for(section, tok or tokenizer(), **options)
    return enc, *index_files(section, section.train_files, enc)


@pytest.mark.parametrize("preset, row", [("sharegpt", SHAREGPT), ("alpaca", ALPACA), ("openai", OPENAI)])
@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_each_preset_trains_exactly_as_its_native_rows(tmp_path, preset, row, suffix):
    write = write_jsonl if suffix == "jsonl" else write_parquet
    if (
        suffix == "parquet" and preset == "openai"
    ):  # a parquet column holds strings or lists of parts, not both
        row = {"messages": [{**m, "content": "".join(p["text"] for p in m["content"])} if isinstance(m["content"], list)
                            else m for m in row["messages"]]}  # fmt: skip
    # parquet gives every message of a column the same struct fields: the weight column reads back as None where
    # a message had none, which must mean "no weight" (the default loss choice).
    files = [str(write(tmp_path / f"rows.{suffix}", [row, row]))]
    enc, source, index = _index(_section(files, format=preset))
    native = [str(write_jsonl(tmp_path / "native.jsonl", [GOLDEN[preset]] * 2))]
    want_enc, want_source, want = _index(_section(native))
    assert index.lengths.tolist() == want.lengths.tolist() and index.trained.tolist() == want.trained.tolist()
    ids, trained = enc(source[0], source.ref(0))
    want_ids, want_trained = want_enc(want_source[0], want_source.ref(0))
    assert np.array_equal(ids, want_ids) and np.array_equal(trained, want_trained)


def test_pretokenized_rows_skip_the_tokenizer(tmp_path):
    rows = [
        {"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, 7, 8, 9]},
        {"input_ids": [5, 6, 7], "loss_mask": [1, 0, 1]},
        {"input_ids": [10, 11, 12], "attention_mask": [1, 1, 1]},
    ]
    files = [str(write_jsonl(tmp_path / "tokens.jsonl", rows))]
    enc, source, index = _index(_section(files, format="pretokenized", kind="text"))
    assert index.lengths.tolist() == [5, 3, 3] and index.trained.tolist() == [3, 1, 2]
    ids, trained = enc(source[1], source.ref(1))
    assert ids.tolist() == [5, 6, 7] and trained.tolist() == [False, False, True]


@pytest.mark.parametrize(
    "row, message",
    [
        ({"input_ids": [1, 2], "labels": [-100, 1]}, r"labels\[1\]=1 is neither -100 nor input_ids\[1\]=2"),
        ({"input_ids": [1, 99999]}, r"input_ids\[1\]=99999 is outside the tokenizer's vocabulary of 1024"),
        ({"input_ids": [1, 2], "loss_mask": [1]}, "'loss_mask' has 1 entries but 'input_ids' has 2"),
        ({"input_ids": [1, 2], "attention_mask": [1, 0]}, "'attention_mask' holds a 0"),
        ({"input_ids": ["a"]}, "'input_ids' must be a list of integers"),
        ({"ids": [1]}, r"no column 'input_ids'; the row has \['ids'\]"),
    ],
)
def test_pretokenized_errors_name_file_row_and_preset(tmp_path, row, message):
    files = [str(write_jsonl(tmp_path / "tokens.jsonl", [{"input_ids": [1, 2]}, row]))]
    with pytest.raises(DataError, match=rf"tokens.jsonl line 2: .*{message}.*\(data.format: pretokenized\)"):
        _index(_section(files, format="pretokenized", kind="text"))


@pytest.mark.parametrize(
    "preset, row, message",
    [
        (
            "sharegpt",
            {"conversations": [{"from": "bot", "value": "x"}]},
            r"message 0 has from='bot'; expected one of",
        ),
        ("sharegpt", {"messages": []}, r"no column 'conversations'; the row has \['messages'\]"),
        (
            "sharegpt",
            {"conversations": [{"from": "human", "value": 3}]},
            "message 0 'value' must be a string",
        ),
        ("alpaca", {"instruction": "x"}, r"no column 'output'; the row has \['instruction'\]"),
        ("alpaca", {"instruction": "x", "output": "y", "history": [["a"]]}, "history turn 0 must be a"),
        ("openai", {"messages": [{"role": "robot", "content": "x"}]}, "message 0 has role='robot'"),
        ("openai", {"messages": [{"role": "user", "content": "x", "weight": 2}]}, "message 0 has weight=2"),
        (
            "sharegpt",
            {
                "conversations": [
                    {"from": "human", "value": "<image>\nWhat is it?"},
                    {"from": "gpt", "value": "A bus."},
                ]
            },
            "message 0 holds a <image> placeholder, but data.kind is conversation",
        ),
    ],
)
def test_conversion_errors_name_file_row_and_preset(tmp_path, preset, row, message):
    good = {"sharegpt": SHAREGPT, "openai": OPENAI, "alpaca": ALPACA}[preset]
    files = [str(write_jsonl(tmp_path / "rows.jsonl", [good, good, row]))]
    with pytest.raises(DataError, match=rf"rows.jsonl line 3: {message}.*\(data.format: {preset}\)"):
        _index(_section(files, format=preset))


def test_llava_under_kind_conversation_is_refused_when_the_recipe_is_read():
    with pytest.raises(
        RecipeError,
        match="llava rows are converted for data.kind in .'multimodal'.*use data.kind: multimodal",
    ):
        _section(["x.jsonl"], format="llava")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"format": "jsonl"},
            "'jsonl' is a file format; data.format names the row format .* data.file_format",
        ),
        ({"format": "sharegtp"}, "did you mean 'sharegpt'"),
        ({"format": "sharegpt", "columns": {"conversation": "c"}}, "did you mean 'conversations'"),
        ({"columns": {"messages": "dialog"}}, "data.columns: renames the columns a data.format preset reads"),
        (
            {"format": "text"},
            r"text rows are converted for data.kind in \['text'\], but data.kind is 'conversation'",
        ),
        (
            {"format": "pretokenized", "chat_template": "chatml"},
            "pretokenized rows are not rendered",
        ),
    ],
)
def test_recipe_errors(kwargs, message):
    with pytest.raises(RecipeError, match=message):
        _section(["x.jsonl"], **kwargs)


def test_every_preset_names_its_kinds():
    assert set(PRESETS) == {"sharegpt", "alpaca", "openai", "llava", "messages", "text", "pretokenized"}
    assert PRESETS["llava"].kinds == ("multimodal",)


@pytest.fixture(scope="module")
def processor_dir(tmp_path_factory) -> str:
    return make_processor_dir(tmp_path_factory.mktemp("processor"))


def test_llava_files_train_their_images_like_native_rows(tmp_path, processor_dir):
    media = tmp_path / "media"
    (media / "coco").mkdir(parents=True)
    (media / "coco" / "bus.png").write_bytes(png(16, 16))
    llava = {**LLAVA, "image": "coco/bus.png"}
    native = convert("llava", llava, multimodal=True)
    assert native["messages"][0]["content"][0] == {"type": "image", "image": "coco/bus.png"}
    files = [str(write_jsonl(tmp_path / "llava.jsonl", [llava] * 3))]
    tok, options = load_tokenizer(processor_dir), model_data(tiny_vlm_config())
    section = _section(files, format="llava", kind="multimodal", media_root=str(media))
    enc, source, index = _index(section, tok, **options)
    native_files = [str(write_jsonl(tmp_path / "native.jsonl", [native] * 3))]
    want_enc, want_source, want = _index(
        _section(native_files, kind="multimodal", media_root=str(media)), tok, **options
    )
    assert index.patches.tolist() == want.patches.tolist() and index.patches[0] > 0
    assert index.lengths.tolist() == want.lengths.tolist()
    ids, trained, media_sample = enc(source[0], source.ref(0))
    want_ids, want_trained, want_media = want_enc(want_source[0], want_source.ref(0))
    assert np.array_equal(ids, want_ids) and np.array_equal(trained, want_trained)
    assert np.array_equal(media_sample.pixel_values, want_media.pixel_values)
    # A LLaVA row whose image is missing names the file, the row and the image, as native rows do.
    missing = [str(write_jsonl(tmp_path / "missing.jsonl", [{**llava, "image": "coco/none.png"}]))]
    with pytest.raises(DataError, match=r"missing.jsonl line 1: .*no such image file"):
        _index(_section(missing, format="llava", kind="multimodal", media_root=str(media)), tok, **options)


def test_llava_placeholder_mismatch_names_the_preset(tmp_path):
    row = {
        "image": "a.png",
        "conversations": [{"from": "human", "value": "no placeholder"}, {"from": "gpt", "value": "x"}],
    }
    with pytest.raises(DataError, match=r"rows.jsonl line 7: 0 <image> placeholder.*\(data.format: llava\)"):
        convert("llava", row, multimodal=True)


def test_the_quickstart_rows_train_the_same_through_the_messages_preset(tmp_path):
    from veomni.train.recipe import ASSETS_DIR

    files = [str(Path(ASSETS_DIR) / "quickstart" / "eval.jsonl")]
    _, _, plain = _index(_section(files))
    _, _, preset = _index(_section(files, format="messages"))
    assert plain.digest() == preset.digest()
