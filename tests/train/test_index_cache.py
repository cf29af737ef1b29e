"""The on-disk cache of the token index (``data.index_cache``, `veomni.train.data.index_cache`): a second start
reads the index instead of tokenising; any change of its key (file content, tokenizer, chat template, settings)
is a miss; bad rows survive the round trip; ranks get rank 0's read; a resume through the trainer reuses it."""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil

import pytest
import torch.distributed as dist
from data_helpers import TOKENIZER_DIR, chat, tokenizer, write_jsonl
from test_loop import DENSE, tiny_recipe

from veomni.train.data import build as build_module
from veomni.train.data import load_tokenizer
from veomni.train.data.build import encoder_for, index_files
from veomni.train.recipe import DataSection, recipe_from_dict


@pytest.fixture
def counting(monkeypatch):
    """How often the index was built by tokenising (not read from the cache)."""
    calls = []
    real = build_module.index_dataset

    def index_dataset(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(build_module, "index_dataset", index_dataset)
    return calls


def rows(n: int = 12, answer: str = "a") -> list[dict]:
    return [chat(f"question {k}", f"{answer} {k}") for k in range(n)]


def index(tmp_path, files, tok=None, **data):
    section = DataSection(
        train_files=tuple(files), num_workers=0, index_cache=str(tmp_path / "cache"), **data
    )
    return index_files(section, section.train_files, encoder_for(section, tok or tokenizer()))[1]


def test_a_second_start_reads_the_index(tmp_path, counting, caplog):
    files = [str(write_jsonl(tmp_path / "rows.jsonl", rows()))]
    first = index(tmp_path, files)
    with caplog.at_level(logging.INFO, logger="veomni.train.data.index_cache"):
        second = index(tmp_path, files)
    assert len(counting) == 1 and second.digest() == first.digest()
    assert second.lengths.tolist() == first.lengths.tolist() and second.truncated == first.truncated
    assert "token index read from the cache" in caplog.text
    assert len(list((tmp_path / "cache").glob("*.npz"))) == 1


def _edit_same_size(tmp_path, files):
    path = files[0]
    stat = os.stat(path)
    with open(path) as f:
        text = f.read().replace("question 3", "question 9")
    with open(path, "w") as f:
        f.write(text)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size, same time: only the content differs


def _other_tokenizer_files(tmp_path, files):
    copy_dir = tmp_path / "tok"
    shutil.copytree(TOKENIZER_DIR, copy_dir)
    config = json.loads((copy_dir / "tokenizer_config.json").read_text())
    config["model_max_length"] = 12345  # does not change a token, but the tokenizer's files changed
    (copy_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return {"tok": load_tokenizer(str(copy_dir))}


CHANGES = {
    "file content": (_edit_same_size, {}),
    "another file": (lambda tmp, files: files.append(str(write_jsonl(tmp / "more.jsonl", rows(3)))), {}),
    "chat template": (None, {"chat_template": "chatml"}),
    "max_seq_len": (None, {"max_seq_len": 16}),
    "overlong": (None, {"overlong": "drop"}),
    "assistant_only_loss": (None, {"assistant_only_loss": False}),
    "format": (None, {"format": "messages"}),
    "on_bad_row": (None, {"on_bad_row": "skip"}),
    "tokenizer files": (_other_tokenizer_files, {}),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_any_change_of_the_key_is_a_miss(tmp_path, counting, change):
    files = [str(write_jsonl(tmp_path / "rows.jsonl", rows()))]
    index(tmp_path, files)
    edit, settings = CHANGES[change]
    extra = (edit(tmp_path, files) if edit else None) or {}
    index(tmp_path, files, tok=extra.get("tok"), **settings)
    assert len(counting) == 2, change  # indexed again
    assert len(list((tmp_path / "cache").glob("*.npz"))) == 2
    index(tmp_path, files, tok=extra.get("tok"), **settings)
    assert len(counting) == 2  # and the new key is cached in turn


def test_bad_rows_and_their_messages_survive_the_cache(tmp_path, counting):
    lines = [json.dumps(r) for r in rows(150)]
    lines[7] = "{not json"
    files = [str(write_jsonl(tmp_path / "rows.jsonl", lines))]
    first = index(tmp_path, files, on_bad_row="skip")
    second = index(tmp_path, files, on_bad_row="skip")
    assert len(counting) == 1 and len(second.bad) == 1
    assert (second.bad.rows.tolist(), second.bad.kinds, second.bad.examples) == (
        first.bad.rows.tolist(), first.bad.kinds, first.bad.examples)  # fmt: skip
    assert second.digest() == first.digest()


def _cached_on_rank(ctx, files: list[str], cache: str) -> tuple[str, int]:
    from veomni.train.data.plan import index_dataset as real

    calls = []
    build_module.index_dataset = lambda *a, **k: calls.append(1) or real(*a, **k)
    section = DataSection(train_files=tuple(files), num_workers=0, index_cache=cache)
    encoder = encoder_for(section, load_tokenizer(TOKENIZER_DIR))
    index_files(section, section.train_files, encoder, group=dist.group.WORLD)
    _, second = index_files(section, section.train_files, encoder, group=dist.group.WORLD)
    build_module.index_dataset = real
    return second.digest(), len(calls)


@pytest.mark.slow  # slow tier: two gloo ranks
def test_ranks_share_rank_0s_read(tmp_path, dist_pools):
    files = [str(write_jsonl(tmp_path / "rows.jsonl", rows(40)))]
    cache = str(tmp_path / "cache")
    (a, calls_a), (b, calls_b) = dist_pools.get(2).run(_cached_on_rank, files, cache)
    assert a == b and calls_a == calls_b == 1
    assert len(list((tmp_path / "cache").glob("*.npz"))) == 1  # written once, by rank 0


def _resume_reads_the_cache(ctx, raw: dict) -> list[str]:
    from veomni.train.loop import _save, build_run, train_step

    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("veomni.train.data.index_cache").addHandler(handler)
    logging.getLogger("veomni.train.data.index_cache").setLevel(logging.INFO)
    first = build_run(recipe_from_dict(raw))
    train_step(first, next(iter(first.train_data)))
    _save(first)
    resumed = copy.deepcopy(raw)
    resumed["checkpoint"]["resume"] = "auto"
    second = build_run(recipe_from_dict(resumed))
    assert second.step == 1
    train_step(second, next(iter(second.train_data)))
    return messages


@pytest.mark.slow  # slow tier: two builds of the tiny model
def test_a_resume_reuses_the_cached_index(dist_pools, tmp_path):
    raw = tiny_recipe(str(tmp_path / "run"), DENSE, steps=2)
    raw["data"]["index_cache"] = str(tmp_path / "cache")
    (messages,) = dist_pools.get(1, "gloo").run(_resume_reads_the_cache, raw)
    assert sum("written to the cache" in m for m in messages) == 1
    assert sum("read from the cache" in m for m in messages) == 1
