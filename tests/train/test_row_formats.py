"""Row formats of multimodal data (`veomni.train.data.row_formats`): LLaVA / ShareGPT rows, OpenAI chat parts and
payload-free parts beside top-level media lists encode exactly as the native row does; every mismatch between
placeholders and media, in any format, is an error naming the row; media in text-only data and a multimodal
dataset without any medium are refused."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import numpy as np
import pytest
from data_helpers import chat, tokenizer, write_jsonl, write_parquet
from test_multimodal_data import encoder, image_row, make_processor_dir, model_data, png, tiny_vlm_config

from veomni.train.data import DataError, RowRef, build_encoder
from veomni.train.data.build import encoder_for, index_files
from veomni.train.data.row_formats import native_row
from veomni.train.data.sources import bad_row_kind
from veomni.train.recipe import DataSection

REF = RowRef("rows.jsonl", 4, 5)
QUESTION, ANSWER = "What is this?", "A red square."


@pytest.fixture(scope="module")
def processor_dir(tmp_path_factory) -> str:
    return make_processor_dir(tmp_path_factory.mktemp("processor"))


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("media")
    (root / "a.png").write_bytes(png(16, 16))
    (root / "b.png").write_bytes(png(8, 12, 1))
    return root


def native() -> dict:
    """The native row every other shape below must encode to: images a.png, b.png, then the question."""
    return image_row("a.png", "b.png", answer=ANSWER)


def llava() -> dict:
    return {
        "id": "000000033471",
        "images": ["a.png", "b.png"],
        "conversations": [
            {"from": "human", "value": f"<image><image>{QUESTION}"},
            {"from": "gpt", "value": ANSWER},
        ],
    }


def openai(media: Path) -> dict:
    data_url = "data:image/png;base64," + base64.b64encode((media / "b.png").read_bytes()).decode()
    return {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "file://" + str(media / "a.png")}},
                    {"type": "image_url", "image_url": {"url": data_url}},
                    {"type": "text", "text": QUESTION},
                ],
            },
            {"role": "assistant", "content": [{"type": "text", "text": ANSWER}]},
        ]
    }


def payload_free() -> dict:
    return {
        "images": ["a.png", "b.png"],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": QUESTION}],
            },
            {"role": "assistant", "content": ANSWER},
        ],
    }


def placeholders_in_messages() -> dict:  # LLaMA-Factory's layout
    return {
        "images": ["a.png", "b.png"],
        "messages": [
            {"role": "user", "content": f"<image><image>{QUESTION}"},
            {"role": "assistant", "content": ANSWER},
        ],
    }


@pytest.mark.parametrize("shape", ["llava", "openai", "payload_free", "placeholders_in_messages"])
def test_each_row_shape_encodes_as_the_native_row(shape, processor_dir, media):
    enc = encoder(processor_dir, media_root=str(media))
    make = {"llava": llava, "openai": lambda: openai(media), "payload_free": payload_free,
            "placeholders_in_messages": placeholders_in_messages}[shape]  # fmt: skip
    ids, trained, got = enc(make(), REF)
    want_ids, want_trained, want = enc(native(), REF)
    assert np.array_equal(ids, want_ids) and np.array_equal(trained, want_trained)
    assert np.array_equal(got.pixel_values, want.pixel_values)
    assert got.image_grid_thw.tolist() == [[1, 8, 8], [1, 4, 6]]
    assert enc.tokenizer.decode(ids[trained]) == f"{ANSWER}<|im_end|>\n"
    assert enc.measure(make(), REF) == enc.measure(native(), REF)


def test_sharegpt_roles_system_and_a_single_image_key():
    row = {
        "image": "x.jpg",
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "<image>\nDescribe it.", "loss_mask": 0},
            {"from": "gpt", "value": "A cat."},
        ],
    }
    assert native_row(row, "messages", REF) == {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "image", "image": "x.jpg"}, {"type": "text", "text": "\nDescribe it."}],
             "loss_mask": 0},
            {"role": "assistant", "content": "A cat."},
        ]
    }  # fmt: skip


def test_openai_input_audio_becomes_an_audio_part_with_the_decoded_bytes():
    wav = b"RIFF....WAVEfmt "
    row = {
        "messages": [
            {"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
                {"type": "text", "text": "What is said?"},
            ]},
            {"role": "assistant", "content": "Hello."},
        ]
    }  # fmt: skip
    parts = native_row(row, "messages", REF)["messages"][0]["content"]
    assert parts == [{"type": "audio", "audio": wav}, {"type": "text", "text": "What is said?"}]


def _row(user: str, **media) -> dict:
    return {"conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": "ok"}], **media}


BAD = {
    "more placeholders than images": (
        _row("<image><image> two?", images=["a.png"]),
        r"2 <image> placeholder\(s\) or payload-free image part\(s\) in the conversation but 1 image\(s\) in the "
        r"row's 'images' list",
    ),
    "more images than placeholders": (
        _row("no placeholder", images=["a.png"]),
        r"0 <image> placeholder\(s\) .* but 1 image\(s\)",
    ),
    "placeholder without any image": (
        chat("look at <image>", "ok"),
        r"1 <image> placeholder\(s\) .* but 0 image\(s\)",
    ),
    "audio placeholder without audio": (_row("<audio> hear", images=[]), r"1 <audio> placeholder\(s\)"),
    "payload-free part without a list": (
        {"messages": [{"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": "x"}]},
        r"1 <image> placeholder\(s\) or payload-free image part\(s\) .* but 0 image\(s\)",
    ),
    "unknown sharegpt role": (
        {"conversations": [{"from": "robot", "value": "hi"}]},
        r"message 0 is from 'robot'; ShareGPT messages must be from one of \['assistant', 'gpt', 'human'",
    ),
    "remote url": (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]},
        r"message 0 part 0: image_url 'https://x/y.png' is remote; nothing is downloaded",
    ),
    "bad base64": (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "data:image/png;base64,@@"}]}]},
        r"message 0 part 0 \(image_url data URL\): not valid base64",
    ),
    "image_url without url": (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        r"an image_url part needs \{'image_url': \{'url': str\}\}",
    ),
    "both image and images": (_row("<image>", images=["a.png"], image="b.png"), "gives both 'images' and 'image'"),
    "images not a list": (_row("<image>", images="a.png"), "'images' must be a list of images"),
    "no messages at all": ({"text": "hi"}, r"no field 'messages' \(data.messages_field\) or 'conversations'"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BAD))
def test_bad_rows_name_the_row_and_what_was_expected(name, processor_dir, media):
    row, message = BAD[name]
    with pytest.raises(DataError, match=f"^{re.escape(str(REF))}: .*{message}"):
        encoder(processor_dir, media_root=str(media))(row, REF)


def test_mismatch_is_a_placeholder_count_bad_row():
    with pytest.raises(DataError) as info:
        native_row(_row("<image>", images=[]), "messages", REF)
    assert bad_row_kind(str(info.value)) == "placeholder/image count mismatch"


@pytest.mark.parametrize(
    "row, found",
    [
        (chat("hi", "ok", images=["a.png"]), r"'images' \(1\)"),
        (_row("look") | {"messages": image_row("a.png")["messages"]}, r"message 0 part 0 of type 'image'"),
        (chat("hi", "ok", audio="a.wav"), r"'audio' \(1\)"),
    ],
)
def test_media_in_text_conversation_data_is_refused(row, found):
    enc = build_encoder(tokenizer(), "conversation")
    with pytest.raises(
        DataError, match=f"{re.escape(str(REF))}: the row carries media \\({found}.*data.kind is conv"
    ):
        enc(row, REF)


def test_parquet_text_data_reads_its_media_columns_to_refuse_them(tmp_path):
    rows = [chat("hi", "ok") | {"images": ["a.png"]}, chat("hi", "ok") | {"images": []}]
    path = str(write_parquet(tmp_path / "rows.parquet", rows))
    section = DataSection(train_files=[path], kind="conversation", num_workers=0)
    with pytest.raises(DataError, match=r"row 0 \(0-based\): the row carries media \('images' \(1\)\)"):
        index_files(section, [path], encoder_for(section, tokenizer()))


def _section(files: list[str], media: Path, **kwargs) -> DataSection:
    return DataSection(
        train_files=files, kind="multimodal", media_root=str(media), num_workers=0, max_seq_len=256, **kwargs
    )


def test_a_multimodal_dataset_without_media_is_refused_at_build(tmp_path, processor_dir, media):
    from veomni.train.data.encode import load_tokenizer

    files = [str(write_jsonl(tmp_path / "rows.jsonl", [chat(f"q {k}", f"a {k}") for k in range(40)]))]
    section = _section(files, media)
    enc = encoder_for(section, load_tokenizer(processor_dir), **model_data(tiny_vlm_config()))
    with pytest.raises(
        DataError, match=r"data: data.kind is multimodal but none of 16 rows sampled from .*rows.jsonl.* holds an "
        r"image, video or audio; for text conversations set data.kind: conversation",
    ):  # fmt: skip
        index_files(section, files, enc)
    # One row with an image among them is enough.
    rows = [chat(f"q {k}", f"a {k}") for k in range(40)]
    rows[0] = native()
    files = [str(write_jsonl(tmp_path / "some.jsonl", rows))]
    _, index = index_files(_section(files, media), files, enc)
    assert index.num_rows == 40 and index.patches[0] > 0


def test_llava_parquet_files_index_like_their_jsonl(tmp_path, processor_dir, media):
    from veomni.train.data.encode import load_tokenizer

    rows = [llava() for _ in range(5)]
    files = [
        str(write_parquet(tmp_path / "rows.parquet", rows)),
        str(write_jsonl(tmp_path / "rows.jsonl", rows)),
    ]
    section = _section(files, media)
    _, index = index_files(
        section, files, encoder_for(section, load_tokenizer(processor_dir), **model_data(tiny_vlm_config()))
    )
    assert index.lengths[:5].tolist() == index.lengths[5:].tolist() and index.lengths[0] > 22
    assert json.dumps(rows[0])  # the row stays plain JSON: nothing in it is rewritten in place
    assert rows[0]["conversations"][0]["value"].startswith("<image><image>")
