"""Qwen2-VL / Qwen2.5-VL videos: the host-side position rule and the torchvision-free video rule against upstream.

* `Qwen2VLPositions` equals the upstream model's ``get_rope_index`` on random rows of images and clips (random grids,
  Qwen2.5-VL's ``second_per_grid_ts`` from random rates, two ``tokens_per_second``).
* A forward/backward with our host positions equals upstream's own (which computes them from ``mm_token_type_ids``
  and ``second_per_grid_ts``), fp32 loss and grads.
* `Qwen2VLVideoRule`'s frame sampling, defaults and patch layout equal transformers 5.23's ``Qwen2VLVideoProcessor``.
  That module imports torchvision at load (not installed here), so its class defaults and the pure methods
  ``sample_frames`` / ``patchify`` are read from the installed source file and run as upstream wrote them.
"""

from __future__ import annotations

import ast
import functools
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from test_qwen2_vl import (
    END,
    FAMILIES,
    FP32,
    IMAGE,
    START,
    VIDEO,
    assert_grads_close,
    build_pair,
    run,
    tiny_config,
)

from veomni.models.qwen2_vl.positions import Qwen2VLPositions
from veomni.models.qwen2_vl.video import DEFAULTS, Qwen2VLVideoRule, read_video_processor_config

SOURCE = Path(transformers.__file__).parent / "models" / "qwen2_vl" / "video_processing_qwen2_vl.py"


def _upstream_class() -> ast.ClassDef:
    tree = ast.parse(SOURCE.read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Qwen2VLVideoProcessor")


def _upstream_method(name: str):
    """A method of the installed ``Qwen2VLVideoProcessor``, compiled from its source (decorators dropped)."""
    node = next(n for n in _upstream_class().body if isinstance(n, ast.FunctionDef) and n.name == name)
    node.decorator_list = []
    namespace = {"math": math, "torch": torch, "VideoMetadata": object}
    exec(compile(ast.Module([node], []), str(SOURCE), "exec"), namespace)  # noqa: S102 - upstream's own code
    return namespace[name]


@functools.cache
def upstream_model(family: str, tokens_per_second: int | None):
    vision = {} if tokens_per_second is None else {"tokens_per_second": tokens_per_second}
    return FAMILIES[family][1](tiny_config(family, **vision)).model


def _row(items: list[tuple[str, tuple[int, int, int]]], gaps: list[int]) -> np.ndarray:
    ids: list[int] = []
    for (kind, (t, h, w)), gap in zip(items, gaps, strict=False):
        ids += [7] * gap + [START] + [IMAGE if kind == "image" else VIDEO] * (t * h * w // 4) + [END]
    return np.asarray(ids + [9, 9], dtype=np.int64)


grids = st.tuples(
    st.integers(1, 4), st.integers(1, 4).map(lambda n: 2 * n), st.integers(1, 4).map(lambda n: 2 * n)
)


@settings(max_examples=60, deadline=None)
@given(
    family=st.sampled_from(list(FAMILIES)),
    tokens_per_second=st.sampled_from([2, 25]),
    items=st.lists(st.tuples(st.sampled_from(["image", "video"]), grids), min_size=0, max_size=4),
    gaps=st.lists(st.integers(0, 3), min_size=4, max_size=4),
    rates=st.lists(st.floats(0.3, 30.0), min_size=4, max_size=4),
)
def test_positions_equal_upstream_get_rope_index(family, tokens_per_second, items, gaps, rates):
    tps = tokens_per_second if family == "qwen2_5_vl" else None
    model = upstream_model(family, tps)
    ids = _row(items, gaps)
    image = np.asarray([g for k, g in items if k == "image"], dtype=np.int64).reshape(-1, 3)
    video = np.asarray([g for k, g in items if k == "video"], dtype=np.int64).reshape(-1, 3)
    seconds = [2 / r for r in rates[: len(video)]]  # the processor's temporal_patch_size / sampled_fps
    got = Qwen2VLPositions.from_config(model.config)(ids, image, video, seconds if tps else None)

    input_ids = torch.from_numpy(ids)[None]
    kinds = (input_ids == IMAGE).int() + 2 * (input_ids == VIDEO).int()
    extra = {"second_per_grid_ts": torch.tensor(seconds)} if tps and len(video) else {}
    want, _ = model.get_rope_index(
        input_ids,
        kinds,
        image_grid_thw=torch.from_numpy(image) if len(image) else None,
        video_grid_thw=torch.from_numpy(video) if len(video) else None,
        **extra,
    )
    np.testing.assert_array_equal(got, want[:, 0].numpy())


def test_positions_refuse_runs_that_do_not_match_their_grids():
    rule = Qwen2VLPositions(IMAGE, VIDEO, 2, 4.0)
    two_clips_one_run = np.asarray([1, START] + [VIDEO] * 2 + [END], dtype=np.int64)
    with pytest.raises(ValueError, match=r"video 0 has grid \(1, 2, 2\), i.e. 1 placeholder tokens, but its run "
                       r"holds 2; every video must be one run"):  # fmt: skip
        rule(two_clips_one_run, np.zeros((0, 3)), np.asarray([[1, 2, 2], [1, 2, 2]]))
    one_clip = np.asarray([1, START, VIDEO, END], dtype=np.int64)
    with pytest.raises(ValueError, match=r"2 video grid\(s\) but placeholder runs for only 1"):
        rule(one_clip, np.zeros((0, 3)), np.asarray([[1, 2, 2], [1, 2, 2]]))
    with pytest.raises(ValueError, match=r"second_per_grid_ts has 2 value\(s\) but there are 1 video grid"):
        rule(one_clip, np.zeros((0, 3)), np.asarray([[1, 2, 2]]), [1.0, 2.0])


# One clip long enough for the time axis to matter (t = 3), a clip beside an image, and a clip-only row.
VIDEO_ROWS = [[("video", (3, 4, 6)), ("image", (1, 4, 4))], [("video", (2, 2, 4))]]
SECONDS = [0.8, 1.3]


def _batch(items_per_row, seconds: list[float]) -> tuple[dict, torch.Tensor, list[np.ndarray]]:
    gen = torch.Generator().manual_seed(3)
    rows = [_row(items, [1 + k for k in range(len(items))]) for items in items_per_row]
    width = max(len(r) for r in rows)
    rows = [np.concatenate([r, np.full(width - len(r), 11, np.int64)]) for r in rows]
    input_ids = torch.from_numpy(np.stack(rows))
    batch = {
        "input_ids": input_ids,
        "labels": input_ids.masked_fill((input_ids == IMAGE) | (input_ids == VIDEO), -100),
        "mm_token_type_ids": (input_ids == IMAGE).long() + 2 * (input_ids == VIDEO).long(),
    }
    for kind in ("image", "video"):
        grid = [g for items in items_per_row for k, g in items if k == kind]
        key = "pixel_values" if kind == "image" else "pixel_values_videos"
        batch[key] = torch.randn(sum(math.prod(g) for g in grid), 3 * 2 * 2 * 2, generator=gen)
        batch[f"{kind}_grid_thw"] = torch.tensor(grid)
    per_row_seconds, start = [], 0
    for items in items_per_row:
        count = sum(k == "video" for k, _ in items)
        per_row_seconds.append(np.asarray(seconds[start : start + count]))
        start += count
    return batch, torch.tensor(seconds), per_row_seconds


def _host_positions(model, batch: dict, per_row: list[np.ndarray]) -> torch.Tensor:
    """``[4, B, S]`` position ids as the data pipeline writes them: text row, then `Qwen2VLPositions`."""
    rule = Qwen2VLPositions.from_config(model.config)
    mrope = []
    for row, items, secs in zip(batch["input_ids"].numpy(), VIDEO_ROWS, per_row, strict=True):
        image = np.asarray([g for k, g in items if k == "image"]).reshape(-1, 3)
        video = np.asarray([g for k, g in items if k == "video"]).reshape(-1, 3)
        mrope.append(np.concatenate([np.arange(len(row))[None], rule(row, image, video, secs)]))
    return torch.from_numpy(np.stack(mrope, axis=1))


@pytest.mark.parametrize("family", FAMILIES)
def test_step_with_host_positions_equals_upstream_on_videos(family):
    """Our model fed the data pipeline's host positions (4 rows: text, then t/h/w) equals upstream computing them
    itself from the token types and ``second_per_grid_ts`` (fp32 loss and every gradient)."""
    ref, model = build_pair(family, "sdpa")
    batch, seconds, per_row = _batch(VIDEO_ROWS, SECONDS)
    extra = {"second_per_grid_ts": seconds} if family == "qwen2_5_vl" else {}
    ref_logits, ref_loss, ref_grads = run(ref, {**batch, **extra})
    position_ids = _host_positions(model, batch, per_row)
    if family == "qwen2_5_vl":  # the time axis really is spread: frame 1 of clip 0 sits 0.8 * 4 = 3 ids on
        assert position_ids[1, 0].unique().numel() > 3
    ours = {k: v for k, v in batch.items() if k != "mm_token_type_ids"}
    logits, loss, grads = run(model, {**ours, "position_ids": position_ids})
    torch.testing.assert_close(logits, ref_logits, **FP32)
    torch.testing.assert_close(loss, ref_loss, **FP32)
    assert_grads_close(grads, ref_grads)
    assert all(g is not None for g in grads.values())


def test_defaults_are_the_installed_processors():
    """`DEFAULTS` against the class attributes in the installed source (and the base class' three)."""
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
    from transformers.processing_utils import VideosKwargs
    from transformers.video_processing_utils import BaseVideoProcessor

    found = {}
    for node in _upstream_class().body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name in DEFAULTS:
                found[name] = eval(  # noqa: S307 - literals and two constants of the installed source
                    compile(ast.Expression(node.value), str(SOURCE), "eval"),
                    {"OPENAI_CLIP_MEAN": OPENAI_CLIP_MEAN, "OPENAI_CLIP_STD": OPENAI_CLIP_STD,
                     "PILImageResampling": SimpleNamespace(BICUBIC=3)},
                )  # fmt: skip
    # The base class sets every ``VideosKwargs`` key the class leaves out to None (``getattr(self, key, None)``).
    assert {"fps", "num_frames"} <= set(VideosKwargs.__annotations__)
    for name in ("rescale_factor", "fps", "num_frames"):
        found[name] = getattr(BaseVideoProcessor, name, None)
    found["image_mean"], found["image_std"] = list(found["image_mean"]), list(found["image_std"])
    assert found == DEFAULTS


@settings(max_examples=80, deadline=None)
@given(
    total=st.integers(2, 400),
    source_fps=st.floats(1.0, 60.0),
    fps=st.floats(0.25, 8.0),
    min_frames=st.integers(1, 8),
    max_frames=st.integers(2, 64),
)
def test_frame_sampling_equals_upstream(total, source_fps, fps, min_frames, max_frames):
    sample_frames = _upstream_method("sample_frames")
    upstream_self = SimpleNamespace(num_frames=None, fps=fps, temporal_patch_size=2, min_frames=min_frames,
                                    max_frames=max_frames)  # fmt: skip
    metadata = SimpleNamespace(total_num_frames=total, fps=source_fps)
    rule = Qwen2VLVideoRule(
        patch_size=2, temporal_patch_size=2, merge_size=2, min_pixels=16, max_pixels=4096, fps=fps,
        min_frames=min_frames, max_frames=max_frames, cap_pixels_per_frame=False, max_video_tokens=128000,
        do_resize=True, resample="bicubic", do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
        image_mean=(0.5,) * 3, image_std=(0.5,) * 3,
    )  # fmt: skip
    try:
        want = sample_frames(upstream_self, metadata).numpy()
    except ZeroDivisionError:  # upstream divides by a 0-frame sample; ours names the cause
        with pytest.raises(ValueError, match="fewer than the temporal patch size"):
            rule.sample_indices(total, source_fps)
        return
    np.testing.assert_array_equal(rule.sample_indices(total, source_fps), want)


def test_patch_layout_equals_upstream_patchify(tmp_path):
    patchify = _upstream_method("patchify")
    plain = {"patch_size": 2, "merge_size": 2, "do_resize": False, "do_normalize": False, "do_rescale": False}
    rule = Qwen2VLVideoRule.from_pretrained(_config_dir(tmp_path, plain))
    frames = np.random.default_rng(0).integers(0, 255, (5, 8, 12, 3), dtype=np.uint8)  # 5 frames: padded to 6
    rows, grid = rule.pixel_rows(frames)
    video = torch.from_numpy(frames).permute(0, 3, 1, 2).float()[None]
    padded = torch.cat([video, video[:, -1:]], dim=1)
    want, t, h, w = patchify(None, padded, patch_size=2, merge_size=2, temporal_patch_size=2)
    assert grid == (t, h, w) == (3, 4, 6)
    np.testing.assert_array_equal(rows, want[0].numpy())


def _config_dir(root: Path, settings: dict, name: str = "video_preprocessor_config.json") -> str:
    root.mkdir(parents=True, exist_ok=True)
    (root / name).write_text(json.dumps(settings))
    return str(root)


def test_config_reading_sampling_and_errors(tmp_path):
    # Qwen2-VL checkpoints store per-frame bounds as min_pixels / max_pixels in preprocessor_config.json.
    path = _config_dir(
        tmp_path, {"min_pixels": 64, "max_pixels": 1024, "patch_size": 2}, "preprocessor_config.json"
    )
    settings = read_video_processor_config(path)
    assert settings["size"] == {"shortest_edge": 64, "longest_edge": 1024}
    rule = Qwen2VLVideoRule.from_pretrained(path)
    assert rule.fps is None and rule.max_frames == 768 and rule.resample == "bicubic"
    # No sampling (upstream's default): every frame, refused above max_frames rather than fed whole.
    np.testing.assert_array_equal(rule.sample_indices(5, 30.0), np.arange(5))
    capped = Qwen2VLVideoRule.from_pretrained(path, max_frames=4)
    with pytest.raises(ValueError, match=r"5 frames, more than max_frames=4 .*set data.video_fps"):
        capped.sample_indices(5, 30.0)
    assert Qwen2VLVideoRule.from_pretrained(path, fps=2.0).fps == 2.0
    # Per-frame resize (the image rule), and the per-frame cap of cap_pixels_per_frame.
    assert rule.resized_size(6, 10, 30) == (8, 32) and rule.grid(5, 10, 30) == (3, 4, 16)
    assert rule.tokens((3, 4, 16)) == 48 and rule.second_per_grid(4, 8, 30.0) == pytest.approx(2 / 15)
    capped_pixels = {"size": {"shortest_edge": 16, "longest_edge": 4096}, "patch_size": 2,
                     "cap_pixels_per_frame": True, "max_video_tokens": 10}  # fmt: skip
    cap = Qwen2VLVideoRule.from_pretrained(_config_dir(tmp_path / "cap", capped_pixels))
    # budget int(10 * 4 * 4 * 0.9) = 144 pixels * 2 // 4 frames = 72 per frame -> 8 x 8 from 40 x 40
    assert cap.resized_size(4, 40, 40) == (8, 8)
    with pytest.raises(
        ValueError, match="is a Qwen3VLVideoProcessor config; Qwen2-VL / Qwen2.5-VL videos need"
    ):
        read_video_processor_config(
            _config_dir(tmp_path / "q3", {"video_processor_type": "Qwen3VLVideoProcessor"})
        )
    with pytest.raises(ValueError, match="fixes num_frames=8; only fps sampling is supported"):
        Qwen2VLVideoRule.from_pretrained(_config_dir(tmp_path / "n", {"num_frames": 8}))
    with pytest.raises(ValueError, match="samples frames .do_sample_frames. but sets no fps"):
        Qwen2VLVideoRule.from_pretrained(_config_dir(tmp_path / "s", {"do_sample_frames": True}))


@pytest.mark.cuda
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_video_step_with_host_positions_and_kernels_matches_upstream(family):
    """On a GPU: Triton RMSNorm / RoPE / SwiGLU / fused cross-entropy and the encoder entry with the collator's tables,
    fed host positions, against upstream computing its own positions (fp32, TF32 off) on video rows."""
    from veomni.kernels import OpsConfig
    from veomni.models.hf.kernel_hooks import apply_ops

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ref, model = build_pair(family, "sdpa")
    ref, model = ref.cuda(), model.cuda()
    apply_ops(model, OpsConfig(attention="sdpa", rms_norm="triton", rope="triton", swiglu="triton",
                               cross_entropy="triton"))  # fmt: skip
    batch, seconds, per_row = _batch(VIDEO_ROWS, SECONDS)
    extra = {"second_per_grid_ts": seconds} if family == "qwen2_5_vl" else {}
    position_ids = _host_positions(model, batch, per_row)
    grid = torch.cat([batch["image_grid_thw"], batch["video_grid_thw"]])
    tables = {
        k: v.cuda() if torch.is_tensor(v) else v for k, v in model.vision_collate_metadata()(grid).items()
    }
    batch = {k: v.cuda() for k, v in batch.items()}
    want = run(ref, {**batch, **{k: v.cuda() for k, v in extra.items()}})
    ours = {k: v for k, v in batch.items() if k != "mm_token_type_ids"}
    got = run(model, {**ours, "position_ids": position_ids.cuda(), "vision_metadata": tables})
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    for name, grad in got[2].items():
        torch.testing.assert_close(
            grad, want[2][name], rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )
