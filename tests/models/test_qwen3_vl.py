"""The generated Qwen3-VL adapter against upstream transformers, single process (distributed and loading tests:
test_qwen3_vl_dist.py, which imports the tiny config and batches from here).

Oracle: transformers' own ``Qwen3VLForConditionalGeneration`` with the same weights. With no kernels (or eager ones)
and HF attention names the adapter is bitwise upstream on image batches; with veomni kernels and the encoder varlen
entry it is within fp32 tolerance.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Qwen3VLConfig
from transformers.models.qwen3_vl import modeling_qwen3_vl as upstream
from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

from veomni.kernels import OpsConfig, resolve_kernels
from veomni.models.hf.kernel_hooks import apply_ops, attach_kernels
from veomni.models.qwen3_vl.generated import patched_modeling_qwen3_vl as ours
from veomni.models.qwen3_vl.vision import vision_geometry
from veomni.models.registry import MODELS

IMAGE, VIDEO, START, END = 100, 101, 102, 103
VOCAB = 128


def tiny_config(deepstack: tuple[int, ...] = (0, 1)) -> Qwen3VLConfig:
    """2 text layers, a 2-block ViT with deepstack, interleaved mrope; untied LM head."""
    return Qwen3VLConfig(
        text_config={
            "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
            "rope_parameters": {
                "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True,
            },
        },
        vision_config={
            "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4, "patch_size": 2,
            "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 64, "num_position_embeddings": 16,
            "deepstack_visual_indexes": list(deepstack),
        },
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
        tie_word_embeddings=False,
    )  # fmt: skip


def vlm_batch(
    rows: list[list[tuple[str, tuple[int, int, int]]]], seed: int = 0, length: int | None = None
) -> dict[str, torch.Tensor]:
    """Rows of text with image / video placeholder runs; ``rows[i]`` lists ``(kind, (t, h, w))`` per item.

    Every row is right-padded with text tokens to the same length; labels are the ids (no ignored tokens except
    placeholders, as a chat collator would mask them).
    """
    gen = torch.Generator().manual_seed(seed)
    ids_rows, pixels, grids = [], {"image": [], "video": []}, {"image": [], "video": []}
    for items in rows:
        ids: list[int] = []
        for kind, (t, h, w) in items:
            ids += torch.randint(0, 90, (2,), generator=gen).tolist()
            if kind == "image":
                ids += [START] + [IMAGE] * (h * w // 4) + [END]
            else:
                # Qwen3-VL separates a clip's frames with a timestamp: one placeholder run per frame.
                for _ in range(t):
                    ids += (
                        [int(torch.randint(0, 90, (1,), generator=gen))]
                        + [START]
                        + [VIDEO] * (h * w // 4)
                        + [END]
                    )
            pixels[kind].append(torch.randn(t * h * w, 3 * 2 * 2 * 2, generator=gen))
            grids[kind].append((t, h, w))
        ids += torch.randint(0, 90, (3,), generator=gen).tolist()
        ids_rows.append(ids)
    width = max(len(r) for r in ids_rows) if length is None else length
    ids_rows = [r + torch.randint(0, 90, (width - len(r),), generator=gen).tolist() for r in ids_rows]
    input_ids = torch.tensor(ids_rows)
    labels = input_ids.masked_fill((input_ids == IMAGE) | (input_ids == VIDEO), -100)
    batch = {
        "input_ids": input_ids,
        "labels": labels,
        "mm_token_type_ids": (input_ids == IMAGE).long() + 2 * (input_ids == VIDEO).long(),
    }
    if pixels["image"]:
        batch["pixel_values"] = torch.cat(pixels["image"])
        batch["image_grid_thw"] = torch.tensor(grids["image"])
    if pixels["video"]:
        batch["pixel_values_videos"] = torch.cat(pixels["video"])
        batch["video_grid_thw"] = torch.tensor(grids["video"])
    return batch


IMAGES = [[("image", (1, 4, 4)), ("image", (1, 2, 6))], [("image", (1, 2, 2))]]
MIXED = [[("image", (1, 4, 4)), ("video", (2, 2, 4))], [("video", (2, 2, 2)), ("image", (1, 2, 2))]]
TEXT_ONLY = [[], []]

EAGER_OPS = dict(rms_norm="eager", rope="eager", swiglu="eager", cross_entropy="eager")
FP32 = {"rtol": 1e-5, "atol": 1e-5}


def build_pair(attn: str, seed: int = 0, **config_kw) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Upstream and adapter models with the same weights, HF attention implementation ``attn``."""
    config = tiny_config(**config_kw)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    ref = upstream.Qwen3VLForConditionalGeneration(copy.deepcopy(config))
    model = ours.Qwen3VLForConditionalGeneration(config)
    model.load_state_dict(ref.state_dict(), strict=True)
    return ref, model


def run(
    model: torch.nn.Module, batch: dict
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    logits = None if out.logits is None else out.logits.detach()
    return logits, out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_sub_models_are_the_patched_classes():
    _, model = build_pair("sdpa")
    assert type(model.model.visual) is ours.Qwen3VLVisionModel
    assert type(model.model.language_model) is ours.Qwen3VLTextModel


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kernels", [None, "eager"], ids=["no-kernels", "eager-kernels"])
def test_eager_adapter_is_bitwise_upstream_on_images(attn, kernels):
    ref, model = build_pair(attn)
    if kernels:
        attach_kernels(model, resolve_kernels(OpsConfig(**EAGER_OPS)))
    batch = vlm_batch(IMAGES)
    ref_logits, ref_loss, ref_grads = run(ref, batch)
    logits, loss, grads = run(model, batch)
    assert torch.equal(logits, ref_logits) and torch.equal(loss, ref_loss)
    unequal = [n for n, g in grads.items() if not torch.equal(g, ref_grads[n])]
    assert not unequal, unequal
    assert all(g is not None for g in grads.values())


@pytest.mark.parametrize("rows", [MIXED, TEXT_ONLY], ids=["images+videos", "text-only"])
def test_images_videos_and_text_only_match_upstream(rows):
    # Images and videos run through the tower in one pass (upstream: one per modality), so the matmul shapes
    # differ and the result is equal within fp32 rounding, not bitwise; text-only batches are bitwise.
    ref, model = build_pair("sdpa")
    batch = vlm_batch(rows, seed=4)
    ref_logits, ref_loss, ref_grads = run(ref, batch)
    logits, loss, grads = run(model, batch)
    if rows is TEXT_ONLY:
        assert torch.equal(logits, ref_logits) and torch.equal(loss, ref_loss)
    torch.testing.assert_close(logits, ref_logits, **FP32)
    torch.testing.assert_close(loss, ref_loss, **FP32)
    for name, grad in grads.items():
        if ref_grads[name] is None:
            assert grad is None, name
        else:
            torch.testing.assert_close(
                grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
            )


@pytest.mark.parametrize(
    "ops",
    [
        {"attention": "sdpa"},
        pytest.param(
            {"attention": "eager", "rms_norm": "triton", "rope": "triton", "swiglu": "triton"},
            marks=pytest.mark.triton_cpu,
        ),
        pytest.param(
            {"attention": "sdpa", "rms_norm": "torch", "cross_entropy": "triton"},
            marks=pytest.mark.triton_cpu,
        ),
        # The tower's 2-D RoPE through the rope_vision registry op; the portable chunked CE.
        pytest.param(
            {"attention": "sdpa", "rope_vision": "triton", "cross_entropy": "chunk_loss"},
            marks=pytest.mark.triton_cpu,
        ),
    ],
    ids=lambda ops: "+".join(f"{k}={v}" for k, v in ops.items()),
)
def test_veomni_kernels_and_encoder_attention_match_upstream(ops):
    ref, model = build_pair("sdpa")
    apply_ops(model, OpsConfig(**{**EAGER_OPS, **ops}))
    name = f"veomni_{ops['attention']}"
    # The tower follows the model's implementation, so it attends through encoder_attention.
    assert model.model.visual.config._attn_implementation == name
    assert model.model.language_model.config._attn_implementation == name
    batch = vlm_batch(IMAGES, seed=2)
    ref_logits, ref_loss, ref_grads = run(ref, batch)
    logits, loss, grads = run(model, batch)
    if ops.get("cross_entropy", "eager") == "eager":
        torch.testing.assert_close(logits, ref_logits, **FP32)
    else:
        assert logits is None  # the fused loss never materialises [T, V] logits
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(
            grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_tower_through_encoder_attention_equals_per_image_path_without_host_syncs(monkeypatch):
    ref, model = build_pair("sdpa")
    apply_ops(model, OpsConfig(attention="sdpa", **EAGER_OPS))
    batch = vlm_batch(MIXED, seed=6)
    pixels = torch.cat([batch["pixel_values"], batch["pixel_values_videos"]])
    grid = torch.cat([batch["image_grid_thw"], batch["video_grid_thw"]])
    want = ref.model.visual(pixels, grid_thw=grid)

    calls, in_kernel = [], []
    real_attention, real = ours.encoder_attention, {"tolist": torch.Tensor.tolist, "item": torch.Tensor.item}

    def counting(*args, **kwargs):
        calls.append(kwargs["cu_seqlens"].clone())
        in_kernel.append(True)
        try:
            return real_attention(*args, **kwargs)
        finally:
            in_kernel.pop()

    def no_sync(name):
        # The tower's own code must not read the host; the attention kernel may (on the CPU, sdpa reads the offsets
        # to run segment by segment, which costs nothing there; the CUDA kernels take cu_seqlens as a tensor).
        def guard(self, *args, **kwargs):
            if in_kernel:
                return real[name](self, *args, **kwargs)
            raise AssertionError("host sync (.tolist() / .item()) in the vision tower")

        return guard

    monkeypatch.setattr(ours, "encoder_attention", counting)
    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "tolist", no_sync("tolist"))
        patch.setattr(torch.Tensor, "item", no_sync("item"))
        got = model.model.visual(pixels, grid_thw=grid)
    # One packed call per block over every frame: images 4x4 and 2x2, then clips 2x(2x4) and 2x(2x2).
    assert len(calls) == 2
    assert calls[0].tolist() == [0, 16, 20, 28, 36, 40, 44]
    torch.testing.assert_close(got.pooler_output, want.pooler_output, **FP32)
    for g, w in zip(got.deepstack_features, want.deepstack_features, strict=True):
        torch.testing.assert_close(g, w, **FP32)


@settings(max_examples=60, deadline=None)
@given(
    grid=st.lists(
        st.tuples(
            st.integers(1, 3), st.integers(1, 5).map(lambda n: 2 * n), st.integers(1, 5).map(lambda n: 2 * n)
        ),
        min_size=1,
        max_size=4,
    ),
    side=st.integers(2, 5),
)
def test_vision_geometry_equals_upstream_helpers(grid, side):
    grid_thw = torch.tensor(grid)
    total = int(grid_thw.prod(-1).sum())
    positions, indices, weights = vision_geometry(grid_thw, 2, side, total)
    assert torch.equal(positions, get_vision_position_ids(grid_thw, 2))
    want_indices, want_weights = get_vision_interpolation_indices_and_weights(
        grid_thw, side, mode="bilinear", align_corners=True, spatial_merge_size=2
    )
    assert torch.equal(indices, want_indices) and torch.equal(weights, want_weights)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dummy_forward_is_zero_and_reaches_every_tower_parameter(dtype):
    _, model = build_pair("sdpa")
    visual = model.model.visual.to(dtype)
    out = visual.dummy_forward()
    assert out.shape == () and out.dtype == dtype and float(out.detach()) == 0.0
    out.backward()
    missing = [n for n, p in visual.named_parameters() if p.grad is None]
    assert not missing, missing


def test_registry_resolves_the_adapter_for_image_text_to_text():
    config = tiny_config()
    resolved = MODELS.model_class(config, "image_text_to_text")
    assert resolved.cls is ours.Qwen3VLForConditionalGeneration and resolved.registered
    assert resolved.fast_paths == {"sp", "fused_kernels"}
    assert MODELS.model_class(config, "base").cls is ours.Qwen3VLModel
    with pytest.raises(ValueError, match="does not support task 'causal_lm'.*image_text_to_text"):
        MODELS.model_class(config, "causal_lm")


def test_pixels_without_grid_are_refused():
    _, model = build_pair("sdpa")
    batch = vlm_batch(IMAGES)
    del batch["image_grid_thw"]
    with pytest.raises(ValueError, match="pixel_values was given without its grid_thw"):
        model(**batch)


def test_generation_matches_upstream():
    ref, model = build_pair("sdpa")
    apply_ops(model, OpsConfig(attention="sdpa", **EAGER_OPS))
    batch = vlm_batch([[("image", (1, 4, 4))]], seed=8)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(**inputs, **settings), ref.generate(**inputs, **settings))
