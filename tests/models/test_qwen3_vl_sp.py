"""Qwen3-VL under Ulysses sequence parallelism (ViT + LLM) on real gloo ranks, against the same model unsliced.

Oracle: the single-process forward (no parallel state) of the same weights on the full batch, with the same
explicit mrope ``position_ids`` and pre-shifted labels. Each SP rank feeds its slice of ``input_ids`` /
``position_ids`` / labels (`veomni.core.sp.slice_sequence`, padding the tail) and the full pixel rows; the
objective is the sum over ranks of the per-rank losses (each normalised by the global label count), so the summed
loss and the all-reduced gradients must equal the single-process ones (fp32, tight).

Batches are chosen so that neither the sequence length nor the patch count is divisible by the SP size (nor by
``sp * merge**2``), and one case puts every placeholder in the first rank's slice.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from test_qwen3_vl import IMAGE, MIXED, VIDEO, tiny_config, vlm_batch

from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import build_parallel_state, use_parallel_state
from veomni.core.sp import slice_sequence
from veomni.models.hf.attention import register_hf_attention
from veomni.models.qwen3_vl.generated import patched_modeling_qwen3_vl as ours

IGNORE = -100
# Patch counts 28 / 44 and sequence lengths 23 / 31 / 27: none divisible by 2, 4, 8 or 16.
CASES = {
    "two_images_one_row": ([[("image", (1, 4, 4)), ("image", (1, 2, 6))]], 23),
    "images_and_videos_two_rows": (MIXED, 31),
    "image_in_first_slice_only": ([[("image", (1, 2, 2))]], 27),
}


def _model(attn: str = "veomni_sdpa") -> ours.Qwen3VLForConditionalGeneration:
    register_hf_attention()
    torch.manual_seed(0)
    model = ours.Qwen3VLForConditionalGeneration(tiny_config())
    model.set_attn_implementation(attn)
    return model


def _inputs(model, case: str, rows: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Full-sequence model inputs (minus position ids and labels), mrope ids ``[rows, B, S]`` and shifted labels."""
    items, length = CASES[case]
    batch = vlm_batch(items, seed=5, length=length)
    position_ids, _ = model.model.get_rope_index(
        batch["input_ids"],
        image_grid_thw=batch.get("image_grid_thw"),
        video_grid_thw=batch.get("video_grid_thw"),
        mm_token_type_ids=batch["mm_token_type_ids"],
    )
    if rows == 4:  # transformers' [text; t; h; w] layout: the text row is the plain running index
        text = torch.arange(length).expand(1, position_ids.shape[1], -1)
        position_ids = torch.cat([text, position_ids], dim=0)
    labels = batch["labels"]
    shift = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], dim=1)
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "mm_token_type_ids")}
    return inputs, position_ids, shift


def _sp_case(ctx, case: str, rows: int, factory: Callable[[], torch.nn.Module] | None = None) -> dict:
    """``factory``: a module-level function building another Qwen3-VL-family model (test_qwen3_5_vl_sp.py)."""
    state = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type)
    group = state.sp_group
    model = _model() if factory is None else factory()
    inputs, position_ids, shift = _inputs(model, case, rows)
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
            # contiguous, as the collator hands them over (HF's loss views the labels flat)
            shift_labels=slice_sequence(shift, 1, group, pad_value=IGNORE).contiguous(),
            num_items_in_batch=items,
        ).loss
        loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    worst, norm, ref_norm, missing = 0.0, 0.0, 0.0, []
    for name, p in model.named_parameters():
        if p.grad is None:
            missing.append(name)
            continue
        summed = p.grad.clone()
        dist.all_reduce(summed, group=group)
        want = ref_grads[name]
        # In units of the tolerance: relative to the tensor's largest gradient, with a floor for exact zeros.
        tol = 1e-5 * want.abs().max() + 1e-7
        worst = max(worst, float((summed - want).abs().max() / tol))
        norm += float(summed.pow(2).sum())
        ref_norm += float(want.pow(2).sum())
    local_visual = int(((local_ids == IMAGE) | (local_ids == VIDEO)).sum())
    return {
        "loss": float(total),
        "ref_loss": float(ref),
        "grad_norm": norm**0.5,
        "ref_grad_norm": ref_norm**0.5,
        "worst_grad": worst,
        "missing": missing,
        "local_visual": local_visual,
        "patches": inputs.get("pixel_values", torch.empty(0)).shape[0]
        + inputs.get("pixel_values_videos", torch.empty(0)).shape[0],
        "seq_len": local_ids.shape[1] * ctx.world_size,
        "full_len": inputs["input_ids"].shape[1],
    }


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(
    "case, rows",
    [("two_images_one_row", 3), ("images_and_videos_two_rows", 4), ("image_in_first_slice_only", 3)],
)
def test_sp_loss_and_grads_equal_single_process(dist_pools, world, case, rows):
    results = dist_pools.get(world).run(_sp_case, case, rows)
    for r in results:
        assert r["patches"] % (world * 4) and r["full_len"] % world  # the uneven case is what runs
        assert not r["missing"], r["missing"]  # every parameter, the vision tower's included, got a gradient
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5)
        assert r["grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=1e-5)
        assert r["worst_grad"] <= 1.0, r["worst_grad"]
    if case == "image_in_first_slice_only":
        assert [r["local_visual"] > 0 for r in results] == [True] + [False] * (world - 1)


def _sp_error(ctx, what: str) -> str:
    state = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type)
    model = _model("sdpa" if what == "hf_attention" else "veomni_sdpa")
    inputs, position_ids, _ = _inputs(model, "two_images_one_row", 3)
    inputs["input_ids"] = slice_sequence(inputs["input_ids"], 1, state.sp_group)
    local_positions = slice_sequence(position_ids, 2, state.sp_group)
    given = {"missing_positions": None, "full_positions": position_ids}.get(what, local_positions)
    with use_parallel_state(state), pytest.raises(ValueError) as err:
        model(**inputs, position_ids=given)
    return str(err.value)


@pytest.mark.parametrize(
    "what, expected",
    [
        ("missing_positions", "needs position_ids"),
        ("full_positions", "expects position_ids of shape [3 or 4, 1, 12]"),
        ("hf_attention", "needs a veomni attention implementation in the language model"),
    ],
)
def test_sp_refuses_inputs_it_cannot_run(dist_pools, what, expected):
    for message in dist_pools.get(2).run(_sp_error, what):
        assert expected in message and "sp=2" in message, message
