"""Row sources, encoders and the exact token index: bad rows, loss masks, length policy, token counts."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch.distributed as dist
from data_helpers import TOKENIZER_DIR, chat, text_rows, tokenizer, write_jsonl, write_parquet

from veomni.train.data import (
    DataError,
    RowSource,
    build_encoder,
    encode_row,
    index_dataset,
    load_tokenizer,
)
from veomni.train.recipe import ASSETS_DIR


def encode(rows, tmp_path, kind="conversation", max_seq_len=4096, overlong="error", **kwargs):
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    encoder = build_encoder(tokenizer(), kind, **kwargs)
    source = RowSource([str(path)], "auto", encoder.columns)
    return [encode_row(source, encoder, i, max_seq_len, overlong) for i in range(len(source))]


def runs(sample, trained: bool) -> list[str]:
    """Decoded maximal runs of tokens whose trained flag equals ``trained``."""
    out, current = [], []
    for token, flag in zip(sample.input_ids.tolist(), sample.trained.tolist(), strict=True):
        if flag == trained:
            current.append(token)
        elif current:
            out.append(tokenizer().decode(current))
            current = []
    if current:
        out.append(tokenizer().decode(current))
    return out


# --- bad rows ---------------------------------------------------------------------------------------------------

GOOD_TEXT = json.dumps({"text": "fine"})
GOOD_CHAT = json.dumps(chat("q", "a"))


@pytest.mark.parametrize(
    "kind, bad, message",
    [
        ("text", "{not json", "line 3: not valid JSON"),
        ("text", "[1, 2]", "line 3: expected a JSON object, found list"),
        ("text", json.dumps({"text": 5}), "line 3: field 'text' must be a string, found int"),
        (
            "text",
            json.dumps({"body": "x"}),
            "line 3: no field 'text' \\(data.text_field\\); the row has \\['body'\\]",
        ),
        ("conversation", json.dumps({"messages": []}), "line 3: 'messages' must be a non-empty list"),
        ("conversation", json.dumps({"messages": ["hi"]}), "line 3: message 0 must be an object, found str"),
        ("conversation", json.dumps(chat("q", None)), "line 3: message 1 needs string 'role' and 'content'"),
        (
            "conversation",
            json.dumps({"messages": [{"role": "user", "content": "q", "loss_mask": 2}]}),
            "line 3: message 0 has loss_mask=2; expected 0, 1, true or false",
        ),
    ],
)
def test_bad_row_error_names_file_and_line(tmp_path, kind, bad, message):
    good = GOOD_TEXT if kind == "text" else GOOD_CHAT
    path = tmp_path / "data.jsonl"
    path.write_text(f"{good}\n\n{bad}\n{good}\n")  # the blank line 2 is skipped but still counted
    encoder = build_encoder(tokenizer(), kind)
    source = RowSource([str(path)], "auto", encoder.columns)
    assert len(source) == 3
    with pytest.raises(DataError, match=f"{path} {message}"):
        index_dataset(source, encoder, max_seq_len=64, overlong="error")


def test_bad_row_error_survives_a_worker_process(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [{"text": "ok"}] * 5 + ['{"text": 1}'])
    encoder = build_encoder(tokenizer(), "text")
    source = RowSource([str(path)], "auto", encoder.columns)
    with pytest.raises(DataError, match=f"{path} line 6: field 'text' must be a string"):
        index_dataset(source, encoder, max_seq_len=64, overlong="error", num_workers=1, chunk_rows=2)


def test_parquet_rows_and_errors(tmp_path):
    rows = text_rows(20, seed=3)
    jsonl = write_jsonl(tmp_path / "a.jsonl", rows)
    parquet = write_parquet(tmp_path / "a.parquet", rows)
    encoder = build_encoder(tokenizer(), "text")
    from_jsonl = index_dataset(
        RowSource([str(jsonl)], "auto", ("text",)), encoder, max_seq_len=64, overlong="truncate"
    )
    both = RowSource([str(parquet), str(jsonl)], "auto", ("text",))
    from_both = index_dataset(both, encoder, max_seq_len=64, overlong="truncate")
    assert np.array_equal(from_both.lengths, np.concatenate([from_jsonl.lengths, from_jsonl.lengths]))
    assert str(both.ref(3)) == f"{parquet} row 3 (0-based)" and str(both.ref(23)) == f"{jsonl} line 4"

    with pytest.raises(DataError, match=r"missing column\(s\) \['messages'\]; the file has \['text'\]"):
        RowSource([str(parquet)], "parquet", ("messages",))
    bad = write_parquet(tmp_path / "bad.parquet", [{"text": "a"}, {"text": None}])
    with pytest.raises(
        DataError, match=f"{bad} row 1 \\(0-based\\): field 'text' must be a string, found NoneType"
    ):
        index_dataset(RowSource([str(bad)], "auto", ("text",)), encoder, max_seq_len=64, overlong="truncate")
    (tmp_path / "x.csv").write_text("text\n")
    with pytest.raises(DataError, match="cannot tell the format from the extension"):
        RowSource([str(tmp_path / "x.csv")], "auto", ("text",))
    with pytest.raises(DataError, match="no such data file"):
        RowSource([str(tmp_path / "missing.jsonl")], "auto", ("text",))


# --- encoders ---------------------------------------------------------------------------------------------------


def test_assistant_only_loss_trains_only_what_the_assistant_writes(tmp_path):
    row = chat("What is 2 + 2?", "4.", "And 3 + 3?", "6.", system="Be brief.")
    (sample,) = encode([row], tmp_path)
    assert runs(sample, True) == ["4.<|im_end|>\n", "6.<|im_end|>\n"]
    rendered = tokenizer().apply_chat_template(row["messages"], tokenize=False)
    assert sample.input_ids.tolist() == tokenizer()(rendered, add_special_tokens=False)["input_ids"]
    assert not sample.trained[0]


def test_all_messages_trained_except_headers(tmp_path):
    (sample,) = encode([chat("Q1", "A1", system="S")], tmp_path, assistant_only_loss=False)
    # Token 0 has no predecessor; the assistant's generation header is never trained.
    assert runs(sample, False) == ["<|im_start|>", "<|im_start|>assistant\n"]


def test_per_message_loss_mask_overrides_the_default(tmp_path):
    row = chat("Q1", "A1", "Q2", "A2")
    row["messages"][1]["loss_mask"] = 0
    row["messages"][2]["loss_mask"] = True
    (sample,) = encode([row], tmp_path)
    assert runs(sample, True) == ["<|im_start|>user\nQ2<|im_end|>\n", "A2<|im_end|>\n"]
    (sample,) = encode([row], tmp_path, loss_mask_field=None)  # the field is then ignored
    assert runs(sample, True) == ["A1<|im_end|>\n", "A2<|im_end|>\n"]


def test_an_opening_assistant_message_keeps_its_header_untrained(tmp_path):
    # No earlier turn to put a generation prompt after: the header must still be found, not trained.
    row = {"messages": [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Bye."}]}  # fmt: skip
    (sample,) = encode([row], tmp_path)
    assert runs(sample, True) == ["Hello!<|im_end|>\n", "Bye.<|im_end|>\n"]
    (sample,) = encode([row], tmp_path, assistant_only_loss=False)
    assert runs(sample, False) == ["<|im_start|>assistant\n", "<|im_start|>assistant\n"]


def test_parquet_messages_without_a_loss_mask_take_the_default(tmp_path):
    # Parquet gives every message the same struct fields: the unflagged message reads back with loss_mask None.
    row = {
        "messages": [
            {"role": "user", "content": "Q1", "loss_mask": 1},
            {"role": "assistant", "content": "A1"},
        ]
    }
    path = write_parquet(tmp_path / "rows.parquet", [row])
    encoder = build_encoder(tokenizer(), "conversation")
    source = RowSource([str(path)], "auto", encoder.columns)
    assert source[0]["messages"][1] == {"role": "assistant", "content": "A1", "loss_mask": None}
    sample = encode_row(source, encoder, 0, 4096, "error")
    assert runs(sample, True) == ["user\nQ1<|im_end|>\n", "A1<|im_end|>\n"]


def test_a_tokenizer_without_a_chat_template_is_an_error():
    # Templates that are not prefix-stable, or whose messages cannot be located: tests/train/test_chat_template.py.
    tok = copy.deepcopy(tokenizer())
    tok.chat_template = None
    with pytest.raises(DataError, match="the tokenizer has no chat_template"):
        build_encoder(tok, "conversation")


def test_text_rows_train_every_token_after_the_first(tmp_path):
    (sample,) = encode([{"text": "alpha beta"}], tmp_path, kind="text")
    expected = tokenizer()("alpha beta")["input_ids"] + [tokenizer().eos_token_id]
    assert sample.input_ids.tolist() == expected
    assert sample.trained.tolist() == [False] + [True] * (len(expected) - 1)
    (sample,) = encode([{"text": "alpha beta"}], tmp_path, kind="text", add_eos=False)
    assert sample.input_ids.tolist() == expected[:-1]


def test_text_rows_end_with_one_eos_where_the_tokenizer_adds_it_itself(tmp_path):
    from tokenizers.processors import TemplateProcessing

    tok = copy.deepcopy(tokenizer())
    eos = tok.eos_token
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"$A {eos}", special_tokens=[(eos, tok.eos_token_id)]
    )
    encoder = build_encoder(tok, "text")
    path = write_jsonl(tmp_path / "rows.jsonl", [{"text": "alpha beta"}])
    sample = encode_row(RowSource([str(path)], "auto", encoder.columns), encoder, 0, 64, "error")
    assert sample.input_ids.tolist() == tokenizer()("alpha beta")["input_ids"] + [tok.eos_token_id]


def test_overlong_policies(tmp_path):
    rows = [{"text": "alpha " * 30}, {"text": "beta"}]
    long, short = encode(rows, tmp_path, kind="text", max_seq_len=10, overlong="truncate")
    assert len(long.input_ids) == 10 and long.truncated and not short.truncated
    assert encode(rows, tmp_path, kind="text", max_seq_len=10, overlong="drop")[0] is None
    n = len(tokenizer()(rows[0]["text"])["input_ids"]) + 1
    with pytest.raises(DataError, match=f"line 1: {n} tokens, longer than data.max_seq_len=10"):
        encode(rows, tmp_path, kind="text", max_seq_len=10, overlong="error")
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    source = RowSource([str(path)], "auto", ("text",))
    index = index_dataset(source, build_encoder(tokenizer(), "text"), max_seq_len=10, overlong="drop")
    assert (
        index.lengths[0] == 0 and 0 < index.lengths[1] <= 10 and (index.dropped, index.num_samples) == (1, 1)
    )


def test_token_count_is_exact(tmp_path):
    path = ASSETS_DIR / "quickstart" / "eval.jsonl"
    encoder = build_encoder(tokenizer(), "conversation")
    index = index_dataset(
        RowSource([str(path)], "auto", encoder.columns), encoder, max_seq_len=4096, overlong="error"
    )
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    expected = [
        len(
            tokenizer()(
                tokenizer().apply_chat_template(r["messages"], tokenize=False), add_special_tokens=False
            )["input_ids"]
        )
        for r in rows
    ]
    assert index.lengths.tolist() == expected and index.total_tokens == sum(expected)
    assert 0 < index.total_trained_tokens < index.total_tokens


def test_missing_tokenizer_directory(tmp_path):
    with pytest.raises(DataError, match="tokenizer directory .* does not exist"):
        load_tokenizer(str(tmp_path / "nope"))


def _index_on_rank(ctx, path: str) -> list[int]:
    encoder = build_encoder(load_tokenizer(TOKENIZER_DIR), "text")
    source = RowSource([path], "auto", encoder.columns)
    index = index_dataset(
        source, encoder, max_seq_len=64, overlong="truncate", group=dist.group.WORLD, chunk_rows=4
    )
    return index.lengths.tolist()


def test_index_split_over_a_process_group(tmp_path, dist_pools):
    path = write_jsonl(tmp_path / "rows.jsonl", text_rows(30, seed=5))
    encoder = build_encoder(tokenizer(), "text")
    alone = index_dataset(
        RowSource([str(path)], "auto", ("text",)), encoder, max_seq_len=64, overlong="truncate"
    )
    per_rank = dist_pools.get(2).run(_index_on_rank, str(path))
    assert per_rank[0] == per_rank[1] == alone.lengths.tolist()


@pytest.mark.parametrize("overlong, what", [("drop", "left out"), ("truncate", "truncated")])
def test_over_long_rows_of_every_file_list_are_counted_in_a_warning(tmp_path, caplog, overlong, what):
    # The training data's counts are in the run's start-up summary; the evaluation data has none, so its rows
    # left out or cut by data.overlong would change the eval loss without a word. index_files reports both lists.
    import logging

    from veomni.train.data.build import encoder_for, index_files
    from veomni.train.recipe import DataSection

    rows = [{"text": "alpha " * 30}, {"text": "beta"}, {"text": "gamma " * 20}]
    files = [str(write_jsonl(tmp_path / "eval.jsonl", rows))]
    section = DataSection(train_files=files, kind="text", max_seq_len=10, overlong=overlong, num_workers=0)
    with caplog.at_level(logging.WARNING, logger="veomni.train.data.build"):
        index_files(section, files, encoder_for(section, tokenizer()), what="data.eval_files")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"data.eval_files: 2 of 3 rows are longer than data.max_seq_len=10 and were {what} (data.overlong={overlong})"
    ]


def test_trained_tokens_are_checked_per_file_of_a_glob(tmp_path, caplog):
    from veomni.train.data.build import check_trained_tokens

    write_jsonl(tmp_path / "a.jsonl", [chat("q", "a")])
    untrained = {
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "loss_mask": 0}]
    }
    write_jsonl(tmp_path / "b.jsonl", [untrained])
    encoder = build_encoder(tokenizer(), "conversation")
    files = [str(tmp_path / "*.jsonl")]
    source = RowSource(files, "auto", encoder.columns)
    index = index_dataset(source, encoder, max_seq_len=64, overlong="error")
    check_trained_tokens(source, index, files, "data.train_files")
    assert f"{tmp_path / 'b.jsonl'} holds 1 rows but no trained token" in caplog.text
