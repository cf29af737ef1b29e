"""An encoder tower attends through `encoder_attention` with its own packing; the LM's packing never reaches it.

A tiny Qwen3-VL (2 ViT blocks, 2 text layers, built from a config) runs with ``veomni_sdpa`` everywhere. Its
vision attention is routed to `encoder_attention` the way a model adapter does it (`packed_vision_attention`
below replaces HF's flash / per-image branches; everything else is HF's code). The outer forward gets the
language model's packing kwargs and our own ``sp_unpadded_len``; HF passes its ``**kwargs`` down to the vision
blocks, and the test records what arrives there and what reaches the attention. The oracle is the same weights
with HF's ``sdpa`` / ``eager`` (its per-image loop over the tower).
"""

from __future__ import annotations

import types

import pytest
import torch
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb_vision

from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import build_parallel_state, use_parallel_state
from veomni.core.sp import gather_sequence, pad_to_multiple, slice_sequence
from veomni.models.hf.attention import packed_kwargs, register_hf_attention
from veomni.models.hf.encoder_attention import backend_for_implementation, encoder_attention

IMAGE, START, END = 100, 102, 103
LM_PACKING = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids")
FP32 = {"rtol": 1e-5, "atol": 1e-5}


def build_vlm(attn: str, seed: int = 0) -> Qwen3VLForConditionalGeneration:
    register_hf_attention()
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": 128,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 256,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [4, 2, 2],
                "mrope_interleaved": True,
            },
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 4,
            "patch_size": 2,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
            "out_hidden_size": 64,
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0],
        },
        image_token_id=IMAGE,
        video_token_id=101,
        vision_start_token_id=START,
        vision_end_token_id=END,
    )
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config)
    model.set_attn_implementation(attn)
    return model


def packed_vision_attention(
    self,
    hidden_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_seqlen: int | None = None,
    **kwargs,
) -> torch.Tensor:
    """Qwen3-VL vision attention routed to `encoder_attention` (what a model adapter generates)."""
    self.seen.append({"cu_seqlens": cu_seqlens.tolist(), "max_seqlen": max_seqlen, "kwargs": sorted(kwargs)})
    seq = hidden_states.shape[0]
    q, k, v = self.qkv(hidden_states).reshape(seq, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    q, k = apply_rotary_pos_emb_vision(q, k, *position_embeddings)
    out = encoder_attention(self, q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, scaling=self.scaling)
    return self.proj(out.reshape(seq, -1))


def adapt_tower(model: Qwen3VLForConditionalGeneration) -> list:
    attentions = [block.attn for block in model.model.visual.blocks]
    for attn in attentions:
        attn.seen = []
        attn.forward = types.MethodType(packed_vision_attention, attn)
    return attentions


def vlm_batch(grids: list[tuple[int, int, int]], seed: int = 0) -> dict[str, torch.Tensor]:
    """One row with an image placeholder run per grid, text between them; pixels ``[patches, 24]``."""
    gen = torch.Generator().manual_seed(seed)
    grid = torch.tensor(grids)
    ids: list[int] = []
    for t, h, w in grids:
        ids += torch.randint(0, 90, (2,), generator=gen).tolist()
        ids += [START] + [IMAGE] * (t * h * w // 4) + [END]
    ids += torch.randint(0, 90, (3,), generator=gen).tolist()
    input_ids = torch.tensor([ids])
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 2 * 2, generator=gen)
    return {
        "input_ids": input_ids,
        "pixel_values": pixels,
        "image_grid_thw": grid,
        "mm_token_type_ids": (input_ids == IMAGE).long(),
    }


def grid_cu(grids: list[tuple[int, int, int]]) -> list[int]:
    cu = [0]
    for t, h, w in grids:
        for _ in range(t):
            cu.append(cu[-1] + h * w)
    return cu


GRIDS = [(1, 4, 4), (2, 2, 6), (1, 2, 2)]


@pytest.mark.parametrize("reference", ["sdpa", "eager"])
def test_tower_sees_only_its_own_metadata_and_matches_per_image_reference(reference):
    batch = vlm_batch(GRIDS)
    length = batch["input_ids"].shape[1]
    # Two documents for the language model: nothing of this may reach the tower.
    lm_packing = packed_kwargs(torch.cat([torch.arange(5), torch.arange(length - 5)]))

    ref_model = build_vlm(reference)
    ref_image = ref_model.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"])
    ref_logits = ref_model(**batch).logits
    ref_logits.sum().backward()
    ref_grads = {n: p.grad for n, p in ref_model.model.visual.named_parameters()}

    model = build_vlm("veomni_sdpa")
    attentions = adapt_tower(model)
    image = model.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"])
    for got, want in zip(image.pooler_output, ref_image.pooler_output, strict=True):
        torch.testing.assert_close(got, want, **FP32)
    for attn in attentions:
        attn.seen.clear()

    out = model(**batch, **lm_packing, sp_unpadded_len=length)
    cu = grid_cu(GRIDS)
    for attn in attentions:
        (seen,) = attn.seen
        assert seen["cu_seqlens"] == cu  # the tower's own frames, not the LM's [0, 5, L]
        leaked = set(seen["kwargs"])
        # HF strips its flash kwargs before get_image_features; our own kwarg arrives at the module, and
        # encoder_attention (no **kwargs) keeps it away from the attention.
        assert not leaked & set(LM_PACKING), leaked
        assert "sp_unpadded_len" in leaked

    # The LM ran two documents, so compare logits with the reference on a one-document packing instead.
    one_doc = model(**batch, **packed_kwargs(torch.arange(length))).logits
    torch.testing.assert_close(one_doc, ref_logits, **FP32)
    assert not torch.allclose(out.logits, ref_logits, **FP32)  # the LM did read its two-document packing
    one_doc.sum().backward()
    for name, p in model.model.visual.named_parameters():
        torch.testing.assert_close(
            p.grad, ref_grads[name], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_backend_follows_the_tower_config():
    assert backend_for_implementation("veomni_sdpa") == "sdpa"
    assert backend_for_implementation("veomni_fa3") == "flash_attn_3"
    assert backend_for_implementation("eager") == "eager"
    assert backend_for_implementation("flash_attention_2") == "flash_attn_2"
    with pytest.raises(ValueError, match="'paged|eager' has no veomni attention kernel; expected one of"):
        backend_for_implementation("paged|eager")
    with pytest.raises(ValueError, match="None has no veomni attention kernel"):
        backend_for_implementation(None)


def test_encoder_attention_refuses_dropout():
    model = build_vlm("veomni_sdpa")
    attn = model.model.visual.blocks[0].attn
    q = torch.randn(6, 4, 8)
    with pytest.raises(ValueError, match="no attention dropout"):
        encoder_attention(attn, q, q, q, cu_seqlens=torch.tensor([0, 6]), dropout=0.1)


# ---------------------------------------------------------------- under SP, on real gloo ranks


def _tower_under_sp(ctx) -> None:
    state = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type)
    group = state.sp_group
    batch = vlm_batch(GRIDS, seed=3)
    model = build_vlm("veomni_sdpa", seed=1)
    adapt_tower(model)
    ref = model.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"]).pooler_output
    # The full (un-sliced) tower on every SP rank: no collective may run, whatever the current state says.
    with use_parallel_state(state):
        got = model.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"]).pooler_output
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, **FP32)

    # A tower that slices its own packed sequence: encoder_attention with the group and the full cu_seqlens.
    attn = model.model.visual.blocks[0].attn
    gen = torch.Generator().manual_seed(5)
    cu = torch.tensor(grid_cu(GRIDS), dtype=torch.int32)
    total = int(cu[-1])
    q, k, v = (
        torch.randn(total, 4, 8, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(3)
    )
    probe = torch.randn(total, 4, 8, generator=gen, dtype=torch.float64)
    full = encoder_attention(attn, q, k, v, cu_seqlens=cu, scaling=0.3)
    (full * probe).sum().backward()
    ref_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    local = [slice_sequence(pad_to_multiple(t, 0, ctx.world_size), 0, group) for t in (q, k, v)]
    out = encoder_attention(attn, *local, cu_seqlens=cu, scaling=0.3, sp_group=group, sp_unpadded_len=total)
    gathered = gather_sequence(out.detach(), group, dim=0, equal_sizes=True)[:total]
    torch.testing.assert_close(gathered, full.detach(), rtol=1e-9, atol=1e-10)
    (out * slice_sequence(pad_to_multiple(probe, 0, ctx.world_size), 0, group)).sum().backward()
    for t, want in zip((q, k, v), ref_grads, strict=True):
        summed = t.grad.clone()
        torch.distributed.all_reduce(summed, group=group)
        torch.testing.assert_close(summed, want, rtol=1e-9, atol=1e-10)


def test_tower_under_sp2(dist_pools):
    dist_pools.get(2).run(_tower_under_sp)
