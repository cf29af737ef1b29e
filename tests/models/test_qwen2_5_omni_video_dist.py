"""Qwen2.5-Omni thinker under FSDP2 over 2 gloo ranks, one rank with an audio-in-video row (both towers on real
inputs) and one with audio only (the vision tower's dummy forward), against one process of upstream transformers
on the mean of the two losses."""

from __future__ import annotations

import pytest
import torch
from loading_fixtures import eager_ops, state
from models.test_qwen2_5_omni_video import host_positions, video_batch
from test_qwen2_5_omni_dist import omni_checkpoint  # noqa: F401  (fixture)
from torch.distributed.tensor import DTensor
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniThinkerForConditionalGeneration as Upstream,
)

from veomni.core.parallel_state import use_parallel_state
from veomni.models.build import build_model


def _rank_batch(rank: int) -> dict:
    # Rank 0: an audio-in-video row (vision and audio towers on real inputs); rank 1: audio only (no pixels).
    items, flag = ([("video", (2, 2, 4), 1.0, 60)], True) if rank == 0 else ([("audio", 20)], False)
    return video_batch(items, flag, seed=31 + rank)


def _fsdp_step(ctx, path: str) -> dict:
    pstate = state(ctx)
    model = build_model(path, weights=path, ops=eager_ops(), parallel_state=pstate, task="any_to_any")
    batch = _rank_batch(ctx.rank)
    positions = torch.as_tensor(host_positions(batch))[:, None]
    with use_parallel_state(pstate):
        loss = model(**{**batch, "attention_mask": None}, position_ids=positions).loss
        loss.backward()
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).cpu()
             for n, p in model.named_parameters() if p.grad is not None}  # fmt: skip
    return {"loss": float(loss.detach()), "grads": grads}


def test_fsdp2_with_a_video_on_one_rank_only_matches_one_process(dist_pools, omni_checkpoint):  # noqa: F811
    results = dist_pools.get(2).run(_fsdp_step, omni_checkpoint)
    ref = Upstream.from_pretrained(omni_checkpoint)
    losses = [ref(**_rank_batch(rank)).loss for rank in (0, 1)]
    (sum(losses) / 2).backward()  # FSDP2 averages gradients over the ranks
    for rank, result in enumerate(results):
        assert result["loss"] == pytest.approx(float(losses[rank].detach()), rel=1e-5)
    for key, p in ref.named_parameters():
        if p.grad is None:
            assert key == "model.audio_tower.audio_bos_eos_token.weight", key
            continue
        torch.testing.assert_close(results[0]["grads"][key], p.grad, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=key: f"{n}: {m}")  # fmt: skip
    assert results[0]["grads"]["model.visual.patch_embed.proj.weight"].abs().sum() > 0
