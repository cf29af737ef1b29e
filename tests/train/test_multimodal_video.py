"""Video parts of multimodal rows: Qwen3-VL's video rule against transformers' own functions, the expansion
against ``Qwen3VLProcessor``'s placeholder text, the pixel-free index, mrope against ``get_rope_index``, pixels
of real video files (written here with PyAV) and frame lists, and bad input.

transformers' ``Qwen3VLVideoProcessor.__call__`` and ``Qwen3VLProcessor()`` need torchvision, which is not
installed; their torchvision-free pieces (``smart_resize``, ``sample_frames``, ``get_num_of_video_patches``,
``patchify``, ``_calculate_timestamps``, ``replace_video_token``, ``get_text_with_replacements``) are the oracles.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_multimodal_data import END, IMAGE, REF, START, VIDEO, VIDEO_PROCESSOR, make_processor_dir, png

from veomni.models.qwen3_vl.positions import Qwen3VLPositions
from veomni.models.qwen3_vl.video import Qwen3VLVideoRule, patchify, smart_resize
from veomni.train.data import DataError
from veomni.train.data.encode import load_tokenizer
from veomni.train.data.multimodal import MultimodalEncoder, load_image_processor


def hf_video_processor(**overrides):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    return Qwen3VLVideoProcessor(**{**VIDEO_PROCESSOR, **overrides})


def hf_processor(video_processor):
    """``Qwen3VLProcessor`` with just what its video placeholder methods read (its constructor needs torchvision)."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    processor = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
    processor.video_processor = video_processor
    processor.image_token, processor.video_token = "<|image_pad|>", "<|video_pad|>"
    processor.vision_start_token, processor.vision_end_token = "<|vision_start|>", "<|vision_end|>"
    return processor


def write_video(
    path: Path, frames: int, height: int, width: int, fps: int, codec: str = "png", **options: str
) -> np.ndarray:
    """A clip of random frames; ``png`` in .mov/.mp4 is lossless (exact pixels back). ``options``: muxer options.

    Returns:
        uint8 ``[frames, height, width, 3]``, what was written.
    """
    import av

    rng = np.random.default_rng(frames * 1000 + height * 10 + width)
    pixels = rng.integers(0, 255, (frames, height, width, 3), dtype=np.uint8)
    with av.open(str(path), "w", options=options) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = width, height
        stream.pix_fmt = "rgb24" if codec == "png" else "yuv420p"
        for frame in pixels:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return pixels


def video_row(*videos, images: tuple = (), answer: str = "A moving square.") -> dict:
    parts = [{"type": "image", "image": image} for image in images]
    for video in videos:
        parts.append(video if isinstance(video, dict) else {"type": "video", "video": video})
    return {
        "messages": [
            {"role": "user", "content": [*parts, {"type": "text", "text": "What happens?"}]},
            {"role": "assistant", "content": answer},
        ]
    }


@pytest.fixture(scope="module")
def processor_dir(tmp_path_factory) -> str:
    return make_processor_dir(tmp_path_factory.mktemp("processor"))


def encoder(path: str, media_root: str | None = None, **video) -> MultimodalEncoder:
    return MultimodalEncoder(
        load_tokenizer(path),
        load_image_processor(path),
        "messages",
        "loss_mask",
        True,
        media_root=media_root,
        max_patches=None,
        positions=Qwen3VLPositions(IMAGE, 2, VIDEO),
        video_rule=load_video_rule(path, fps=video.get("fps"), max_frames=video.get("max_frames")),
    )


def load_video_rule(path: str, *, fps: float | None, max_frames: int | None):
    """Qwen3-VL's video rule from ``path`` as a training run loads it (its family's data rules, through
    `veomni.train.data.encoders.load_video_rule`), or why there is none."""
    from test_multimodal_data import tiny_vlm_config

    from veomni.models.families import data_rules
    from veomni.train.data.encoders import load_video_rule as load
    from veomni.train.recipe import DataSection

    data = DataSection(train_files=("rows.jsonl",), kind="multimodal", video_fps=fps, video_max_frames=max_frames)
    return load(data_rules("qwen3_vl"), path, tiny_vlm_config(), data)


_ENCODERS: dict[str, MultimodalEncoder] = {}


def cached_encoder(path: str, media_root: str | None = None) -> MultimodalEncoder:
    key = f"{path}|{media_root}"
    if key not in _ENCODERS:
        _ENCODERS[key] = encoder(path, media_root)
    return _ENCODERS[key]


# ---------------------------------------------------------------- the video rule against transformers


@settings(max_examples=150, deadline=None)
@given(
    total=st.integers(1, 400),
    source_fps=st.sampled_from([1.0, 5.0, 12.5, 24.0, 29.97, 60.0]),
    fps=st.sampled_from([0.5, 1.0, 2.0, 3.0]),
    frames=st.tuples(st.integers(1, 6), st.integers(4, 64)),
    size=st.tuples(st.integers(1, 300), st.integers(1, 300)),
    pixels=st.tuples(st.integers(16, 400), st.integers(1, 60_000)),
    cap=st.booleans(),
)
def test_video_rule_equals_transformers(total, source_fps, fps, frames, size, pixels, cap):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as hf_smart_resize
    from transformers.video_utils import VideoMetadata

    min_frames, max_frames = frames
    min_pixels, max_pixels = pixels[0], pixels[0] + pixels[1]
    hf = hf_video_processor(
        fps=fps, min_frames=min_frames, max_frames=max_frames, cap_pixels_per_frame=cap, max_video_tokens=50,
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
    )  # fmt: skip
    rule = Qwen3VLVideoRule.from_processor(hf) if max_frames >= 2 else None
    if rule is None:
        with pytest.raises(ValueError, match="below the temporal patch size"):
            Qwen3VLVideoRule.from_processor(hf)
        return
    want = hf.sample_frames(VideoMetadata(total_num_frames=total, fps=source_fps), fps=fps)
    got = rule.sample_indices(total, source_fps)
    np.testing.assert_array_equal(got, want)
    n, (height, width) = len(got), size
    args = dict(temporal_factor=2, factor=4, min_pixels=min_pixels, max_pixels=max_pixels)
    try:
        expected = hf_smart_resize(n, height, width, **args)
    except ValueError:
        with pytest.raises(ValueError):
            smart_resize(n, height, width, **args)
        with pytest.raises(ValueError):
            rule.grid(n, height, width)
        return
    assert smart_resize(n, height, width, **args) == expected
    t, h, w = rule.grid(n, height, width)
    assert t * h * w == hf.get_num_of_video_patches(n, height, width)
    want_times = hf_processor(hf)._calculate_timestamps(list(got), source_fps, 2)
    assert rule.timestamps(got, source_fps) == want_times


@settings(max_examples=40, deadline=None)
@given(
    frames=st.integers(1, 7), blocks=st.tuples(st.integers(1, 3), st.integers(1, 3)), seed=st.integers(0, 99)
)
def test_patchify_equals_transformers(frames, blocks, seed):
    video = np.random.default_rng(seed).standard_normal((frames, 3, 4 * blocks[0], 4 * blocks[1]), np.float32)
    rows, grid = patchify(video, 2, 2, 2)
    want, t, h, w = hf_video_processor().patchify(torch.from_numpy(video)[None], 2, 2, 2)
    assert grid == (t, h, w)
    np.testing.assert_array_equal(rows, want[0].numpy())


def test_pixels_of_frames_at_target_size_equal_the_processor_layout(processor_dir):
    """Frames already at the resized size skip the interpolation: rows are upstream's fused rescale+normalise
    (``(x - 0.5 * 255) / (0.5 * 255)``) in upstream's patch order."""
    rule = load_video_rule(processor_dir, fps=None, max_frames=None)
    frames = np.random.default_rng(0).integers(0, 255, (3, 8, 12, 3), dtype=np.uint8)
    assert rule.resized_size(3, 8, 12) == (8, 12)
    rows, grid = rule.pixel_rows(frames)
    normalised = (torch.from_numpy(frames).permute(0, 3, 1, 2).float() - 127.5) / 127.5
    want, *_ = hf_video_processor().patchify(normalised[None], 2, 2, 2)
    assert grid == (2, 4, 6)
    np.testing.assert_allclose(rows, want[0].numpy(), rtol=0, atol=1e-6)


# ---------------------------------------------------------------- expansion, index, positions


def expected_ids(enc: MultimodalEncoder, row: dict, media, metadata: list) -> np.ndarray:
    """The row as transformers' processor expands it: the chat template's text, each ``<|image_pad|>`` and
    ``<|video_pad|>`` replaced by ``replace_image_token`` / ``replace_video_token``, then tokenised."""
    messages = [
        {**m, "content": [{"type": p["type"], **({"text": p["text"]} if p["type"] == "text" else {})}
                          for p in m["content"]]} if isinstance(m["content"], list) else m
        for m in row["messages"]
    ]  # fmt: skip
    text = enc.tokenizer.apply_chat_template(messages, tokenize=False)
    processor = hf_processor(hf_video_processor())
    videos = {"video_grid_thw": torch.from_numpy(media.video_grid_thw), "video_metadata": metadata}
    replacements = [processor.replace_video_token(videos, k) for k in range(len(metadata))]
    image_tokens = [int(g.prod()) // 4 for g in media.image_grid_thw]
    (text,), _ = processor.get_text_with_replacements(
        [text], ["<|image_pad|>" * n for n in image_tokens], replacements
    )
    return np.asarray(enc.tokenizer(text, add_special_tokens=False)["input_ids"])


def test_video_file_and_frame_list_expand_like_the_processor(processor_dir, tmp_path):
    from transformers import Qwen3VLConfig, Qwen3VLModel
    from transformers.video_utils import VideoMetadata

    written = write_video(tmp_path / "clip.mov", frames=11, height=10, width=14, fps=5)
    for k in range(3):
        (tmp_path / f"f{k}.png").write_bytes(png(12, 8, k))
    frames = {"type": "video", "video": [f"f{k}.png" for k in range(3)], "fps": 4}
    row = video_row("clip.mov", frames, images=(png(8, 8),))
    enc = cached_encoder(processor_dir, str(tmp_path))
    ids, trained, media = enc(row, REF)
    # 11 frames at 5 fps -> int(11 / 5 * 2) = 4 sampled; 4 frames of 10x14 -> 8x16 (4 * 8 * 16 = 512 <= 4096).
    metadata = [
        VideoMetadata(total_num_frames=11, fps=5.0, frames_indices=[0, 3, 7, 10]),
        VideoMetadata(total_num_frames=3, fps=4.0, frames_indices=[0, 1, 2]),
    ]
    assert media.video_grid_thw.tolist() == [[2, 4, 8], [2, 6, 4]]
    np.testing.assert_array_equal(ids, expected_ids(enc, row, media, metadata))
    assert enc.tokenizer.decode(ids[trained]) == "A moving square.<|im_end|>\n"
    assert media.pixel_values_videos.shape == (2 * 4 * 8 + 2 * 6 * 4, 24) and media.num_patches == 16 + 112
    assert enc.measure(row, REF) == (len(ids), int(trained.sum()), 128)
    # The sampled frames are the written ones (png in .mov is lossless): frame 3 sits in temporal patch 0.
    rows, _ = enc.video_rule.pixel_rows(written[[0, 3, 7, 10]])
    np.testing.assert_array_equal(media.pixel_values_videos[:64], rows)
    config = Qwen3VLConfig(
        text_config={"vocab_size": 1032, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "head_dim": 8, "intermediate_size": 16},
        vision_config={"depth": 1, "hidden_size": 16, "num_heads": 2, "intermediate_size": 16, "out_hidden_size": 16,
                       "patch_size": 2, "spatial_merge_size": 2},
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
    )  # fmt: skip
    with torch.device("meta"):
        model = Qwen3VLModel(config)
    input_ids = torch.from_numpy(ids)[None]
    want, _ = model.get_rope_index(
        input_ids,
        ((input_ids == IMAGE).int() + 2 * (input_ids == VIDEO).int()),
        image_grid_thw=torch.from_numpy(media.image_grid_thw),
        video_grid_thw=torch.from_numpy(media.video_grid_thw),
    )
    np.testing.assert_array_equal(media.mrope, want[:, 0].numpy())


@settings(max_examples=25, deadline=None)
@given(
    videos=st.lists(
        st.tuples(st.integers(2, 8), st.integers(1, 40), st.integers(1, 40), st.sampled_from([None, 1, 3])),
        min_size=1,
        max_size=2,
    ),
    images=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 30)), max_size=2),
)
def test_index_length_equals_processor_output_for_frame_lists(processor_dir, videos, images):
    enc = cached_encoder(processor_dir)
    parts = [
        {"type": "video", "video": [png(h, w, k) for k in range(n)], **({"fps": fps} if fps else {})}
        for n, h, w, fps in videos
    ]
    row = video_row(*parts, images=tuple(png(h, w, 1) for h, w in images))
    measured = enc.measure(row, REF)
    ids, trained, media = enc(row, REF)
    assert measured == (len(ids), int(trained.sum()), media.num_patches)
    assert int((ids == VIDEO).sum()) == int(media.video_grid_thw.prod(axis=1).sum()) // 4


@pytest.mark.parametrize("container,codec", [("mov", "png"), ("mp4", "mpeg4"), ("mkv", "ffv1")])
def test_index_of_video_files_reads_headers_only(processor_dir, tmp_path, container, codec):
    """mp4/mov carry the frame count in the header; Matroska does not, so its packets are counted (no decode)."""
    import av

    write_video(tmp_path / f"c.{container}", frames=9, height=12, width=16, fps=3, codec=codec)
    with av.open(str(tmp_path / f"c.{container}")) as c:
        assert (c.streams.video[0].frames == 0) == (container == "mkv")
    enc = cached_encoder(processor_dir, str(tmp_path))
    row = video_row(f"c.{container}")
    ids, trained, media = enc(row, REF)
    # 9 frames at 3 fps -> 6 sampled; 6 frames of 12x16 = 1152 pixels, inside 16..4096: kept.
    assert media.video_grid_thw.tolist() == [[3, 6, 8]]
    assert enc.measure(row, REF) == (len(ids), int(trained.sum()), 144)


@settings(max_examples=60, deadline=None)
@given(
    items=st.lists(
        st.tuples(
            st.sampled_from(["image", "video"]), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3)
        ),
        min_size=1,
        max_size=4,
    ),
    texts=st.lists(st.integers(0, 4), min_size=4, max_size=4),
    seconds=st.integers(1, 3),
)
def test_positions_with_videos_equal_transformers_get_rope_index(items, texts, seconds):
    """Samples laid out as Qwen3VLProcessor writes them (per temporal patch: timestamp text, start, tokens, end)."""
    from transformers import Qwen3VLConfig, Qwen3VLModel

    config = Qwen3VLConfig(
        text_config={"vocab_size": 1032, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "head_dim": 8, "intermediate_size": 16},
        vision_config={"depth": 1, "hidden_size": 16, "num_heads": 2, "intermediate_size": 16, "out_hidden_size": 16,
                       "patch_size": 2, "spatial_merge_size": 2},
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
    )  # fmt: skip
    ids: list[int] = []
    image_grids, video_grids = [], []
    for (kind, t, h, w), n in zip(items, texts, strict=False):
        ids += list(range(5, 5 + n)) + [START]
        if kind == "image":
            image_grids.append([1, 2 * h, 2 * w])
            ids += [IMAGE] * (h * w)
        else:
            video_grids.append([t, 2 * h, 2 * w])
            for _ in range(t):
                ids += list(range(40, 40 + seconds)) + [START] + [VIDEO] * (h * w) + [END]
        ids += [END]
    input_ids = torch.tensor([ids])
    with torch.device("meta"):
        model = Qwen3VLModel(config)
    image = torch.tensor(image_grids, dtype=torch.int64).reshape(-1, 3)
    video = torch.tensor(video_grids, dtype=torch.int64).reshape(-1, 3)
    want, _ = model.get_rope_index(
        input_ids,
        (input_ids == IMAGE).int() + 2 * (input_ids == VIDEO).int(),
        image_grid_thw=image if len(image_grids) else None,
        video_grid_thw=video if len(video_grids) else None,
    )
    got = Qwen3VLPositions.from_config(config)(np.asarray(ids), image.numpy(), video.numpy())
    np.testing.assert_array_equal(got, want[:, 0].numpy())


def test_positions_reject_mismatched_video_grids():
    positions = Qwen3VLPositions(IMAGE, 2, VIDEO)
    frame = [START, VIDEO, VIDEO, END]
    with pytest.raises(ValueError, match="2 video frame grid"):  # grid t=2 -> two frame runs, one present
        positions(np.asarray([1, *frame, 2]), np.zeros((0, 3)), np.asarray([[2, 2, 4]]))
    with pytest.raises(ValueError, match="no video_token_id"):
        Qwen3VLPositions(IMAGE, 2)(np.asarray([1, 2]), np.zeros((0, 3)), np.asarray([[2, 2, 4]]))


# ---------------------------------------------------------------- bad input


def test_missing_video_file_names_file_and_row(processor_dir, tmp_path):
    with pytest.raises(DataError, match=r"rows.jsonl line 1: video 0 \(.*nope.mp4\): no such video file"):
        cached_encoder(processor_dir, str(tmp_path)).measure(video_row("nope.mp4"), REF)


def test_corrupt_and_truncated_video_files(processor_dir, tmp_path):
    enc = cached_encoder(processor_dir, str(tmp_path))
    (tmp_path / "junk.mp4").write_bytes(b"definitely not a video" * 20)
    with pytest.raises(DataError, match=r"line 1: video 0 \(.*junk.mp4\): not a readable video"):
        enc.measure(video_row("junk.mp4"), REF)
    # The header (moov) is written last by default: a cut file has none.
    write_video(tmp_path / "a.mov", frames=12, height=16, width=16, fps=4)
    data = (tmp_path / "a.mov").read_bytes()
    (tmp_path / "cut.mov").write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(
        DataError, match=r"line 1: video 0 \(.*cut.mov\): (not a readable video|the file holds no video)"
    ):
        enc.measure(video_row("cut.mov"), REF)
    # With the header first, the index reads it; the worker's decode finds the body cut.
    write_video(tmp_path / "b.mp4", frames=12, height=16, width=16, fps=4, movflags="faststart")
    data = (tmp_path / "b.mp4").read_bytes()
    (tmp_path / "cut.mp4").write_bytes(data[: len(data) // 2])
    assert enc.measure(video_row("cut.mp4"), REF) == enc.measure(video_row("b.mp4"), REF)
    with pytest.raises(DataError, match=r"line 1: video 0 \(.*cut.mp4\): the video data is corrupt"):
        enc(video_row("cut.mp4"), REF)


def test_too_few_frames(processor_dir, tmp_path):
    enc = cached_encoder(processor_dir, str(tmp_path))
    with pytest.raises(
        DataError, match=r"video 0 \(1 frame images\): 1 sampled frames of 8x8: 1 frame\(s\), fewer "
    ):
        enc.measure(video_row([png(8, 8)]), REF)
    write_video(tmp_path / "one.mov", frames=1, height=8, width=8, fps=5)
    with pytest.raises(DataError, match=r"video 0 \(.*one.mov\): 1 sampled frames .* temporal patch size 2"):
        enc.measure(video_row("one.mov"), REF)


def test_frame_list_rules(processor_dir):
    enc = encoder(processor_dir, max_frames=4)
    with pytest.raises(
        DataError, match=r"video 0 \(5 frame images\): 5 frames, more than the 4 .*video_max_frames"
    ):
        enc.measure(video_row([png(8, 8)] * 5), REF)
    with pytest.raises(
        DataError, match=r"video 0 frame 1 \(inline bytes .*\): 8x6 pixels, but frame 0 .* 8x8"
    ):
        enc.measure(video_row([png(8, 8), png(8, 6)]), REF)
    with pytest.raises(DataError, match="video 0 is an empty frame list"):
        enc.measure(video_row([]), REF)
    with pytest.raises(DataError, match=r"video 0 has fps=0; expected a number > 0"):
        enc.measure(video_row({"type": "video", "video": [png(8, 8)] * 2, "fps": 0}), REF)
    with pytest.raises(DataError, match="gives an fps for a video file"):
        enc.measure(video_row({"type": "video", "video": "/x.mp4", "fps": 2}), REF)


def test_missing_pyav_extra_names_the_install(processor_dir, tmp_path, monkeypatch):
    write_video(tmp_path / "clip.mov", frames=4, height=8, width=8, fps=2)
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` now raises ImportError
    enc = cached_encoder(processor_dir, str(tmp_path))
    with pytest.raises(
        DataError,
        match=r"video 0 \(.*clip.mov\): reading video files needs PyAV.*pip install veomni-train\[video\]",
    ):
        enc.measure(video_row("clip.mov"), REF)
    # Frame lists need no extra.
    assert enc.measure(video_row([png(8, 8)] * 2), REF)[2] == 16


def test_video_placeholder_count_must_match(processor_dir):
    enc = cached_encoder(processor_dir)
    row = video_row([png(8, 8)] * 2, answer="see <|video_pad|>")
    with pytest.raises(DataError, match=r"2 <\|video_pad\|> placeholder\(s\) .* but 1 video\(s\)"):
        enc.measure(row, REF)
    # Also where the pipeline has no video rule: a stray placeholder is never passed on to the model.
    from test_multimodal_data import encoder as image_only_encoder

    with pytest.raises(DataError, match=r"1 <\|video_pad\|> placeholder\(s\) .* but 0 video\(s\)"):
        image_only_encoder(processor_dir).measure(video_row(answer="see <|video_pad|>"), REF)


def test_unusable_video_config_refuses_only_video_rows(processor_dir):
    """The video rule is checked when the encoder is built, but only a row with a video is refused (naming why)."""
    enc = encoder(processor_dir, max_frames=1)
    assert enc.measure(video_row(images=(png(8, 8),)), REF)[2] == 16
    with pytest.raises(
        DataError, match=r"video 0 cannot be encoded: .*max_frames=1 is below the temporal patch"
    ):
        enc.measure(video_row([png(8, 8)] * 2), REF)
