"""HF ``datasets`` sources (`veomni.train.data.hf_sources`, `veomni.train.data.stream`): save_to_disk directories,
.arrow shards, parquet and json through ``load_dataset``, remote paths through fsspec (``file://``, ``memory://``)
index exactly as the jsonl they hold; a streaming dataset packs on the fly and resumes exactly, also on another DP
size; both train through the trainer."""

from __future__ import annotations

import copy
import io
import pickle
from pathlib import Path

import fsspec
import pytest
import torch
from data_helpers import tokenizer
from test_loop import DENSE, tiny_recipe

from veomni.train.data import DataError, DataTopology
from veomni.train.data.build import build_train_data, encoder_for, index_files
from veomni.train.data.hf_sources import HFRows
from veomni.train.recipe import ASSETS_DIR, DataSection, RecipeError, recipe_from_dict, recipe_to_dict

datasets = pytest.importorskip("datasets")
datasets.disable_progress_bars()
ROWS = str(ASSETS_DIR / "quickstart" / "eval.jsonl")  # 48 conversations, some with a per-message loss_mask


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """The quickstart eval rows as a save_to_disk directory (2 shards), a parquet file, and the same in memory://."""
    root = tmp_path_factory.mktemp("hf")
    dataset = datasets.load_dataset("json", data_files=ROWS, split="train", cache_dir=str(root / "cache"))
    dataset.save_to_disk(str(root / "disk"), num_shards=2)
    dataset.to_parquet(str(root / "rows.parquet"))
    dataset.save_to_disk("memory://veomni-test/disk")
    with fsspec.open("memory://veomni-test/rows.parquet", "wb") as out:
        out.write((root / "rows.parquet").read_bytes())
    datasets.DatasetDict({"train": dataset, "test": dataset}).save_to_disk(str(root / "dict"))
    return root


def _index(**data) -> tuple:
    section = DataSection(num_workers=0, **data)
    encoder = encoder_for(section, tokenizer())
    source, index = index_files(section, section.train_files, encoder)
    return source, index


@pytest.mark.parametrize(
    "entry",
    ["disk", "arrow shards", "file:// disk", "memory:// disk", "memory:// parquet", "load_dataset json",
     "load_dataset parquet", "parquet file"],
)  # fmt: skip
def test_every_hf_source_indexes_like_the_jsonl(saved, entry):
    cache = str(saved / "cache")
    data = {
        "disk": {"train_files": (str(saved / "disk"),)},
        "arrow shards": {"train_files": (str(saved / "disk" / "*.arrow"),)},
        "file:// disk": {"train_files": (f"file://{saved / 'disk'}",)},
        "memory:// disk": {"train_files": ("memory://veomni-test/disk",)},
        "memory:// parquet": {"train_files": ("memory://veomni-test/rows.parquet",)},
        "load_dataset json": {"dataset": {"path": "json", "data_files": [ROWS], "cache_dir": cache}},
        "load_dataset parquet": {
            "dataset": {
                "path": "parquet",
                "data_files": str(saved / "rows.parquet"),
                "split": "train",
                "cache_dir": cache,
            }
        },
        "parquet file": {"train_files": (str(saved / "rows.parquet"),)},
    }[entry]
    _, want = _index(train_files=(ROWS,))
    source, index = _index(**data)
    assert index.digest() == want.digest() and index.num_rows == 48
    assert source[5]["messages"] == _index(train_files=(ROWS,))[0][5]["messages"] or entry == "parquet file"
    assert "row 5 (0-based)" in str(source.ref(5))


def test_format_presets_apply_to_hf_rows(saved, tmp_path):
    rows = [
        {"dialog": [{"from": "human", "value": f"q{k}"}, {"from": "gpt", "value": f"a{k}"}]} for k in range(6)
    ]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "sharegpt"))
    source, index = _index(
        train_files=(str(tmp_path / "sharegpt"),), format="sharegpt", columns={"conversations": "dialog"}
    )
    assert source[2] == {
        "messages": [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    }
    assert index.num_rows == 6 and index.trained.min() > 0


def test_image_features_are_read_as_the_files_bytes():
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buffer, format="PNG")
    png = buffer.getvalue()
    features = datasets.Features(
        {"image": datasets.Image(), "images": datasets.List(datasets.Image()), "n": datasets.Value("int32")}
    )
    dataset = datasets.Dataset.from_dict(
        {"image": [{"bytes": png, "path": None}], "images": [[{"bytes": png, "path": None}] * 2], "n": [1]},
        features=features,
    )
    rows = HFRows(dataset, "mem", ["image"], ["images", "videos"])
    assert rows.read(0) == {"image": png, "images": [png, png], "videos": None}
    assert pickle.loads(pickle.dumps(rows)).read(0)["image"] == png


def test_errors_name_the_dataset(saved, tmp_path):
    with pytest.raises(
        DataError, match=r"dict: a DatasetDict with splits \['train', 'test'\]; name the split's directory"
    ):
        _index(train_files=(str(saved / "dict"),))
    with pytest.raises(
        DataError, match=r"disk: missing column\(s\) \['text'\]; the dataset has \['messages'\]"
    ):
        _index(train_files=(str(saved / "disk"),), kind="text")
    with pytest.raises(
        DataError, match=r"the dataset has splits \['train', 'test'\]; choose one with data.dataset.split"
    ):
        _index(dataset={"path": str(saved / "dict")})
    with pytest.raises(DataError, match="memory://veomni-test/none: no such file or directory"):
        _index(train_files=("memory://veomni-test/none",))
    with fsspec.open("memory://veomni-test/notes.txt", "w") as out:
        out.write("not data")
    with pytest.raises(DataError, match="memory://veomni-test/notes.txt: a remote path that is neither"):
        _index(train_files=("memory://veomni-test/notes.txt",))


@pytest.mark.parametrize(
    "data, message",
    [
        (
            {"train_files": ("a.jsonl",), "dataset": {"path": "json"}},
            "data.train_files .*, data.dataset or data.sources, exactly one",
        ),
        ({}, "data.train_files .*, data.dataset or data.sources, exactly one"),
        ({"dataset": {"data_files": "a.jsonl"}}, "data.dataset: needs path"),
        ({"dataset": {"path": "json", "splt": "train"}}, "unknown key 'splt' \\(did you mean 'split'\\?\\)"),
        (
            {"dataset": {"path": "json", "streaming": True}},
            "data.shuffle: a streaming dataset .* set data.shuffle: false",
        ),
    ],
)
def test_recipe_errors(data, message):
    with pytest.raises(RecipeError, match=message):
        DataSection(**data)


def test_paths_in_the_recipe_resolve_and_urls_stay(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "local_dir").mkdir()
    raw = tiny_recipe(str(tmp_path), DENSE)
    raw["data"]["train_files"] = ["memory://bucket/x.jsonl", "rel.jsonl"]
    assert recipe_from_dict(raw).data.train_files == ("memory://bucket/x.jsonl", str(tmp_path / "rel.jsonl"))
    raw["data"]["train_files"] = []
    raw["data"]["dataset"] = {"path": "local_dir", "data_files": ["a.jsonl"], "split": "train"}
    assert recipe_from_dict(raw).data.dataset == {
        "path": str(tmp_path / "local_dir"),
        "data_files": [str(tmp_path / "a.jsonl")],
        "split": "train",
    }
    raw["data"]["dataset"] = {"path": "json", "data_files": {"train": ["a.jsonl"]}}
    assert recipe_from_dict(raw).data.dataset == {
        "path": "json",
        "data_files": {"train": [str(tmp_path / "a.jsonl")]},
    }
    raw["data"]["dataset"]["streaming"] = True
    raw["data"]["shuffle"] = False
    raw["train"].update({"steps": None, "epochs": 1})
    with pytest.raises(RecipeError, match="train.epochs: a streaming dataset has no step count per epoch"):
        recipe_from_dict(raw)


# --- streaming ----------------------------------------------------------------------------------------------------


def _stream_recipe(tmp: str, files: list[str], steps: int = 4) -> dict:
    raw = tiny_recipe(tmp, DENSE, steps=steps)
    raw["data"]["train_files"] = []
    raw["data"]["dataset"] = {"path": "json", "data_files": files, "split": "train", "streaming": True}
    raw["data"]["shuffle"] = False
    return raw


def _steps(recipe, dp: int, rank: int, n: int, state=None, workers: int = 0):
    raw = recipe_to_dict(recipe)
    raw["data"]["num_workers"] = workers
    data = build_train_data(recipe_from_dict(raw), tokenizer(), DataTopology(dp_rank=rank, dp_size=dp))
    if state is not None:
        data.load_state_dict(state)
    it = iter(data)
    return data, [next(it) for _ in range(n)]


def test_a_stream_packs_as_it_reads_and_resumes_exactly_on_any_dp_size(tmp_path):
    recipe = recipe_from_dict(_stream_recipe(str(tmp_path), [ROWS]))
    _, straight = _steps(recipe, 1, 0, 10)
    # 48 rows make 2 steps of 1024 tokens an epoch: the stream ends and is read again, 5 times.
    assert [s.epoch for s in straight] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    first_epoch_1 = next(s for s in straight if s.epoch == 1)
    assert first_epoch_1.tokens == straight[0].tokens  # epoch 1 reads the stream again from its start
    data, _ = _steps(recipe, 1, 0, 3, workers=1)  # a position inside an epoch, read in a DataLoader worker
    state = pickle.loads(pickle.dumps(data.state_dict()))
    _, resumed = _steps(recipe, 1, 0, 7, state)
    _, rank0 = _steps(recipe, 2, 0, 7, state)
    _, rank1 = _steps(recipe, 2, 1, 7, state)
    for want, got, r0, r1 in zip(straight[3:], resumed, rank0, rank1, strict=True):
        assert (got.step, got.epoch, got.tokens, got.valid_tokens) == (
            want.step,
            want.epoch,
            want.tokens,
            want.valid_tokens,
        )
        assert r0.valid_tokens == r1.valid_tokens == want.valid_tokens
        ids = [b["input_ids"] for b in want.micro_batches]
        assert all(torch.equal(a, b["input_ids"]) for a, b in zip(ids, got.micro_batches, strict=True))
        # grad_accum x dp is the recipe's per-step count: dp 2 deals micro-batch g * 2 + r to rank r.
        assert [
            torch.equal(ids[g * 2 + r], m[g]["input_ids"])
            for r, m in ((0, r0.micro_batches), (1, r1.micro_batches))
            for g in range(len(m))
        ] == [True] * len(ids)
    raw = recipe_to_dict(recipe)
    raw["train"].update({"tokens_per_micro_batch": 128, "tokens_per_step": 512})
    raw["data"]["max_seq_len"] = 128
    with pytest.raises(DataError, match="tokens_per_micro_batch: saved 256, now 128"):
        _steps(recipe_from_dict(raw), 1, 0, 1, state)


# --- through the trainer --------------------------------------------------------------------------------------------


def _losses(ctx, raw: dict, n: int) -> list[float]:
    from veomni.train.loop import build_run, train_step

    run = build_run(recipe_from_dict(raw))
    it = iter(run.train_data)
    return [train_step(run, next(it))["loss"] for _ in range(n)]


def _resumed_losses(ctx, raw: dict, split: int, total: int) -> tuple[list[float], list[float]]:
    from veomni.train.loop import _save, build_run, train_step

    straight = build_run(recipe_from_dict(raw))
    it = iter(straight.train_data)
    want = [train_step(straight, next(it))["loss"] for _ in range(total)]
    first = build_run(recipe_from_dict(raw))
    it = iter(first.train_data)
    got = [train_step(first, next(it))["loss"] for _ in range(split)]
    _save(first)
    resumed = copy.deepcopy(raw)
    resumed["checkpoint"]["resume"] = "auto"
    second = build_run(recipe_from_dict(resumed))
    it = iter(second.train_data)
    got += [train_step(second, next(it))["loss"] for _ in range(total - split)]
    return want, got


@pytest.mark.slow  # slow tier: three short CPU runs of the tiny model
def test_a_dataset_directory_and_a_stream_train_through_the_trainer(dist_pools, saved, tmp_path):
    pool = dist_pools.get(1, "gloo")
    raw = tiny_recipe(str(tmp_path / "jsonl"), DENSE, steps=3)
    raw["data"]["train_files"] = [ROWS]
    (want,) = pool.run(_losses, raw, 3)
    raw = tiny_recipe(str(tmp_path / "disk"), DENSE, steps=3)
    raw["data"]["train_files"] = [str(saved / "disk")]
    (got,) = pool.run(_losses, raw, 3)
    assert got == want  # the same rows in the same order: the same losses, bit for bit
    ((straight, resumed),) = pool.run(
        _resumed_losses, _stream_recipe(str(tmp_path / "stream"), [ROWS], 4), 2, 4
    )
    assert resumed == straight
