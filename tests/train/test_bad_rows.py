"""``data.on_bad_row``: bad rows raise (``error``, the default) or are left out, counted and reported (``skip``).

A bad row is one the reader or encoder rejects with a `DataError`. The index finds them (every row is read once);
under ``skip`` they never reach a plan, so the packed batches equal those of the data with the rows removed. A row
that fails only in a worker (an image whose header parses but whose pixels do not decode) is replaced by a
same-length pad-only filler, so no rank's shapes or collectives change. Too many bad rows is an error either way.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from data_helpers import TOKENIZER_DIR, chat, text_rows, tokenizer, write_jsonl, write_parquet
from test_multimodal_data import IMAGE, image_row, make_processor_dir, png

from veomni.models.qwen3_vl.positions import Qwen3VLPositions
from veomni.train.data import DataError, DataTopology, EvalData, TrainData, build_encoder, index_dataset
from veomni.train.data.multimodal import MultimodalEncoder, load_image_processor
from veomni.train.data.sources import OverlongError, RowSource, bad_row_kind
from veomni.train.recipe import RecipeError, load_recipe, recipe_from_dict, recipe_to_dict

BAD_AT = (3, 7)  # where the bad rows go among the good ones
ROWS = 12


@pytest.fixture(scope="module")
def processor_dir(tmp_path_factory) -> str:
    return make_processor_dir(tmp_path_factory.mktemp("processor"))


def mm_encoder(processor_dir: str, media_root: str, max_patches: int | None = 200) -> MultimodalEncoder:
    return MultimodalEncoder(
        tokenizer_for(processor_dir), load_image_processor(processor_dir), "messages", "loss_mask", True,
        media_root=media_root, max_patches=max_patches, positions=Qwen3VLPositions(IMAGE, 2),
    )  # fmt: skip


def tokenizer_for(path: str):
    from veomni.train.data.encode import load_tokenizer

    return load_tokenizer(path)


def mm_good_rows(root: Path, n: int) -> list[dict]:
    for k in range(4):
        (root / f"{k}.png").write_bytes(png(8 + 4 * k, 12, k))
    return [image_row(f"{k % 4}.png", answer=f"shape {k}") for k in range(n)]


def with_bad(good: list, bad) -> list:
    rows = list(good)
    for at in BAD_AT:
        rows.insert(at, bad)
    return rows


def write(path: Path, rows: list) -> str:
    return str(write_parquet(path, rows) if path.suffix == ".parquet" else write_jsonl(path, rows))


# Each kind: (data kind, file suffix, the bad row (or a function of the media root making it), report kind, error).
KINDS = {
    "invalid json": ("text", ".jsonl", "{not json", "unreadable row", "not valid JSON"),
    "no text field": ("text", ".jsonl", {"body": "x"}, "malformed row", "no field 'text'"),
    "empty text": ("text", ".jsonl", {"text": ""}, "empty row", "produced no tokens"),
    "parquet null text": ("text", ".parquet", {"text": None}, "malformed row", "must be a string, found NoneType"),
    "malformed conversation": (
        "conversation", ".jsonl", {"messages": []}, "malformed row", "must be a non-empty list of messages",
    ),
    "missing image": ("multimodal", ".jsonl", image_row("nope.png"), "missing image file", "no such image file"),
    "corrupt image": ("multimodal", ".jsonl", image_row("junk.png"), "unreadable image", "not a readable image"),
    "inline corrupt image": (
        "multimodal", ".parquet", "inline", "unreadable image", r"inline bytes \(7 B\)\): not a readable image",
    ),
    "placeholder mismatch": (
        "multimodal", ".jsonl", image_row("0.png", answer="see <|image_pad|>"), "placeholder/image count mismatch",
        r"2 <\|image_pad\|> placeholder\(s\) in the rendered conversation but 1 image\(s\)",
    ),
    "over patch budget": (
        "multimodal", ".jsonl", image_row("big.png"), "image over the patch budget",
        "256 vision patches after resizing, more than data.patches_per_micro_batch=200",
    ),
}  # fmt: skip


def kind_data(name: str, root: Path, processor_dir: str) -> tuple[list, list, object]:
    """(rows with the bad ones at `BAD_AT`, the good rows alone, encoder) for kind ``name``."""
    kind, _, bad, _, _ = KINDS[name]
    if kind == "multimodal":
        good = mm_good_rows(root, ROWS - len(BAD_AT))
        (root / "junk.png").write_bytes(b"not an image at all")
        (root / "big.png").write_bytes(png(32, 32))
        if bad == "inline":  # parquet: one struct type for every image part, bytes inline
            good = [parquet_row(png(8, 8, k), k) for k in range(len(good))]
            bad = parquet_row(b"garbage", 0)
        return with_bad(good, bad), good, mm_encoder(processor_dir, str(root))
    if kind == "text":
        good = text_rows(ROWS - len(BAD_AT), seed=1)
        return with_bad(good, bad), good, build_encoder(tokenizer(), "text", add_eos=False)
    good = [chat(f"question {k}", f"answer {k}") for k in range(ROWS - len(BAD_AT))]
    return with_bad(good, bad), good, build_encoder(tokenizer(), "conversation")


def parquet_row(image: bytes, k: int) -> dict:
    part = {"type": "image", "text": None, "image": image}
    text = {"type": "text", "text": "What is this?", "image": None}
    return {
        "messages": [
            {"role": "user", "content": [part, text]},
            {"role": "assistant", "content": [{"type": "text", "text": f"shape {k}", "image": None}]},
        ]
    }


def index(path: str, encoder, **kwargs):
    source = RowSource([path], "auto", encoder.columns, encoder.optional_columns)
    kwargs = {"max_seq_len": 256, "overlong": "error", **kwargs}
    return source, index_dataset(source, encoder, **kwargs)


@pytest.mark.parametrize("name", list(KINDS))
def test_each_kind_errors_by_default_and_is_skipped_and_counted(name, tmp_path, processor_dir):
    _, suffix, _, kind, message = KINDS[name]
    rows, good, encoder = kind_data(name, tmp_path, processor_dir)
    path = write(tmp_path / f"rows{suffix}", rows)
    where = f"line {BAD_AT[0] + 1}" if suffix == ".jsonl" else f"row {BAD_AT[0]} \\(0-based\\)"
    with pytest.raises(
        DataError, match=f"{re.escape(path)} {where}.*{message}.*data.on_bad_row: skip"
    ) as info:
        index(path, encoder)
    assert not isinstance(info.value, OverlongError)

    _, dirty = index(path, encoder, on_bad_row="skip", max_bad_fraction=0.2)
    _, clean = index(write(tmp_path / f"good{suffix}", good), encoder)
    assert dirty.bad.rows.tolist() == list(BAD_AT)
    assert dirty.bad.counts() == {kind: len(BAD_AT)}
    assert [row for row, _ in dirty.bad.examples] == list(BAD_AT)
    assert all(re.search(message, m) for _, m in dirty.bad.examples)
    assert dirty.bad.report()[0].startswith(f"{len(BAD_AT)} x {kind}: ")
    kept = np.setdiff1d(np.arange(len(rows)), BAD_AT)
    assert dirty.lengths[list(BAD_AT)].tolist() == [0] * len(BAD_AT)
    assert np.array_equal(dirty.lengths[kept], clean.lengths)
    assert np.array_equal(dirty.trained[kept], clean.trained)
    assert dirty.num_samples == clean.num_samples and dirty.dropped == 0
    assert dirty.digest() != clean.digest()


def test_overlong_rows_follow_data_overlong_not_on_bad_row(tmp_path):
    path = write(tmp_path / "rows.jsonl", [{"text": "alpha"}, {"text": " ".join(["beta"] * 80)}])
    encoder = build_encoder(tokenizer(), "text")
    with pytest.raises(OverlongError, match=r"line 2: \d+ tokens, longer than data.max_seq_len=16"):
        index(path, encoder, max_seq_len=16, on_bad_row="skip", max_bad_fraction=1.0)


def test_too_many_bad_rows_or_all_is_an_error(tmp_path):
    encoder = build_encoder(tokenizer(), "text")
    rows = text_rows(7) + ["{oops", {"text": 3}, "[1]"]
    path = write(tmp_path / "rows.jsonl", rows)
    with pytest.raises(
        DataError, match=r"3 of 10 rows \(30.00%\) are bad, more than data.max_bad_fraction=0.2; fix the data"
    ) as info:
        index(path, encoder, on_bad_row="skip", max_bad_fraction=0.2)
    assert "2 x unreadable row: " in str(info.value) and "1 x malformed row: " in str(info.value)
    assert len(index(path, encoder, on_bad_row="skip", max_bad_fraction=0.3)[1].bad) == 3
    every = write(tmp_path / "bad.jsonl", ["{oops"] * 3)
    with pytest.raises(DataError, match="every one of the 3 rows is bad:\n  3 x unreadable row: "):
        index(every, encoder, on_bad_row="skip", max_bad_fraction=1.0)
    with pytest.raises(DataError, match="data.on_bad_row must be error or skip, found 'drop'"):
        index(path, encoder, on_bad_row="drop")


def test_recipe_fields():
    raw = recipe_to_dict(load_recipe("quickstart"))
    recipe = recipe_from_dict(raw)
    assert (recipe.data.on_bad_row, recipe.data.max_bad_fraction) == ("error", 0.01)
    raw["data"].update(on_bad_row="skip", max_bad_fraction=1.5)
    with pytest.raises(RecipeError, match=r"data.max_bad_fraction: expected 0 <= x <= 1, found 1.5"):
        recipe_from_dict(raw)


# --- packing and resume -----------------------------------------------------------------------------------------


def dirty_text(tmp_path: Path) -> tuple[list, list]:
    good = text_rows(80, seed=4)
    bad = ["{nope", {"text": 1}, {"body": "x"}]
    rows = list(good)
    for k, at in enumerate((0, 17, 50, 51, 82)):
        rows.insert(at, bad[k % len(bad)])
    return rows, good


def make_train(source, encoder, index, **kwargs) -> TrainData:
    args = dict(
        topology=DataTopology(), tokens_per_micro_batch=128, grad_accum=2, seed=5, shuffle=True, max_seq_len=64,
        overlong="truncate", on_bad_row="skip",
    )  # fmt: skip
    return TrainData(source, encoder, index, **{**args, **kwargs})


def assert_same_batch(a: dict, b: dict, rows_of_a: np.ndarray | None = None) -> None:
    for key in ("input_ids", "labels", "position_ids", "cu_seqlens", "pixel_values", "image_grid_thw"):
        if a.get(key) is None or b.get(key) is None:
            assert a.get(key) is None and b.get(key) is None, key
        else:
            assert torch.equal(a[key], b[key]), key
    mapped = a["sample_index"] if rows_of_a is None else rows_of_a[a["sample_index"]].tolist()
    assert mapped == b["sample_index"]


@pytest.mark.parametrize("kind", ["text", "multimodal"])
def test_packed_output_with_skip_equals_the_data_without_the_bad_rows(kind, tmp_path, processor_dir):
    if kind == "text":
        rows, good = dirty_text(tmp_path)
        encoder = build_encoder(tokenizer(), "text")
        args = dict(max_seq_len=64, overlong="truncate")
    else:
        good = mm_good_rows(tmp_path, 30)
        (tmp_path / "junk.png").write_bytes(b"junk")
        rows = list(good)
        for at, bad in ((2, image_row("gone.png")), (11, image_row("junk.png")), (20, {"messages": "hi"})):
            rows.insert(at, bad)
        encoder = mm_encoder(processor_dir, str(tmp_path))
        args = dict(max_seq_len=128, overlong="error", patches_per_micro_batch=200)
    source, dirty = index(write(tmp_path / "dirty.jsonl", rows), encoder, on_bad_row="skip", max_bad_fraction=0.1,
                          max_seq_len=args["max_seq_len"], overlong=args["overlong"])  # fmt: skip
    clean_source, clean = index(write(tmp_path / "clean.jsonl", good), encoder, max_seq_len=args["max_seq_len"],
                                overlong=args["overlong"])  # fmt: skip
    assert len(dirty.bad) == len(rows) - len(good)
    with_skip = make_train(source, encoder, dirty, **args)
    without = make_train(clean_source, encoder, clean, on_bad_row="error", **args)
    assert with_skip.summary() == {**without.summary(), "rows": len(rows), "bad_rows": len(dirty.bad)}
    rows_of_dirty = np.full(len(rows), -1)
    rows_of_dirty[np.setdiff1d(np.arange(len(rows)), dirty.bad.rows)] = np.arange(len(good))
    steps = with_skip.steps_in_epoch(0) + 2  # into the second epoch
    for a, b in zip(
        (s for _, s in zip(range(steps), with_skip, strict=False)),
        (s for _, s in zip(range(steps), without, strict=False)),
        strict=True,
    ):
        assert (a.step, a.epoch, a.tokens, a.valid_tokens, a.patches) == (
            b.step, b.epoch, b.tokens, b.valid_tokens, b.patches,
        )  # fmt: skip
        for x, y in zip(a.micro_batches, b.micro_batches, strict=True):
            assert "replaced_rows" not in x
            assert_same_batch(x, y, rows_of_dirty)
    assert with_skip.replaced == {}


def test_resume_with_skipped_rows_is_exact(tmp_path):
    rows, _ = dirty_text(tmp_path)
    encoder = build_encoder(tokenizer(), "text")
    source, dirty = index(write(tmp_path / "dirty.jsonl", rows), encoder, on_bad_row="skip", max_bad_fraction=0.1,
                          max_seq_len=64, overlong="truncate")  # fmt: skip
    straight = iter(make_train(source, encoder, dirty))
    want = [next(straight) for _ in range(5)]
    first = make_train(source, encoder, dirty)
    it = iter(first)
    for _ in range(2):
        next(it)
    state = json.loads(json.dumps(first.state_dict()))  # what the trainer state stores
    assert state["bad_rows"] == 5
    second = make_train(source, encoder, dirty, num_workers=1)
    second.load_state_dict(state)
    it = iter(second)
    for expected in want[2:]:
        got = next(it)
        assert got.step == expected.step
        for a, b in zip(got.micro_batches, expected.micro_batches, strict=True):
            assert_same_batch(a, b)

    # One more bad row (the file was edited between save and resume): the saved position no longer applies.
    source2, more = index(write(tmp_path / "dirty.jsonl", [*rows, "{nope"]), encoder, on_bad_row="skip",
                          max_bad_fraction=0.1, max_seq_len=64, overlong="truncate")  # fmt: skip
    with pytest.raises(DataError, match=r"bad_rows \(left out\): saved 5, now 6"):
        make_train(source2, encoder, more).load_state_dict(state)


def test_row_bad_only_in_the_worker_is_a_pad_only_filler(tmp_path, processor_dir):
    """A truncated PNG: its header gives the size (so the index keeps it), its pixels do not decode. With skip the
    worker trains pad tokens with nothing trained in its place, deterministically; with error it raises."""
    good = mm_good_rows(tmp_path, 20)
    (tmp_path / "cut.png").write_bytes(png(16, 16)[:120])
    rows = [*good[:5], image_row("cut.png", answer="cut"), *good[5:]]
    encoder = mm_encoder(processor_dir, str(tmp_path))
    source, idx = index(write(tmp_path / "rows.jsonl", rows), encoder, on_bad_row="skip", max_seq_len=128)
    assert len(idx.bad) == 0 and idx.lengths[5] > 0
    args = dict(max_seq_len=128, overlong="error", patches_per_micro_batch=200, shuffle=False)

    data = make_train(source, encoder, idx, **args)
    steps = [s for _, s in zip(range(data.steps_in_epoch(0)), data, strict=False)]
    assert list(data.replaced) == [5] and "corrupt or truncated" in data.replaced[5]
    batch = next(b for s in steps for b in s.micro_batches if 5 in b["sample_index"])
    k = batch["sample_index"].index(5)
    cu = batch["cu_seqlens"].tolist()
    segment = slice(cu[k], cu[k + 1])
    assert cu[k + 1] - cu[k] == idx.lengths[5]
    assert (batch["input_ids"][0, segment] == 0).all() and (batch["labels"][0, segment] == -100).all()
    # The other samples keep their pixels: the filler adds none.
    others = [r for r in batch["sample_index"] if r != 5]
    assert batch["num_patches"] == int(idx.patches[others].sum())
    # Its trained tokens are still in the step's normaliser (the plan's count; module docstring of the loader).
    step = next(s for s in steps if any(5 in b["sample_index"] for b in s.micro_batches))
    assert step.valid_tokens == sum(int(b["num_valid_tokens"]) for b in step.micro_batches) + int(
        idx.trained[5]
    )

    # Resume across the step holding it: identical batches.
    at = next(i for i, s in enumerate(steps) if s is step)
    first = make_train(source, encoder, idx, **args)
    it = iter(first)
    for _ in range(at):
        next(it)
    second = make_train(source, encoder, idx, **args)
    second.load_state_dict(first.state_dict())
    for a, b in zip(next(iter(second)).micro_batches, step.micro_batches, strict=True):
        assert_same_batch(a, b)

    with pytest.raises(
        DataError, match=r"line 6: image 0 \(.*cut.png\): the image data is corrupt or truncated"
    ):
        for _ in make_train(source, encoder, idx, **{**args, "on_bad_row": "error"}):
            pass

    evaluation = EvalData(source, encoder, idx, topology=DataTopology(), tokens_per_micro_batch=128, max_seq_len=128,
                          overlong="error", patches_per_micro_batch=200, on_bad_row="skip")  # fmt: skip
    assert sum(int(b["num_valid_tokens"]) for b in evaluation) == idx.total_trained_tokens - int(
        idx.trained[5]
    )
    assert list(evaluation.replaced) == [5]


# --- two ranks ----------------------------------------------------------------------------------------------------


def _index_on_rank(ctx, path: str, on_bad_row: str) -> tuple[str, object]:
    from veomni.train.data.encode import load_tokenizer

    encoder = build_encoder(load_tokenizer(TOKENIZER_DIR), "text")
    source = RowSource([path], "auto", encoder.columns)
    try:
        idx = index_dataset(source, encoder, max_seq_len=64, overlong="truncate", group=dist.group.WORLD,
                            chunk_rows=4, on_bad_row=on_bad_row, max_bad_fraction=0.2)  # fmt: skip
    except DataError as err:
        return "error", str(err)
    return "ok", (idx.bad.rows.tolist(), idx.bad.counts(), idx.lengths.tolist())


def test_bad_row_on_one_rank_of_the_index(dist_pools, tmp_path):
    """Rows 4..7 are rank 1's chunk: with error both ranks raise the same error (rank 0 does not wait in the
    gather for a rank that stopped), with skip both hold the same bad set."""
    rows = text_rows(16, seed=2)
    rows[5] = {"text": 7}
    path = write(tmp_path / "rows.jsonl", rows)
    pool = dist_pools.get(2)
    errors = pool.run(_index_on_rank, path, "error")
    assert errors[0] == errors[1] and errors[0][0] == "error"
    assert errors[0][1].startswith(f"{path} line 6: field 'text' must be a string, found int")
    skipped = pool.run(_index_on_rank, path, "skip")
    assert skipped[0] == skipped[1] and skipped[0][1][:2] == ([5], {"malformed row": 1})


def _train_on_rank(ctx, raw: dict) -> dict:
    from veomni.train.loop import train

    history = train(recipe_from_dict(raw))
    return {"loss": history["loss"], "skipped": history["skipped"]}


def test_two_ranks_train_through_bad_rows(dist_pools, tmp_path, processor_dir):
    """VLM training on 2 DP ranks with skip: one row bad at index time, one only in the worker of rank 0 (the
    first row, unshuffled, is micro-batch 0 of step 0, dealt to rank 0). Both ranks finish every step (nothing
    hangs) and metrics.jsonl records both."""
    from test_vlm_train import initial_weights, vlm_recipe

    good = mm_good_rows(tmp_path, 40)
    (tmp_path / "cut.png").write_bytes(png(16, 16)[:120])
    rows = [image_row("cut.png", answer="cut"), *good[:20], image_row("gone.png"), *good[20:]]
    assets = {"processor": processor_dir, "train": write(tmp_path / "train.jsonl", rows), "media": str(tmp_path),
              "weights": initial_weights(tmp_path / "weights")}  # fmt: skip
    raw = vlm_recipe(assets, str(tmp_path / "out"), steps=2)
    raw["data"].update(on_bad_row="skip", max_bad_fraction=0.05, shuffle=False)
    results = dist_pools.get(2, "gloo").run(_train_on_rank, raw)
    assert results[0] == results[1]
    assert len(results[0]["loss"]) == 2 and all(np.isfinite(results[0]["loss"]))
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert records[0] == {
        "step": 0, "bad_rows": {"train_files": {"total": 1, "by_kind": {"missing image file": 1}}},
    }  # fmt: skip
    assert records[-1] == {"step": 2, "bad_rows_replaced": {"train_files": 1}}


# --- non-finite media, missing audio, nothing but end-of-turn tokens ---------------------------------------------


def test_non_finite_pixel_values_are_a_bad_row_naming_the_file(tmp_path):
    """An image processor whose normalisation divides by zero (image_std 0) gives inf/nan pixels: found in the data
    path, naming row and file, not as a diverged step 1."""
    processor = Path(make_processor_dir(tmp_path / "processor"))
    config = json.loads((processor / "preprocessor_config.json").read_text())
    (processor / "preprocessor_config.json").write_text(json.dumps({**config, "image_std": [0.0, 0.0, 0.0]}))
    rows = mm_good_rows(tmp_path, 4)
    encoder = mm_encoder(str(processor), str(tmp_path))
    source, idx = index(write(tmp_path / "rows.jsonl", rows), encoder, max_seq_len=128)
    args = dict(max_seq_len=128, overlong="error", patches_per_micro_batch=200, shuffle=False)
    with pytest.raises(
        DataError,
        match=r"rows.jsonl line \d: the images \(.*\d.png\): \d+ of its \d+ pixel values are not finite",
    ) as info:
        for _ in make_train(source, encoder, idx, **{**args, "on_bad_row": "error"}):
            pass
    assert bad_row_kind(str(info.value)) == "non-finite media values"


def test_missing_and_non_finite_audio_are_bad_rows_of_the_index(tmp_path):
    soundfile = pytest.importorskip("soundfile")
    from test_multimodal_data import model_data
    from test_omni_train import make_omni_dir, row, thinker_config, tone

    from veomni.train.data.build import encoder_for
    from veomni.train.recipe import DataSection

    media = tmp_path / "media"
    media.mkdir()
    wave = np.full(2000, 0.1, dtype=np.float32)
    wave[5] = np.nan
    soundfile.write(str(media / "nan.wav"), wave, 8000, subtype="FLOAT")
    good = [row({"type": "audio", "audio": tone(media / f"t{k}.wav", 200.0 + 50 * k)}) for k in range(10)]
    rows = [*good[:3], row({"type": "audio", "audio": "gone.wav"}), *good[3:7], row({"type": "audio", "audio": "nan.wav"}),
            *good[7:]]  # fmt: skip
    path = write(tmp_path / "rows.jsonl", rows)
    section = DataSection(train_files=[path], kind="multimodal", media_root=str(media), num_workers=0)
    processor = make_omni_dir(tmp_path / "processor")
    encoder = encoder_for(section, tokenizer_for(processor), **model_data(thinker_config()))
    with pytest.raises(
        DataError, match=rf"{re.escape(path)} line 4: audio 0: no such audio file: {media}/gone.wav"
    ):
        index(path, encoder, max_seq_len=512)
    _, idx = index(path, encoder, max_seq_len=512, on_bad_row="skip", max_bad_fraction=0.2)
    assert idx.bad.rows.tolist() == [3, 8]
    assert idx.bad.counts() == {"missing audio file": 1, "non-finite media values": 1}
    assert re.search(
        r"line 9: audio 0 \(.*nan.wav\): 1 of its 2000 samples are not finite", idx.bad.examples[1][1]
    )


def _empty_answers(n: int) -> list[dict]:
    return [chat(f"question {k}", "") for k in range(n)]


@pytest.mark.parametrize("kind", ["conversation", "multimodal"])
def test_data_training_only_end_of_turn_tokens_is_refused(kind, tmp_path, processor_dir):
    from veomni.train.data.build import check_trained_tokens

    if kind == "conversation":
        encoder, rows = build_encoder(tokenizer(), "conversation"), _empty_answers(20)
    else:
        encoder = mm_encoder(processor_dir, str(tmp_path))
        rows = [image_row(f"{k % 4}.png", answer="") for k, _ in enumerate(mm_good_rows(tmp_path, 20))]
    path = write(tmp_path / "rows.jsonl", rows)
    source, idx = index(path, encoder)
    assert idx.total_trained_tokens > 0  # <|im_end|> and the newline after it: the old check passed
    check_trained_tokens(source, idx, [path], "data.train_files")
    with pytest.raises(
        DataError, match=rf"data.train_files: the {idx.total_trained_tokens} trained tokens of \['{re.escape(path)}'\] "
        r"\(20 rows\) are all the chat template's end-of-turn or special tokens, no content: every trained message",
    ):  # fmt: skip
        check_trained_tokens(source, idx, [path], "data.train_files", encoder)
    # One answer with content anywhere (also outside the first rows looked at) is enough.
    rows[13] = (
        chat("question", "an answer") if kind == "conversation" else image_row("1.png", answer="an answer")
    )
    some = write(tmp_path / "some.jsonl", rows)
    source, idx = index(some, encoder)
    check_trained_tokens(source, idx, [some], "data.train_files", encoder)
