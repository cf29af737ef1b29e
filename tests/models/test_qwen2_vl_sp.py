"""Qwen2-VL and Qwen2.5-VL under Ulysses sequence parallelism (ViT + LLM) on real gloo ranks, against the same
model unsliced (the Qwen3-VL SP test's method: tests/models/test_qwen3_vl_sp.py).

Each SP rank feeds its slice of ``input_ids`` / ``position_ids`` / shifted labels and the full pixel rows; the
summed per-rank losses and the all-reduced gradients must equal the single-process ones (fp32). Qwen2.5-VL's tower
runs once with the collator's window layout (``vision_metadata``) and once computing it itself. Neither the patch
count nor the sequence length is divisible by the SP size, and the grids span several (ragged) windows, so windows
straddle the ranks' patch chunks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_qwen2_vl import FAMILIES, IMAGE, VIDEO, tiny_config, vlm_batch

from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import build_parallel_state, use_parallel_state
from veomni.core.sp import slice_sequence
from veomni.models.hf.attention import register_hf_attention

IGNORE = -100
# Patches 108 and 116, sequence lengths 51 and 45: none divisible by 2 * 4 or 4 * 4 (patches), 2 or 4 (tokens).
CASES = {
    "images": ([[("image", (1, 8, 12)), ("image", (1, 2, 6))]], 51),
    "images_and_videos": ([[("image", (1, 4, 8)), ("video", (2, 6, 4))], [("video", (2, 2, 2)), ("image", (1, 6, 2))]], 45),
}  # fmt: skip


def _inputs(model, case: str) -> tuple[dict, torch.Tensor, torch.Tensor]:
    items, length = CASES[case]
    batch = vlm_batch(items, seed=5, length=length)
    position_ids, _ = model.model.get_rope_index(
        batch["input_ids"],
        mm_token_type_ids=batch["mm_token_type_ids"],
        image_grid_thw=batch.get("image_grid_thw"),
        video_grid_thw=batch.get("video_grid_thw"),
    )
    labels = batch["labels"]
    shift = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], dim=1)
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "mm_token_type_ids")}
    return inputs, position_ids, shift


def _sp_case(ctx, family: str, case: str, precomputed: bool) -> dict:
    state = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type)
    group = state.sp_group
    register_hf_attention()
    torch.manual_seed(0)
    model = FAMILIES[family][2](tiny_config(family))
    model.set_attn_implementation("veomni_sdpa")
    inputs, position_ids, shift = _inputs(model, case)
    if precomputed:
        grids = [inputs[k] for k in ("image_grid_thw", "video_grid_thw") if k in inputs]
        inputs["vision_metadata"] = model.vision_collate_metadata()(torch.cat(grids))
    items = int((shift != IGNORE).sum())

    ref = model(**inputs, position_ids=position_ids, shift_labels=shift, num_items_in_batch=items).loss
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    local_ids = slice_sequence(inputs["input_ids"], 1, group)
    with use_parallel_state(state):
        loss = model(
            **{**inputs, "input_ids": local_ids},
            position_ids=slice_sequence(position_ids, 2, group),
            shift_labels=slice_sequence(shift, 1, group, pad_value=IGNORE).contiguous(),
            num_items_in_batch=items,
        ).loss
        loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    worst, missing = 0.0, []
    for name, p in model.named_parameters():
        if p.grad is None:
            missing.append(name)
            continue
        summed = p.grad.clone()
        dist.all_reduce(summed, group=group)
        want = ref_grads[name]
        tol = 1e-5 * want.abs().max() + 1e-7  # relative to the tensor's largest gradient, floor for zeros
        worst = max(worst, float((summed - want).abs().max() / tol))
    patches = sum(inputs[k].shape[0] for k in ("pixel_values", "pixel_values_videos") if k in inputs)
    return {
        "loss": float(total),
        "ref_loss": float(ref),
        "worst_grad": worst,
        "missing": missing,
        "patches": patches,
        "full_len": inputs["input_ids"].shape[1],
        "local_visual": int(((local_ids == IMAGE) | (local_ids == VIDEO)).sum()),
    }


@pytest.mark.parametrize(
    "family, precomputed, world, case",
    [
        ("qwen2_vl", False, 2, "images_and_videos"),
        ("qwen2_5_vl", True, 2, "images"),
        ("qwen2_5_vl", False, 2, "images_and_videos"),
        ("qwen2_5_vl", True, 4, "images_and_videos"),
    ],
    ids=lambda v: (
        {True: "collator-windows", False: "tower-windows"}.get(v, str(v)) if isinstance(v, bool) else None
    ),
)
def test_sp_loss_and_grads_equal_single_process(dist_pools, family, precomputed, world, case):
    results = dist_pools.get(world).run(_sp_case, family, case, precomputed)
    for r in results:
        assert r["patches"] % (world * 4) and r["full_len"] % world  # the uneven case is what runs
        assert not r["missing"], r["missing"]
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5)
        assert r["worst_grad"] <= 1.0, r["worst_grad"]
    assert sum(r["local_visual"] for r in results) > 0


def _missing_positions(ctx, family: str) -> str:
    state = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type)
    register_hf_attention()
    model = FAMILIES[family][2](tiny_config(family))
    model.set_attn_implementation("veomni_sdpa")
    inputs, _, _ = _inputs(model, "images")
    inputs["input_ids"] = slice_sequence(inputs["input_ids"], 1, state.sp_group)
    with use_parallel_state(state), pytest.raises(ValueError) as err:
        model(**inputs)
    return str(err.value)


@pytest.mark.parametrize("family", FAMILIES)
def test_sp_without_position_ids_is_refused_naming_the_model(dist_pools, family):
    for message in dist_pools.get(2).run(_missing_positions, family):
        assert f"{family} under sequence parallelism (sp=2) needs position_ids" in message, message
