"""Ulysses SP of the Qwen2.5-Omni audio tower on real gloo process groups: SP2 equals one process.

Each rank runs the encoder layers on its slice of the post-conv frames (17 frames here: odd, so the slices carry
padding) and gathers them before pooling; the output is the full clip features on every rank, and the parameter
gradients summed over the SP group (what FSDP's reduce-scatter over the SP ranks does) equal one process's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_qwen2_5_omni import MELS, tiny_config

from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import build_parallel_state, use_parallel_state
from veomni.models.hf.attention import register_hf_attention
from veomni.models.qwen2_5_omni.generated import patched_modeling_qwen2_5_omni as ours

FRAMES = (20, 13)  # chunks of 8 frames: 8+8+4 and 8+5 -> 4+4+2+4+3 = 17 frames after the stride-2 conv


def _tower_case(ctx, attn: str) -> dict:
    register_hf_attention()
    state = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type)
    torch.manual_seed(0)
    tower = ours.Qwen2_5OmniAudioEncoder(tiny_config().audio_config)
    tower.set_attn_implementation(attn)
    gen = torch.Generator().manual_seed(1)
    features = torch.randn(MELS, sum(FRAMES), generator=gen)
    lens = torch.tensor(FRAMES)
    weight = torch.randn(8, 64, generator=gen)  # 5 + 3 pooled tokens of width output_dim

    ref = tower(features, feature_lens=lens).last_hidden_state
    (ref * weight).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in tower.named_parameters() if p.grad is not None}
    tower.zero_grad(set_to_none=True)

    with use_parallel_state(state):
        out = tower(features, feature_lens=lens).last_hidden_state
        # Every rank holds the full output; each backpropagates 1/P of the objective, as SP's loss split does.
        ((out * weight).sum() / ctx.world_size).backward()
    worst = 0.0
    for name, want in ref_grads.items():
        summed = dict(tower.named_parameters())[name].grad.clone()
        dist.all_reduce(summed, group=state.sp_group)
        worst = max(worst, float((summed - want).abs().max() / (1e-5 * want.abs().max() + 1e-7)))
    return {"max_out_diff": float((out - ref).abs().max()), "worst_grad": worst, "shape": tuple(out.shape)}


def test_audio_tower_sp2_equals_one_process(dist_pools):
    for attn in ("veomni_sdpa", "eager"):  # eager: HF names also take the encoder entry under SP
        for result in dist_pools.get(2).run(_tower_case, attn):
            assert result["shape"] == (8, 64)
            assert result["max_out_diff"] < 1e-5, (attn, result)
            assert result["worst_grad"] <= 1.0, (attn, result)


def _thinker_case(ctx) -> dict:
    from test_qwen2_5_omni import MIXED, omni_batch

    from veomni.core.sp import slice_sequence

    register_hf_attention()
    state = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type)
    group = state.sp_group
    torch.manual_seed(0)
    model = ours.Qwen2_5OmniThinkerForConditionalGeneration(tiny_config())
    model.set_attn_implementation("veomni_sdpa")
    batch = omni_batch(MIXED, seed=9)
    labels = batch.pop("labels")
    batch.pop("attention_mask")  # packed-style input: positions given, no padding mask
    position_ids, _ = model.model.get_rope_index(
        batch["input_ids"], batch["image_grid_thw"], None, torch.ones_like(batch["input_ids"]), False,
        batch["feature_attention_mask"].sum(-1), None,
    )  # fmt: skip
    shift = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
    items = int((shift != -100).sum())

    ref = model(**batch, position_ids=position_ids, shift_labels=shift, num_items_in_batch=items).loss
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    with use_parallel_state(state):
        loss = model(
            **{**batch, "input_ids": slice_sequence(batch["input_ids"], 1, group)},
            position_ids=slice_sequence(position_ids, 2, group),
            shift_labels=slice_sequence(shift, 1, group, pad_value=-100).contiguous(),
            num_items_in_batch=items,
        ).loss
        loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    worst, missing = 0.0, []
    for name, want in ref_grads.items():
        grad = dict(model.named_parameters())[name].grad
        if grad is None:
            missing.append(name)
            continue
        summed = grad.clone()
        dist.all_reduce(summed, group=group)
        worst = max(worst, float((summed - want).abs().max() / (1e-5 * want.abs().max() + 1e-7)))
    return {"loss": float(total), "ref_loss": float(ref), "worst_grad": worst, "missing": missing}


def test_thinker_sp2_equals_one_process_on_a_mixed_batch(dist_pools):
    """Audio, images and text over 3 rows (lengths not divisible by 2): the LM runs on each rank's slice, the
    audio tower on its frame slice, and loss (summed over ranks) and gradients (summed) equal one process."""
    for result in dist_pools.get(2).run(_thinker_case):
        assert result["loss"] == pytest.approx(result["ref_loss"], rel=1e-5)
        assert not result["missing"]
        assert result["worst_grad"] <= 1.0, result


def _hf_attention_case(ctx) -> str:
    from test_qwen2_5_omni import MIXED, omni_batch

    from veomni.core.sp import slice_sequence

    state = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type)
    torch.manual_seed(0)
    model = ours.Qwen2_5OmniThinkerForConditionalGeneration(tiny_config())
    model.set_attn_implementation("sdpa")  # HF's own: it attends over this rank's slice only, no all-to-all
    batch = omni_batch(MIXED, seed=9)
    batch.pop("labels"), batch.pop("attention_mask")
    position_ids, _ = model.model.get_rope_index(
        batch["input_ids"], batch["image_grid_thw"], None, torch.ones_like(batch["input_ids"]), False,
        batch["feature_attention_mask"].sum(-1), None,
    )  # fmt: skip
    with use_parallel_state(state):
        try:
            model(
                **{**batch, "input_ids": slice_sequence(batch["input_ids"], 1, state.sp_group)},
                position_ids=slice_sequence(position_ids, 2, state.sp_group),
            )
        except ValueError as err:
            return str(err)
    return "no error"


def test_thinker_under_sp_refuses_hf_attention_in_the_language_model(dist_pools):
    """HF's attention functions know nothing of the SP group: each rank would attend over its own slice of the
    sequence only (a silently wrong loss); the thinker refuses them like the other SP-capable VLM adapters."""
    for message in dist_pools.get(2).run(_hf_attention_case):
        assert "veomni attention implementation" in message, message
