"""Qwen3-VL through veomni's build path: checkpoints in and out, FSDP2 with images on one rank only (Ulysses SP:
test_qwen3_vl_sp.py).

Checkpoints are written by plain transformers ``save_pretrained`` and read back by ``from_pretrained`` (the oracle).
The dummy-forward test runs FSDP2 on 2 gloo ranks where rank 1's micro-batch has no image: without the tower's
dummy forward, rank 0's all-gathers of the vision blocks would have no partner and the step would hang.
"""

from __future__ import annotations

import pytest
import torch
from loading_fixtures import checkpoint_tensors, eager_ops, state
from test_qwen3_vl import IMAGES, TEXT_ONLY, tiny_config, vlm_batch
from torch.distributed.tensor import DTensor
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLForConditionalGeneration as Upstream

from veomni.core.parallel_state import use_parallel_state
from veomni.models.build import build_model
from veomni.models.export.hf import export_hf
from veomni.models.qwen3_vl.generated import patched_modeling_qwen3_vl as ours

TASK = "image_text_to_text"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qwen3_vl")
    torch.manual_seed(3)
    Upstream(tiny_config()).save_pretrained(path)
    return str(path)


def test_checkpoint_loads_like_transformers_and_exports_back(checkpoint, tmp_path):
    model = build_model(checkpoint, weights=checkpoint, ops=eager_ops(), task=TASK)
    assert type(model) is ours.Qwen3VLForConditionalGeneration
    ref = Upstream.from_pretrained(checkpoint)
    got, want = model.state_dict(), ref.state_dict()
    assert sorted(got) == sorted(want)
    assert not [k for k in want if not torch.equal(got[k], want[k])]

    export_hf(model, tmp_path / "out")
    saved, exported = checkpoint_tensors(checkpoint), checkpoint_tensors(str(tmp_path / "out"))
    assert sorted(exported) == sorted(saved)  # exactly save_pretrained's keys
    assert all(torch.equal(exported[k], saved[k]) for k in saved)
    back = Upstream.from_pretrained(tmp_path / "out").state_dict()
    assert all(torch.equal(back[k], want[k]) for k in want)


def _rank_batch(rank: int) -> dict[str, torch.Tensor]:
    # Rank 0: two rows with three images; rank 1: text only (no pixel_values at all).
    return vlm_batch(IMAGES if rank == 0 else TEXT_ONLY, seed=11 + rank)


def _fsdp_step(ctx, path: str) -> dict:
    pstate = state(ctx)
    model = build_model(path, weights=path, ops=eager_ops(), parallel_state=pstate, task=TASK)
    batch = {k: v.to(ctx.device) for k, v in _rank_batch(ctx.rank).items()}
    with use_parallel_state(pstate):
        loss = model(**batch).loss
        loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad
        assert grad is not None, name  # the dummy forward reached the tower on the imageless rank
        grads[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).cpu()
    return {"loss": float(loss.detach()), "grads": grads, "sharded": isinstance(p, DTensor)}


def test_fsdp2_with_images_on_one_rank_matches_single_process(dist_pools, checkpoint):
    results = dist_pools.get(2).run(_fsdp_step, checkpoint)
    ref = Upstream.from_pretrained(checkpoint)
    losses = [ref(**_rank_batch(rank)).loss for rank in (0, 1)]
    expected = [float(loss.detach()) for loss in losses]
    # FSDP2 averages gradients over the ranks: the reference objective is the mean of the per-rank losses.
    (sum(losses) / 2).backward()
    for rank, result in enumerate(results):
        assert result["sharded"]
        assert result["loss"] == pytest.approx(expected[rank], rel=1e-5)
    grads = results[0]["grads"]
    for name, p in ref.named_parameters():
        got = grads[name]
        assert torch.isfinite(got).all(), name
        want = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    # Rank 1 saw no image, yet its tower gradients are the same averaged ones (a real reduce-scatter ran).
    for name in grads:
        assert torch.equal(results[1]["grads"][name], grads[name]), name
