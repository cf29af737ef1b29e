"""Ulysses SP for diffusers' WanTransformer3DModel (veomni.models.wan.sp) on real gloo ranks.

Oracle: the same weights run unsplit by diffusers' own processors on each rank. Every SP rank is fed the same
full inputs; the loss is computed on the gathered output; each rank's parameter gradients averaged over the
SP group (what FSDP2's world-averaged reduction does) must equal the unsplit gradients, and the output must
equal the unsplit output (fp32, tight). Latents of 3x6x10 with patch (1, 2, 2) give 45 tokens: not divisible
by 2 or 4, so the last ranks carry padding.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from dist_harness import backend_params

from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import build_parallel_state
from veomni.models.build import build_model
from veomni.models.wan.sp import WAN_TEXT_CONTEXT_LEN, WanUlyssesAttnProcessor, apply_dit_sp

# The diffusers extra is optional: without it these tests skip rather than fail to collect.
WanTransformer3DModel = pytest.importorskip("diffusers").WanTransformer3DModel

T2V = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=4,
    attention_head_dim=12,
    in_channels=4,
    out_channels=4,
    text_dim=16,
    freq_dim=32,
    ffn_dim=32,
    num_layers=2,
    rope_max_seq_len=32,
)
I2V = dict(T2V, image_dim=8, added_kv_proj_dim=48)
RTOL, ATOL = 1e-5, 1e-6


def _inputs(i2v: bool) -> dict[str, torch.Tensor]:
    """Latents [2, 4, 3, 6, 10] (45 tokens), timesteps [2], text [2, L, 16] (L = 512 for I2V, as Wan's
    processor requires), I2V image embeds [2, 3, 8]; fp32."""
    g = torch.Generator().manual_seed(3)
    text_len = WAN_TEXT_CONTEXT_LEN if i2v else 7
    out = {
        "hidden_states": torch.randn(2, 4, 3, 6, 10, generator=g),
        "timestep": torch.tensor([500, 20]),
        "encoder_hidden_states": torch.randn(2, text_len, 16, generator=g),
    }
    if i2v:
        out["encoder_hidden_states_image"] = torch.randn(2, 3, 8, generator=g)
    return out


def _loss(sample: torch.Tensor) -> torch.Tensor:
    target = torch.randn(sample.shape, generator=torch.Generator().manual_seed(5))
    return (sample - target).pow(2).mean()


def _run(model: torch.nn.Module, inputs: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    sample = model(**inputs).sample
    _loss(sample).backward()
    return sample.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _sp_vs_unsplit(ctx, kwargs: dict, i2v: bool, checkpointing: bool = False) -> dict:
    state = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type)
    torch.manual_seed(0)
    ref = WanTransformer3DModel(**kwargs)
    ours = apply_dit_sp(copy.deepcopy(ref), state)
    if checkpointing:
        # diffusers' own per-block checkpointing: the first block's slicing hook then runs inside the
        # checkpoint (and again at recompute); the gather before norm_out stays outside.
        ours.enable_gradient_checkpointing()
    inputs = _inputs(i2v)
    ref_sample, ref_grads = _run(ref, inputs)
    sample, grads = _run(ours, inputs)
    for grad in grads.values():
        dist.all_reduce(grad, group=state.sp_group)
        grad /= ctx.world_size
    procs = {type(m.processor) for m in ours.modules() if hasattr(m, "processor")}
    return {
        "sample": sample,
        "ref_sample": ref_sample,
        "grads": grads,
        "ref_grads": ref_grads,
        "procs": procs,
    }


def _check(results: list[dict]) -> None:
    for r in results:
        assert r["procs"] == {WanUlyssesAttnProcessor}
        torch.testing.assert_close(r["sample"], r["ref_sample"], rtol=RTOL, atol=ATOL)
        assert r["grads"].keys() == r["ref_grads"].keys()
        for name, grad in r["ref_grads"].items():
            assert grad.abs().sum() > 0, name  # every parameter takes part, so the comparison can fail
            torch.testing.assert_close(r["grads"][name], grad, rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("world_size, backend", backend_params(2, 4)[:2])
def test_t2v_sp_matches_unsplit(dist_pools, world_size, backend):
    _check(dist_pools.get(world_size, backend).run(_sp_vs_unsplit, T2V, False))


@pytest.mark.parametrize("world_size, backend", backend_params(2)[:1])
def test_t2v_sp_with_gradient_checkpointing_matches_unsplit(dist_pools, world_size, backend):
    _check(dist_pools.get(world_size, backend).run(_sp_vs_unsplit, T2V, False, True))


@pytest.mark.parametrize("world_size, backend", backend_params(2)[:1])
def test_i2v_sp_matches_unsplit(dist_pools, world_size, backend):
    _check(dist_pools.get(world_size, backend).run(_sp_vs_unsplit, I2V, True))


@pytest.fixture(scope="module")
def wan(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("wan_sp_src")
    torch.manual_seed(11)
    WanTransformer3DModel(**T2V).save_pretrained(str(root))
    return str(root)


def _build_sp_vs_unsplit(ctx, src: str) -> dict:
    state = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type)
    model = build_model(src, weights=src, parallel_state=state)
    sample, grads = _run(model, _inputs(False))
    ref = WanTransformer3DModel.from_pretrained(src)
    ref_sample, ref_grads = _run(ref, _inputs(False))
    # FSDP2 already averaged the gradients over the world (= the SP group here): no manual reduction.
    full = {n: g.full_tensor() if hasattr(g, "full_tensor") else g for n, g in grads.items()}
    procs = {type(m.processor) for m in model.modules() if hasattr(m, "processor")}
    return {"sample": sample, "ref_sample": ref_sample, "grads": full, "ref_grads": ref_grads, "procs": procs}


def _refuse_heads(ctx, src: str) -> str:
    state = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type)
    with pytest.raises(ValueError, match=r"query heads divisible by the SP size: H_q=3, P=2"):
        build_model(src, weights=src, parallel_state=state)
    return "ok"


@pytest.mark.parametrize("world_size, backend", backend_params(2)[:1])
def test_build_model_fsdp2_sp_matches_unsplit(dist_pools, wan, world_size, backend):
    _check(dist_pools.get(world_size, backend).run(_build_sp_vs_unsplit, wan))


@pytest.mark.parametrize("world_size, backend", backend_params(2)[:1])
def test_build_model_sp_refuses_heads_not_divisible(dist_pools, tmp_path, world_size, backend):
    torch.manual_seed(1)
    WanTransformer3DModel(**dict(T2V, num_attention_heads=3)).save_pretrained(str(tmp_path))
    assert dist_pools.get(world_size, backend).run(_refuse_heads, str(tmp_path)) == ["ok", "ok"]
