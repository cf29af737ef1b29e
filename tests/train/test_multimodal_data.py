"""Multimodal data (``data.kind: multimodal``): encoding, the pixel-free index, mrope positions, collate, bad input.

The processor used throughout is built here, since nothing is downloaded (`make_processor_dir`): the quickstart's
bundled tokenizer plus the Qwen3-VL special tokens (``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>``,
``<|video_pad|>``, ids 1024..1027), a ChatML template that renders an image part as
``<|vision_start|><|image_pad|><|vision_end|>`` and a video part as ``<|vision_start|><|video_pad|><|vision_end|>``
(as Qwen3-VL's own template does), a ``Qwen2VLImageProcessorPil`` sized for the tiny model (patch 2, merge 2,
16..1024 pixels) and a ``Qwen3VLVideoProcessor`` config of the same geometry (2 fps, 2..8 frames, 16..4096 pixels
over all frames), saved side by side so ``AutoTokenizer``, ``AutoImageProcessor`` and the video rule load them
from one directory.
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from veomni.models.qwen3_vl.positions import Qwen3VLPositions
from veomni.train.data import DataError, RowRef
from veomni.train.data.encode import load_tokenizer
from veomni.train.data.multimodal import MultimodalEncoder, load_image_processor
from veomni.train.data.multimodal_batch import collate_multimodal

QUICKSTART = Path(__file__).parents[2] / "packages/veomni-train/src/veomni/train/assets/quickstart/tokenizer"
VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
START, IMAGE, END, VIDEO = 1024, 1025, 1026, 1027
TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'image' %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}{%- elif part['type'] == 'video' %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}{%- else %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
REF = RowRef("rows.jsonl", 0, 1)
VIDEO_PROCESSOR = {
    "patch_size": 2, "temporal_patch_size": 2, "merge_size": 2, "size": {"shortest_edge": 16, "longest_edge": 4096},
    "fps": 2, "min_frames": 2, "max_frames": 8, "cap_pixels_per_frame": False,
}  # fmt: skip


def make_processor_dir(out: Path) -> str:
    """Tokenizer + chat template + PIL image processor + video processor config for the tiny Qwen3-VL (module
    docstring)."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    tokenizer = AutoTokenizer.from_pretrained(str(QUICKSTART))
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    assert tokenizer.convert_tokens_to_ids(VISION_TOKENS) == [START, IMAGE, END, VIDEO]
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(out)
    processor = Qwen2VLImageProcessorPil(
        patch_size=2, merge_size=2, temporal_patch_size=2, size={"shortest_edge": 16, "longest_edge": 1024}
    )
    processor.save_pretrained(out)
    Qwen3VLVideoProcessor(**VIDEO_PROCESSOR).save_pretrained(out)
    return str(out)


def model_data(config) -> dict:
    """The model-side inputs of `veomni.train.data.build.encoder_for` for a model of ``config``: its family's data
    rules and the config (what `veomni.train.tasks.vision.VlmTask.data_options` gives a training run)."""
    from veomni.models.families import data_rules

    return {"data_rules": data_rules(config.model_type), "model_config": config}


def tiny_vlm_config():
    """A Qwen3-VL config whose placeholder ids and merge size are this module's tokenizer's and processor's."""
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
        vision_config={"spatial_merge_size": 2, "patch_size": 2, "temporal_patch_size": 2},
    )  # fmt: skip


def png(height: int, width: int, seed: int = 0) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def image_row(*images: object, answer: str = "A red square.") -> dict:
    parts = [{"type": "image", "image": image} for image in images]
    return {
        "messages": [
            {"role": "user", "content": [*parts, {"type": "text", "text": "What is this?"}]},
            {"role": "assistant", "content": answer},
        ]
    }


@pytest.fixture(scope="module")
def processor_dir(tmp_path_factory) -> str:
    return make_processor_dir(tmp_path_factory.mktemp("processor"))


def encoder(path: str, media_root: str | None = None, max_patches: int | None = None) -> MultimodalEncoder:
    return MultimodalEncoder(
        load_tokenizer(path),
        load_image_processor(path),
        "messages",
        "loss_mask",
        True,
        media_root=media_root,
        max_patches=max_patches,
        positions=Qwen3VLPositions(IMAGE, 2),
    )


def test_expanded_row_masks_and_labels(processor_dir):
    enc = encoder(processor_dir)
    ids, trained, media = enc(image_row(png(16, 16), png(8, 12, 1)), REF)
    # 16x16 px -> 8x8 patches -> 16 tokens; 8x12 -> 4x6 patches -> 6 tokens.
    assert media.image_grid_thw.tolist() == [[1, 8, 8], [1, 4, 6]]
    assert media.pixel_values.shape == (64 + 24, 3 * 2 * 2 * 2)
    # The model's check: placeholder tokens == merged visual tokens.
    assert int((ids == IMAGE).sum()) == int(media.image_grid_thw.prod(axis=1).sum()) // 4 == 22
    assert int((ids == START).sum()) == int((ids == END).sum()) == 2
    assert not trained[ids == IMAGE].any()
    tokenizer = enc.tokenizer
    assert tokenizer.decode(ids[trained]) == "A red square.<|im_end|>\n"
    assert media.mrope.shape == (3, len(ids))


@settings(max_examples=25, deadline=None)
@given(
    texts=st.lists(st.integers(0, 6), min_size=1, max_size=4),
    grids=st.lists(
        st.tuples(st.integers(1, 2), st.integers(1, 4), st.integers(1, 4)), min_size=0, max_size=3
    ),
)
def test_positions_equal_transformers_get_rope_index(texts, grids):
    from transformers import Qwen3VLConfig, Qwen3VLModel

    config = Qwen3VLConfig(
        text_config={"vocab_size": 1032, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "head_dim": 8, "intermediate_size": 16},
        vision_config={"depth": 1, "hidden_size": 16, "num_heads": 2, "intermediate_size": 16, "out_hidden_size": 16,
                       "patch_size": 2, "spatial_merge_size": 2},
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
    )  # fmt: skip
    ids: list[int] = []
    grid_rows = [[t, 2 * h, 2 * w] for t, h, w in grids]
    for k, n in enumerate(texts):
        ids += list(range(5, 5 + n))
        if k < len(grid_rows):
            t, h, w = grid_rows[k]
            ids += [START] + [IMAGE] * (t * h * w // 4) + [END]
    for t, h, w in grid_rows[len(texts) :]:
        ids += [START] + [IMAGE] * (t * h * w // 4) + [END]
    if not ids:
        ids = [7]
    grid = torch.tensor(grid_rows, dtype=torch.int64).reshape(-1, 3)
    input_ids = torch.tensor([ids])
    with torch.device("meta"):
        model = Qwen3VLModel(config)
    if grid_rows:
        want, _ = model.get_rope_index(input_ids, (input_ids == IMAGE).int(), image_grid_thw=grid)
        want = want[:, 0].numpy()
    else:  # transformers uses the plain running index when there is no image
        want = np.arange(len(ids))[None].repeat(3, 0)
    got = Qwen3VLPositions.from_config(config)(np.asarray(ids), grid.numpy())
    np.testing.assert_array_equal(got, want)


def test_positions_reject_mismatched_grids():
    positions = Qwen3VLPositions(IMAGE, 2)
    with pytest.raises(ValueError, match="only 3"):
        positions(np.asarray([1, IMAGE, IMAGE, IMAGE, 2]), np.asarray([[1, 4, 4]]))
    with pytest.raises(ValueError, match="2 image grid"):
        positions(np.asarray([1, IMAGE, 2]), np.asarray([[1, 2, 2], [1, 2, 2]]))


@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(1, 70), st.integers(1, 70)), min_size=0, max_size=3),
    seed=st.integers(0, 9),
)
def test_index_length_equals_processor_output(processor_dir, sizes, seed):
    sizes = [(h, w) for h, w in sizes if max(h, w) / min(h, w) <= 200]
    enc = _cached_encoder(processor_dir)
    row = image_row(*[png(h, w, seed) for h, w in sizes])
    length, trained, patches = enc.measure(row, REF)
    ids, mask, media = enc(row, REF)
    assert (length, trained, patches) == (len(ids), int(mask.sum()), media.num_patches)


_ENCODERS: dict[str, MultimodalEncoder] = {}


def _cached_encoder(path: str) -> MultimodalEncoder:
    if path not in _ENCODERS:
        _ENCODERS[path] = encoder(path)
    return _ENCODERS[path]


def test_encoder_survives_spawned_workers(processor_dir, tmp_path):
    """The encoder (tokenizer, image processor, position function) pickles into spawned DataLoader workers and
    gives there what it gives in process."""
    from torch.utils.data import DataLoader

    from veomni.train.data.loader import _PackedRows
    from veomni.train.data.plan import index_dataset
    from veomni.train.data.schedule import identity
    from veomni.train.data.sources import RowSource

    rows = tmp_path / "rows.jsonl"
    for k, (h, w) in enumerate([(16, 16), (9, 30), (12, 8), (20, 14)]):
        (tmp_path / f"{k}.png").write_bytes(png(h, w, k))
    import json

    rows.write_text(
        "\n".join(json.dumps(image_row(f"{k}.png", f"{(k + 1) % 4}.png")) for k in range(4)) + "\n"
    )
    enc = encoder(processor_dir, media_root=str(tmp_path))
    source = RowSource([str(rows)], "jsonl", enc.columns)
    index = index_dataset(source, enc, max_seq_len=512, overlong="error")
    dataset = _PackedRows(
        source, enc, index, max_seq_len=512, overlong="error", order=None, sp_rank=0, sp_size=1, pad_id=0
    )
    keys = [("rows", np.asarray([k])) for k in range(4)]
    loader = DataLoader(
        dataset,
        batch_size=None,
        sampler=keys,
        num_workers=2,
        multiprocessing_context="spawn",
        collate_fn=identity,
    )
    for key, got in zip(keys, loader, strict=True):
        want = dataset[key]
        for name in ("input_ids", "labels", "position_ids", "pixel_values", "image_grid_thw"):
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)


def _sample(enc: MultimodalEncoder, row: dict, index: int):
    from veomni.train.data.encode import Sample

    ids, trained, media = enc(row, REF)
    return Sample(ids, trained, index, media=media)


def test_collate_packs_and_slices_only_text(processor_dir):
    enc = _cached_encoder(processor_dir)
    samples = [_sample(enc, image_row(png(16, 16)), 0), _sample(enc, image_row(png(8, 8), png(12, 4)), 1)]
    full = collate_multimodal(samples, pad_id=0)
    n0, n1 = (len(s.input_ids) for s in samples)
    assert full["position_ids"].shape == (4, 1, n0 + n1)
    # Every row restarts at the second sample; the text row is the plain per-sample index.
    torch.testing.assert_close(full["position_ids"][:, 0, n0], torch.zeros(4, dtype=torch.int64))
    assert full["position_ids"][0, 0].tolist() == list(range(n0)) + list(range(n1))
    assert full["position_ids"][1:, 0, :n0].tolist() == samples[0].media.mrope.tolist()
    assert full["pixel_values"].shape[0] == 64 + 16 + 12 and full["image_grid_thw"].shape == (3, 3)
    assert full["labels"][0, n0 - 1] == -100  # no label crosses the sample boundary
    parts = [collate_multimodal(samples, sp_rank=r, sp_size=3, pad_id=0) for r in range(3)]
    padded = parts[0]["padded_len"]
    assert padded % 3 == 0 and padded >= n0 + n1
    ids = torch.cat([p["input_ids"] for p in parts], dim=1)
    positions = torch.cat([p["position_ids"] for p in parts], dim=2)
    assert ids[0, : n0 + n1].tolist() == full["input_ids"][0].tolist()
    assert torch.equal(positions[..., : n0 + n1], full["position_ids"])
    for p in parts:  # pixels and grids are the whole micro-batch's on every SP rank
        assert torch.equal(p["pixel_values"], full["pixel_values"])
        assert torch.equal(p["image_grid_thw"], full["image_grid_thw"])
        assert torch.equal(p["cu_seqlens"], parts[0]["cu_seqlens"])
    assert sum(int(p["num_valid_tokens"]) for p in parts) == int(full["num_valid_tokens"])


def test_text_only_row_has_no_pixels(processor_dir):
    enc = _cached_encoder(processor_dir)
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    batch = collate_multimodal([_sample(enc, row, 0)])
    assert batch["pixel_values"] is None and batch["image_grid_thw"] is None and batch["num_patches"] == 0


# ---------------------------------------------------------------- bad input


def test_missing_image_file_names_file_and_row(processor_dir, tmp_path):
    enc = encoder(processor_dir, media_root=str(tmp_path))
    with pytest.raises(DataError, match=r"rows.jsonl line 1: image 0 \(.*nope.png\): no such image file"):
        enc.measure(image_row("nope.png"), REF)


def test_relative_path_without_media_root(processor_dir):
    with pytest.raises(DataError, match="line 1: image 0 has the relative path 'a.png' but data.media_root"):
        encoder(processor_dir).measure(image_row("a.png"), REF)


def test_corrupt_image_names_file_and_row(processor_dir, tmp_path):
    (tmp_path / "junk.png").write_bytes(b"not an image at all")
    enc = encoder(processor_dir, media_root=str(tmp_path))
    with pytest.raises(DataError, match=r"line 1: image 0 \(.*junk.png\): not a readable image"):
        enc.measure(image_row("junk.png"), REF)
    # A valid header over a truncated body: the index reads the size, the worker's decode fails.
    (tmp_path / "cut.png").write_bytes(png(40, 40)[:120])
    enc.measure(image_row("cut.png"), REF)
    with pytest.raises(
        DataError, match=r"line 1: image 0 \(.*cut.png\): the image data is corrupt or truncated"
    ):
        enc(image_row("cut.png"), REF)


def test_placeholder_count_must_match_images(processor_dir, tmp_path):
    enc = _cached_encoder(processor_dir)
    extra = image_row(png(8, 8), answer="see <|image_pad|>")
    with pytest.raises(DataError, match=r"line 1: 2 <\|image_pad\|> placeholder\(s\) .* but 1 image\(s\)"):
        enc.measure(extra, REF)
    # A template that leaves image parts out: more images than placeholders.
    out = tmp_path / "proc"
    shutil.copytree(processor_dir, out)
    tokenizer = load_tokenizer(str(out))
    tokenizer.chat_template = TEMPLATE.replace("'<|vision_start|><|image_pad|><|vision_end|>'", "''")
    tokenizer.save_pretrained(out)
    with pytest.raises(DataError, match=r"line 1: 0 <\|image_pad\|> placeholder\(s\) .* but 1 image\(s\)"):
        encoder(str(out)).measure(image_row(png(8, 8)), REF)


def test_image_over_patch_budget_names_file_and_row(processor_dir, tmp_path):
    (tmp_path / "big.png").write_bytes(png(32, 32))
    enc = encoder(processor_dir, media_root=str(tmp_path), max_patches=200)
    with pytest.raises(
        DataError, match=r"line 1: image 0 \(.*big.png\): 256 vision patches .*patches_per_micro_batch=200"
    ):
        enc.measure(image_row("big.png"), REF)
    with pytest.raises(DataError, match=r"line 1: 260 vision patches over its 2 images"):
        encoder(processor_dir, media_root=str(tmp_path), max_patches=259).measure(
            image_row("big.png", png(4, 4)), REF
        )


def test_train_data_packs_by_both_budgets_and_resumes_exactly(processor_dir, tmp_path):
    """Micro-batches respect the token and the patch budget; a state saved after step k resumes at step k + 1
    with identical batches (pixels included)."""
    import json

    from veomni.train.data.loader import DataTopology, TrainData
    from veomni.train.data.plan import index_dataset
    from veomni.train.data.sources import RowSource

    sizes = [(16, 16), (8, 8), (12, 16), (4, 20), (10, 10), (16, 8)]
    for k, (h, w) in enumerate(sizes):
        (tmp_path / f"{k}.png").write_bytes(png(h, w, k))
    rows = [image_row(f"{k % 6}.png", answer=f"shape {k}") for k in range(24)]
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    enc = encoder(processor_dir, media_root=str(tmp_path), max_patches=128)
    source = RowSource([str(tmp_path / "rows.jsonl")], "jsonl", enc.columns)
    index = index_dataset(source, enc, max_seq_len=128, overlong="error")
    assert index.patches is not None and int(index.patches.max()) == 64

    def make() -> TrainData:
        return TrainData(
            source, enc, index, topology=DataTopology(), tokens_per_micro_batch=128, grad_accum=2, seed=3,
            shuffle=True, max_seq_len=128, overlong="error", patches_per_micro_batch=128,
        )  # fmt: skip

    straight = make()
    it = iter(straight)
    want = [next(it) for _ in range(4)]
    for step in want:
        for batch in step.micro_batches:
            assert batch["num_patches"] <= 128 and batch["seq_len"] <= 128
        assert step.patches == sum(b["num_patches"] for b in step.micro_batches)
    first = make()
    it = iter(first)
    for _ in range(2):
        next(it)
    state = first.state_dict()
    assert state["patches_per_micro_batch"] == 128
    second = make()
    second.load_state_dict(state)
    it = iter(second)
    for expected in want[2:]:
        got = next(it)
        assert got.step == expected.step
        for a, b in zip(got.micro_batches, expected.micro_batches, strict=True):
            for name in ("input_ids", "labels", "position_ids", "pixel_values", "image_grid_thw"):
                assert torch.equal(a[name], b[name])
    other = TrainData(
        source, enc, index, topology=DataTopology(), tokens_per_micro_batch=128, grad_accum=2, seed=3,
        shuffle=True, max_seq_len=128, overlong="error", patches_per_micro_batch=96,
    )  # fmt: skip
    with pytest.raises(DataError, match="patches_per_micro_batch: saved 128, now 96"):
        other.load_state_dict(state)


def test_parquet_rows_with_inline_image_bytes(processor_dir, tmp_path):
    """Parquet holds images as bytes inside the parts (one struct type for text and image parts)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from veomni.train.data.sources import RowSource

    def part(kind: str, text: str | None = None, image: bytes | None = None) -> dict:
        return {"type": kind, "text": text, "image": image}

    messages = [
        [
            {"role": "user", "content": [part("image", image=png(12, 12, k)), part("text", "What is this?")]},
            {"role": "assistant", "content": [part("text", f"Shape {k}.")]},
        ]
        for k in range(3)
    ]
    pq.write_table(pa.table({"messages": messages}), tmp_path / "rows.parquet")
    enc = _cached_encoder(processor_dir)
    source = RowSource([str(tmp_path / "rows.parquet")], "auto", enc.columns, enc.optional_columns)
    for k in range(3):
        length, trained, patches = enc.measure(source[k], source.ref(k))
        ids, mask, media = enc(source[k], source.ref(k))
        assert (length, trained, patches) == (len(ids), int(mask.sum()), 36)
        assert enc.tokenizer.decode(ids[mask]) == f"Shape {k}.<|im_end|>\n"


def test_image_the_processor_rejects_names_file_and_row(processor_dir):
    with pytest.raises(
        DataError, match=r"line 1: image 0 \(inline bytes .*\): the image processor rejects it: .*200"
    ):
        _cached_encoder(processor_dir).measure(image_row(png(2, 420)), REF)


def _rotated_jpeg(height: int, width: int, orientation: int) -> bytes:
    """A JPEG whose stored pixels are ``height x width`` with an EXIF orientation tag, as phone cameras write them
    (6: the viewer turns the stored pixels 90 degrees clockwise)."""
    from PIL import Image

    rng = np.random.default_rng(7)
    exif = Image.Exif()
    exif[0x0112] = orientation
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(
        buffer, format="JPEG", exif=exif, quality=95
    )
    return buffer.getvalue()


@pytest.mark.parametrize("orientation", [6, 8, 3])
def test_exif_orientation_is_applied_like_transformers(processor_dir, tmp_path, orientation):
    # transformers' load_image (which the processors use for paths, URLs and bytes) turns the pixels upright by the
    # EXIF orientation tag; the data pipeline must hand the tower the same pixels, and the index the same size.
    from transformers.image_utils import load_image as hf_load_image

    path = tmp_path / "photo.jpg"
    path.write_bytes(_rotated_jpeg(16, 40, orientation))
    enc = _cached_encoder(processor_dir)
    row = image_row(str(path))
    ids, mask, media = enc(row, REF)
    expected = enc.image_processor(images=[hf_load_image(str(path))], return_tensors="np")
    assert media.image_grid_thw.tolist() == np.asarray(expected["image_grid_thw"]).tolist()
    np.testing.assert_array_equal(media.pixel_values, np.asarray(expected["pixel_values"], dtype=np.float32))
    assert enc.measure(row, REF) == (len(ids), int(mask.sum()), media.num_patches)


def test_image_over_pils_decompression_bomb_limit_names_file_and_row(processor_dir, tmp_path, monkeypatch):
    # PIL refuses images above twice Image.MAX_IMAGE_PIXELS (about 179 MP: large scans, panoramas) with an error
    # that is no OSError; it must still be a bad row naming the file, not a crash of one rank while its peers
    # wait in the index's gather.
    from PIL import Image

    from veomni.train.data.sources import bad_row_kind

    path = tmp_path / "huge.png"
    path.write_bytes(png(20, 20))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(DataError, match=rf"line 1: image 0 \({path}\): not a readable image") as err:
        _cached_encoder(processor_dir).measure(image_row(str(path)), REF)
    assert bad_row_kind(str(err.value)) == "unreadable image"
