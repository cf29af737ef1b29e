"""Qwen2.5-Omni's host-side tower layouts: the audio chunk tables (`AudioChunks`) equal upstream's device
derivation, and a thinker forward fed the collator's tables (``audio_metadata``, ``vision_metadata``, host
positions) equals one that derives them itself; on a GPU that forward reads nothing back but the placeholder
count."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_qwen2_5_omni import MIXED, omni_batch, pair, tiny_config
from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as upstream

from veomni.models.qwen2_5_omni.audio_layout import AudioChunks
from veomni.models.qwen2_5_omni.positions import Qwen2_5OmniPositions


def _upstream_tables(frames: list[int], padded: int, n_window: int) -> dict[str, torch.Tensor]:
    mels = 3
    features = torch.randn(len(frames), mels, padded)
    mask = torch.stack([torch.arange(padded) < n for n in frames]).long()
    flat = features.permute(0, 2, 1)[mask.bool()].permute(1, 0)
    lens = mask.sum(1)
    padded_feature, chunk_lengths = upstream.chunk_and_pad_features(flat, lens, n_window)
    return {
        "features": features,
        "flat": flat,
        "padded_feature": padded_feature,
        "chunk_lengths": chunk_lengths,
        "cu_seqlens": upstream.get_audio_cu_seqlens(chunk_lengths),
        "valid_indices": upstream.get_valid_indices(chunk_lengths),
        "pool_indices": upstream.get_pool_indices(lens),
    }


@settings(max_examples=40, deadline=None)
@given(
    frames=st.lists(st.integers(1, 70), min_size=1, max_size=4),
    extra=st.integers(0, 5),
    n_window=st.sampled_from([2, 4, 50]),
)
def test_audio_chunks_equal_upstreams_device_tables(frames, extra, n_window):
    padded = max(frames) + extra
    want = _upstream_tables(frames, padded, n_window)
    got = AudioChunks(n_window)(frames, padded)
    mels = want["features"].shape[1]
    gathered = want["features"].permute(0, 2, 1).reshape(-1, mels)[got["frame_index"]].T
    assert torch.equal(gathered, want["flat"])
    rows = torch.cat([gathered.T, gathered.new_zeros(1, mels)])[got["chunk_rows"]]
    padded_feature = rows.view(got["chunk_lengths"].shape[0], -1, mels).transpose(1, 2)
    assert torch.equal(padded_feature, want["padded_feature"])
    for name in ("chunk_lengths", "cu_seqlens", "valid_indices", "pool_indices"):
        assert torch.equal(got[name], want[name]), name
        assert got[name].dtype == want[name].dtype, name
    segments = want["cu_seqlens"][1:] - want["cu_seqlens"][:-1]
    assert got["max_seqlen"] == int(segments.max())
    assert got["audio_tokens"] == want["pool_indices"].numel()


def test_audio_chunks_refuse_bad_lengths_and_pickle():
    layout = pickle.loads(pickle.dumps(AudioChunks.from_config(tiny_config().audio_config)))
    assert layout.n_window == 4
    for frames, padded in (([0], 4), ([5], 4), ([], 4)):
        with pytest.raises(ValueError, match=r"one frame count per clip in \[1, 4\]"):
            layout(frames, padded)


def _build(ref, device: str = "cpu"):
    from loading_fixtures import EAGER

    from veomni.kernels import OpsConfig
    from veomni.models.build import build_model

    model = build_model(tiny_config(), ops=OpsConfig(**{**EAGER, "attention": "sdpa"}), task="any_to_any",
                        init_device="cpu")  # fmt: skip
    model.load_state_dict(ref.state_dict())
    return model.to(device)


def _one_row_batch(seed: int = 0) -> dict:
    return omni_batch([[("audio", 20), ("image", 4), ("audio", 9), ("image", 8)]], seed=seed)


def _with_host_tables(model, batch: dict) -> dict:
    frames = batch["feature_attention_mask"].sum(-1)
    positions = Qwen2_5OmniPositions(tiny_config())(
        batch["input_ids"][0].numpy(),
        image_grid_thw=batch["image_grid_thw"].numpy(),
        audio_frames=frames.numpy(),
    )
    return {
        **batch,
        "attention_mask": None,
        "position_ids": torch.as_tensor(positions)[:, None],
        "vision_metadata": model.vision_collate_metadata()(batch["image_grid_thw"]),
        "audio_metadata": AudioChunks.from_config(tiny_config().audio_config)(
            frames.tolist(), batch["input_features"].shape[2]
        ),
    }


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_thinker_with_host_tables_equals_the_device_derivation():
    """Loss and every gradient equal with and without the collator's tables (veomni attention in the towers, so
    the varlen layout and max_seqlen paths are the ones taken); the tables are also read by the windowed ViT."""
    ref, _ = pair()
    model = _build(ref)
    batch = _one_row_batch()
    want = model(**batch).loss
    want.backward()
    want_grads = _grads(model)
    model.zero_grad(set_to_none=True)
    got = model(**_with_host_tables(model, batch)).loss
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    got_grads = _grads(model)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(
            got_grads[name], grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )
    # Upstream eager agrees too (the tables change nothing of the maths).
    torch.testing.assert_close(got, ref(**batch).loss, rtol=1e-5, atol=1e-6)


def test_audio_metadata_that_disagrees_with_the_tower_raises():
    ref, _ = pair()
    model = _build(ref)
    inputs = _with_host_tables(model, _one_row_batch())
    inputs["audio_metadata"] = {**inputs["audio_metadata"], "audio_tokens": 999}
    with pytest.raises(ValueError, match="audio_metadata expects 999"):
        model(**inputs)


def test_mixed_rows_keep_their_loss_with_host_tables():
    """Several rows (one of them without an image, one without audio): the joint image grids' window layout."""
    ref, _ = pair()
    model = _build(ref)
    batch = omni_batch(MIXED, seed=3)
    frames = batch["feature_attention_mask"].sum(-1)
    inputs = {
        **batch,
        "vision_metadata": model.vision_collate_metadata()(batch["image_grid_thw"]),
        "audio_metadata": AudioChunks(4)(frames.tolist(), batch["input_features"].shape[2]),
    }
    torch.testing.assert_close(model(**inputs).loss, model(**batch).loss, rtol=1e-6, atol=1e-6)


@pytest.mark.cuda
def test_gpu_forward_backward_with_host_tables_reads_back_only_placeholder_counts():
    """bf16 on a GPU with the default attention: with the collator's tables and positions, the only host sync
    raised from Python code of the model is the placeholder count check (one read-back for every modality): none
    in the towers' layers or layout. Syncs without any veomni/transformers frame (C++ only, e.g. the autograd
    engine) are listed in the message but not refused."""
    import traceback
    import warnings

    from veomni.kernels import OpsConfig
    from veomni.models.hf.kernel_hooks import apply_ops

    ref, _ = pair()
    model = _build(ref, device="cuda").to(torch.bfloat16)  # varlen attention runs bf16/fp16 only
    apply_ops(model, OpsConfig())
    host = _with_host_tables(model, _one_row_batch())
    inputs = {
        k: (
            {n: t.cuda() if torch.is_tensor(t) else t for n, t in v.items()} if isinstance(v, dict)
            else v.cuda() if torch.is_tensor(v) else v
        )
        for k, v in host.items()
    }  # fmt: skip
    inputs["input_features"] = inputs["input_features"].to(torch.bfloat16)
    inputs["pixel_values"] = inputs["pixel_values"].to(torch.bfloat16)
    model(**inputs).loss.backward()  # warm-up (compilation and autotuning may read the device)
    torch.cuda.synchronize()
    ours, other = [], []
    previous = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        frames = [
            f
            for f in traceback.extract_stack()[:-1]
            if "/veomni/" in f.filename or "/transformers/" in f.filename
        ]
        (ours if frames else other).append(
            f"{frames[-1].filename}:{frames[-1].lineno} {frames[-1].name}"
            if frames
            else f"{filename}:{lineno}"
        )

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            loss = model(**inputs).loss
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = previous
    assert all("check_placeholder_counts" in site for site in ours), (ours, other)
    assert len(ours) <= 1, (ours, other)
    assert np.isfinite(float(loss))
