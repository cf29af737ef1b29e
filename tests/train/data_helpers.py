"""Shared helpers of the data tests: the bundled tokenizer, tiny data files, samples."""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

import numpy as np

from veomni.train.data import DataTopology, Sample, TrainData, build_encoder, index_dataset, load_tokenizer
from veomni.train.data.sources import RowSource
from veomni.train.recipe import ASSETS_DIR

TOKENIZER_DIR = str(ASSETS_DIR / "quickstart" / "tokenizer")
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "omicron",
    "pi",
    "rho",
    "sigma",
    "tau",
]


@functools.cache
def tokenizer():
    return load_tokenizer(TOKENIZER_DIR)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=7)
    return path


def text_rows(n: int, seed: int = 0, max_words: int = 40) -> list[dict]:
    rng = random.Random(seed)
    return [{"text": " ".join(rng.choices(WORDS, k=rng.randint(1, max_words)))} for _ in range(n)]


def chat(*turns: str, system: str | None = None, **extra) -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    for i, content in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": content})
    return {"messages": messages, **extra}


def random_sample(rng: np.random.Generator, index: int, length: int) -> Sample:
    ids = rng.integers(0, 1000, size=length, dtype=np.int64)
    trained = rng.random(length) < 0.6
    trained[0] = False
    return Sample(ids, trained, index)


def text_data(path: Path, rows: int = 90, seed: int = 0, max_seq_len: int = 64):
    """(source, encoder, index) for ``rows`` random texts written to ``path``."""
    write_jsonl(path, text_rows(rows, seed))
    encoder = build_encoder(tokenizer(), "text")
    source = RowSource([str(path)], "auto", encoder.columns)
    index = index_dataset(source, encoder, max_seq_len=max_seq_len, overlong="truncate")
    return source, encoder, index


def train_data(source, encoder, index, *, dp_rank=0, dp_size=1, sp_rank=0, sp_size=1, **kwargs) -> TrainData:
    args = dict(
        tokens_per_micro_batch=128, grad_accum=2, seed=7, shuffle=True, max_seq_len=64, overlong="truncate"
    )
    args.update(kwargs)
    topology = DataTopology(dp_rank=dp_rank, dp_size=dp_size, sp_rank=sp_rank, sp_size=sp_size)
    return TrainData(source, encoder, index, topology=topology, **args)
