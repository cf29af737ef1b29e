"""veomni's kernels bound to diffusers' WanTransformer3DModel (veomni.models.wan.kernels), fp32 on CPU.

Oracle: diffusers' own ``WanAttnProcessor`` and modules on the same weights. Each op is swapped in alone (the
others stay diffusers') and must give diffusers' attention output and input/parameter gradients; then all
together through ``build_model(ops=...)`` for T2V and I2V (outputs and every parameter gradient), the state dict
and the diffusers export unchanged, per-block compile equal to eager (``aot_eager``: the captured graphs op for
op) under activation checkpointing, and ``keep_attention`` checkpointing. Triton kernels run through Triton's
interpreter on CPU (tests/conftest.py), so shapes are tiny.
"""

from __future__ import annotations

import copy

import pytest
import torch
from dist_harness import backend_params
from loading_fixtures import gather_state_dict
from torch.distributed.tensor import DTensor

from veomni.core.checkpointing import COMPILED_MARK, apply_activation_checkpointing
from veomni.core.compile import compile_blocks, compile_stats
from veomni.core.fsdp import FSDPPolicy, apply_fsdp2
from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import build_parallel_state
from veomni.kernels import KERNELS, OpsConfig, resolve_kernels
from veomni.kernels.hardware import Hardware
from veomni.kernels.registry import KernelRegistry
from veomni.kernels.rope.interleaved import apply_rope_interleaved_eager
from veomni.kernels.rope.interleaved_triton import apply_rope_interleaved_triton
from veomni.models.build import build_model
from veomni.models.diffusers.build import _bind_kernels, dit_ops
from veomni.models.diffusers.export import export_diffusers
from veomni.models.wan.kernels import DIFFUSERS_OPS, WanKernelAttnProcessor, WanOps, bind_wan_kernels, wan_ops
from veomni.models.wan.sp import WanUlyssesAttnProcessor, apply_dit_sp

diffusers = pytest.importorskip("diffusers")
WanTransformer3DModel = diffusers.WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanAttnProcessor  # noqa: E402

CPU = Hardware(device_type="cpu", triton_interpret=True)
# Triton kernels need CUDA, or Triton's interpreter on CPU tensors.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
T2V = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4, text_dim=16,
    freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=32,
)  # fmt: skip
I2V = dict(T2V, image_dim=8, added_kv_proj_dim=24)
TEXT_LEN = 512  # diffusers' Wan processor splits an I2V context as [image tokens; 512 text tokens]
ALL = dict(rms_norm="triton", rope="triton", attention="sdpa")
# 2e-5 of the largest |want|: at 1e-5 the I2V gradient of blocks.1.attn2.add_k_proj.bias (a sum over tokens with
# cancellation) missed by 4.19e-9 against 3.64e-9 on a 2-core Intel Xeon box (2026-12-02), at a commit that passed on
# the previous box: reduction order across CPUs, still ~170 fp32 ulps of the largest entry.
RTOL = 2e-5


def assert_close_scaled(got: torch.Tensor, want: torch.Tensor, name: str = "") -> None:
    """Equal to fp32 rounding relative to the tensor's own magnitude.

    A fixed absolute floor (1e-6) failed on another 2-core box at 1.21e-6 for gradients whose entries reach 1-12:
    the rounding error of a sum grows with the values summed, so the floor is RTOL times the largest |want|.
    """
    atol = RTOL * float(want.abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=RTOL, atol=atol, msg=lambda m: f"{name}: {m}" if name else m)


def ops(compile: str = "off", **fields: str) -> OpsConfig:
    return OpsConfig(**fields, compile=compile, hardware=CPU)


def inputs(i2v: bool = False) -> dict[str, torch.Tensor]:
    """Latents [2, 4, 2, 4, 6] (12 tokens), timesteps [2], text [2, L, 16]; I2V image embeds [2, 3, 8]."""
    g = torch.Generator().manual_seed(3)
    out = {
        "hidden_states": torch.randn(2, 4, 2, 4, 6, generator=g),
        "timestep": torch.tensor([500, 20]),
        "encoder_hidden_states": torch.randn(2, TEXT_LEN if i2v else 5, 16, generator=g),
    }
    if i2v:
        out["encoder_hidden_states_image"] = torch.randn(2, 3, 8, generator=g)
    return {k: v.to(DEVICE) for k, v in out.items()}


def loss_and_grads(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    sample = model(**batch).sample
    target = torch.randn(sample.shape, generator=torch.Generator().manual_seed(5)).to(sample.device)
    loss = (sample - target).pow(2).mean()
    loss.backward()
    return loss.detach(), sample.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(got: tuple, want: tuple) -> None:
    """(loss, output, {name: grad}) equal to fp32 rounding; every gradient nonzero, so the check can fail."""
    assert_close_scaled(got[0], want[0])
    assert_close_scaled(got[1], want[1])
    assert got[2].keys() == want[2].keys()
    for name, grad in want[2].items():
        assert grad.abs().sum() > 0, name  # every parameter takes part, so the comparison can fail
        assert_close_scaled(got[2][name], grad, name)


def _attention_case(self_attention: bool):
    """A diffusers WanAttention of the tiny model, its inputs (with grad) and Wan's real rotary tables."""
    torch.manual_seed(0)
    model = WanTransformer3DModel(**I2V).to(DEVICE)
    block = model.blocks[0]
    attn = block.attn1 if self_attention else block.attn2
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 12, 24, generator=g).to(DEVICE).requires_grad_(True)
    context = None if self_attention else torch.randn(2, 3 + TEXT_LEN, 24, generator=g).to(DEVICE)
    rotary = model.rope(inputs()["hidden_states"]) if self_attention else None
    return attn, x, context, rotary


def _attention_run(attn, processor, x, context, rotary):
    attn.set_processor(processor)
    attn.zero_grad(set_to_none=True)
    x.grad = None
    out = attn(x, context, None, rotary)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.device)
    (out * probe).sum().backward()
    grads = {n: p.grad.clone() for n, p in attn.named_parameters() if p.grad is not None}
    return out.detach(), x.grad.clone(), grads


_ALONE = [
    ("rms_norm", "triton"),
    ("rms_norm", "torch"),
    ("rope", "triton"),
    ("attention", "sdpa"),
    ("attention", "eager"),
]
# Cross-attention has no rotary embedding: rope is checked on self-attention only.
ALONE_CASES = [(f, b, True) for f, b in _ALONE] + [(f, b, False) for f, b in _ALONE if f != "rope"]


@pytest.mark.triton_cpu
@pytest.mark.parametrize(
    "field, backend, self_attention",
    ALONE_CASES,
    ids=[f"{'self' if a else 'cross_i2v'}-{f}-{b}" for f, b, a in ALONE_CASES],
)
def test_each_kernel_alone_matches_diffusers_attention(field, backend, self_attention):
    attn, x, context, rotary = _attention_case(self_attention)
    want = _attention_run(attn, WanAttnProcessor(), x, context, rotary)
    fields = dict(rms_norm="eager", rope="eager", attention="sdpa") | {field: backend}
    bound = wan_ops(resolve_kernels(ops(**fields)))
    assert bound.names[field] == backend
    got = _attention_run(attn, WanKernelAttnProcessor(bound), x, context, rotary)
    assert_close_scaled(got[0], want[0])
    assert_close_scaled(got[1], want[1])
    assert got[2].keys() == want[2].keys()
    for name, grad in want[2].items():
        assert_close_scaled(got[2][name], grad, name)


@pytest.mark.triton_cpu
@pytest.mark.parametrize("rope", [apply_rope_interleaved_eager, apply_rope_interleaved_triton])
def test_interleaved_rope_oracle_and_kernel_match_diffusers(rope):
    attn, x, context, rotary = _attention_case(True)
    want = _attention_run(attn, WanAttnProcessor(), x, context, rotary)
    processor = WanKernelAttnProcessor(WanOps(rope=rope))
    got = _attention_run(attn, processor, x, context, rotary)
    for a, b in zip(got[:2], want[:2], strict=True):
        assert_close_scaled(a, b)
    for name, grad in want[2].items():
        assert_close_scaled(got[2][name], grad, name)


@pytest.mark.triton_cpu
def test_interleaved_rope_in_bf16_rounds_like_diffusers():
    # diffusers rotates in float64 (the tables' dtype) and rounds once; we rotate in fp32 and round once, so the
    # results differ only where fp32 rounding moves a value across a bf16 rounding boundary (rare).
    _, x, _, (cos, sin) = _attention_case(True)
    q = x.detach().unflatten(2, (2, 12)).to(torch.bfloat16)
    ref = WanKernelAttnProcessor(DIFFUSERS_OPS)._rotate(q, q, (cos, sin))[0].float()
    eager, _ = apply_rope_interleaved_eager(q, q, cos, sin)
    assert eager.dtype == torch.bfloat16
    assert (eager.float() == ref).float().mean() > 0.99
    # Triton's CPU interpreter converts fp32 -> bf16 by its own rounding, not the GPU's round-to-nearest-even:
    # hold the kernel to one bf16 step here (the CUDA twin of the registry parity walk checks the GPU rounding).
    got, _ = apply_rope_interleaved_triton(q, q, cos, sin)
    assert ((got.float() - ref).abs() <= ref.abs() * 2**-7 + 1e-30).all()


@pytest.fixture(scope="module", params=[False, True], ids=["t2v", "i2v"])
def wan(request, tmp_path_factory) -> tuple[str, bool]:
    i2v = request.param
    root = tmp_path_factory.mktemp("wan_kernels_i2v" if i2v else "wan_kernels_t2v")
    torch.manual_seed(11)
    WanTransformer3DModel(**(I2V if i2v else T2V)).save_pretrained(str(root))
    return str(root), i2v


def reference(path: str) -> WanTransformer3DModel:
    """diffusers' own load, parameters copied into fresh memory (see test_dit_build.from_pretrained)."""
    model = WanTransformer3DModel.from_pretrained(path).to(DEVICE)
    for p in model.parameters():
        p.data = p.data.clone()
    return model


@pytest.mark.triton_cpu
def test_build_with_kernels_matches_diffusers_and_exports_unchanged(wan, tmp_path):
    path, i2v = wan
    model = build_model(path, weights=path, ops=ops(**ALL), device=DEVICE)
    processors = {type(m.processor) for m in model.modules() if hasattr(m, "processor")}
    assert processors == {WanKernelAttnProcessor}
    ref = reference(path)
    # Same parameters and buffers under the same names: the kernels live in the processors only.
    ours_state, ref_state = model.state_dict(), ref.state_dict()
    assert ours_state.keys() == ref_state.keys()
    for key, value in ref_state.items():
        assert torch.equal(ours_state[key], value), key
    assert_same(loss_and_grads(model, inputs(i2v)), loss_and_grads(ref, inputs(i2v)))
    export_diffusers(model, str(tmp_path))
    back = WanTransformer3DModel.from_pretrained(str(tmp_path))
    drop = ("_name_or_path",)  # where each was loaded from
    assert {k: v for k, v in back.config.items() if k not in drop} == {
        k: v for k, v in ref.config.items() if k not in drop
    }
    exported = back.state_dict()
    assert exported.keys() == ref_state.keys()
    for key, value in gather_state_dict(model, None).items():
        assert torch.equal(exported[key], value.cpu()), key


@pytest.mark.triton_cpu
@pytest.mark.parametrize("i2v", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["t2v", "i2v"])
def test_compiled_blocks_equal_eager_under_checkpointing(tmp_path, i2v):
    torch.manual_seed(11)
    WanTransformer3DModel(**(I2V if i2v else T2V)).save_pretrained(str(tmp_path))
    path = str(tmp_path)
    eager = build_model(path, weights=path, ops=ops(**ALL), device=DEVICE)
    compiled = build_model(path, weights=path, ops=ops(**ALL), device=DEVICE)
    torch._dynamo.reset()
    result = compile_blocks(compiled, ("blocks.*",), backend="aot_eager")
    for model in (eager, compiled):
        apply_activation_checkpointing(model, ("blocks.*",))
    want = loss_and_grads(eager, inputs(i2v))
    # aot_eager runs the captured ops, but its backward sums the context's gradient contributions in another
    # order than eager autograd (the text embedder's weight gradients differ by ~1e-9): fp32 tolerance.
    assert_same(loss_and_grads(compiled, inputs(i2v)), want)
    graphs = result.stats.graphs
    assert 1 <= graphs <= 2  # one graph shared by every block (two: dynamo's automatic-dynamic retrace)
    assert_same(loss_and_grads(compiled, inputs(i2v)), want)
    assert result.stats.graphs == graphs  # no recompile on the next step


def test_ops_compile_on_compiles_every_block_and_refuses_keep_attention(wan):
    path, _ = wan
    model = build_model(path, weights=path, ops=ops(compile="on", **ALL), device=DEVICE)
    assert all(getattr(block, COMPILED_MARK, False) for block in model.blocks)
    assert compile_stats(model) is not None
    # Defaulted rms_norm/rope take the eager formulas inductor fuses; the explicit choices above stay.
    assert model.veomni_kernels.config.rope == "triton"
    defaulted = build_model(path, weights=path, ops=ops(compile="on"), device=DEVICE)
    assert defaulted.veomni_kernels.config.rope == "eager"
    with pytest.raises(ValueError, match="keep_attention.*compiled"):
        apply_activation_checkpointing(model, ("blocks.*",), keep_attention=True)


@pytest.mark.triton_cpu
def test_keep_attention_checkpointing_with_kernels_matches_diffusers(wan):
    path, i2v = wan
    model = build_model(path, weights=path, ops=ops(**ALL), device=DEVICE)
    apply_activation_checkpointing(model, ("blocks.*",), keep_attention=True)
    assert_same(loss_and_grads(model, inputs(i2v)), loss_and_grads(reference(path), inputs(i2v)))


def test_bad_bindings_are_refused(wan):
    path, _ = wan
    # A rope backend without the interleaved variant (liger and npu have none; here: triton's removed).
    registry = KernelRegistry()
    for spec in KERNELS.specs():
        if (spec.op, spec.variant, spec.backend) != ("rope", "interleaved", "triton"):
            registry.register(spec.op, spec.variant, spec.backend, spec.factory, spec.requires)
    with pytest.raises(ValueError, match="no rope/interleaved kernel"):
        bind_wan_kernels(reference(path), OpsConfig(rope="triton", hardware=CPU, registry=registry))
    model = reference(path)
    model.blocks[0].attn1.set_processor(_Foreign())
    with pytest.raises(ValueError, match="processor _Foreign"):
        bind_wan_kernels(model, ops())
    with pytest.raises(ValueError, match="WanTransformer3DModel only"):
        bind_wan_kernels(torch.nn.Linear(2, 2), ops())
    with pytest.raises(TypeError, match="OpsConfig"):
        bind_wan_kernels(reference(path), {"rope": "eager"})


def test_dit_defaults_take_sdpa_and_eager_blocks(wan):
    # Measured on an H100 (notebook/benchmarks-log.md 2026-11-25): varlen attention 1.5x slower than SDPA on one unpacked
    # 32k sequence, compiled blocks 0.80x eager under checkpointing. Explicit choices are the user's.
    path, _ = wan
    gpu = Hardware(device_type="cuda", capability=(9, 0))
    ops = OpsConfig(hardware=gpu)
    assert ops.attention == "varlen" and ops.compile_enabled
    adapted = dit_ops(ops)
    assert adapted.attention == "sdpa" and adapted.defaulted == ops.defaulted
    assert dit_ops(OpsConfig(hardware=gpu, attention="varlen")).attention == "varlen"
    assert _bind_kernels(reference(path), ops) is False  # compile "auto" leaves DiT blocks eager
    assert _bind_kernels(reference(path), OpsConfig(hardware=gpu, compile="on")) is True


def test_a_defaulted_rope_backend_without_the_variant_keeps_diffusers_rotary(caplog):
    # The NPU default (npu, no interleaved kernel) in miniature: a GPU registry whose default lacks the variant.
    registry = KernelRegistry()
    for spec in KERNELS.specs():
        if (spec.op, spec.variant, spec.backend) != ("rope", "interleaved", "triton"):
            registry.register(spec.op, spec.variant, spec.backend, spec.factory, spec.requires)
    gpu = Hardware(device_type="cuda", capability=(9, 0))
    config = OpsConfig(hardware=gpu, registry=registry, attention="sdpa")
    assert config.rope == "triton" and "rope" in config.defaulted
    with caplog.at_level("WARNING", logger="veomni.models.wan.kernels"):
        bound = wan_ops(resolve_kernels(config))
    assert bound.rope is None and bound.names["rope"] == "diffusers" and bound.rms_norm is not None
    assert "has no rope/interleaved kernel; WanTransformer3DModel keeps diffusers' rotary" in caplog.text


class _Foreign(WanAttnProcessor):
    """Someone else's processor (a subclass of diffusers' is still someone else's)."""


def test_copy_keeps_bound_ops():
    bound = WanOps(rope=apply_rope_interleaved_eager)
    processor = WanKernelAttnProcessor(DIFFUSERS_OPS)
    assert copy.copy(processor).with_ops(bound).ops is bound


def _sp_fsdp_compiled_vs_unsplit(ctx, src: str) -> None:
    # build_model's order by hand, with aot_eager for the compile (inductor's CPU code generation is slow):
    # kernels, Ulysses SP, compiled blocks, then FSDP2 per block with activation checkpointing.
    torch._dynamo.reset()
    state = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type)
    ref = reference(src)
    model = copy.deepcopy(ref)
    bind_wan_kernels(model, ops(**ALL))
    apply_dit_sp(model, state)
    stats = compile_blocks(model, ("blocks.*",), backend="aot_eager").stats
    policy = FSDPPolicy(
        block_patterns=("blocks.*",),
        param_dtype=None,
        reduce_dtype=torch.float32,
        activation_checkpointing=True,
    )
    apply_fsdp2(model, state, policy)
    assert {type(m.processor) for m in model.modules() if hasattr(m, "processor")} == {
        WanUlyssesAttnProcessor
    }
    want = loss_and_grads(ref, inputs())
    loss, sample, grads = loss_and_grads(model, inputs())
    # FSDP2 averaged the gradients over the world (= the SP group): the unsplit gradient.
    full = {n: g.full_tensor() if isinstance(g, DTensor) else g for n, g in grads.items()}
    assert_same((loss, sample, full), want)
    assert stats.graphs >= 1


@pytest.mark.slow
@pytest.mark.triton_cpu
@pytest.mark.parametrize("world_size, backend", backend_params(2)[:1])
def test_sp_fsdp2_compiled_kernels_match_unsplit_diffusers(dist_pools, tmp_path, world_size, backend):
    torch.manual_seed(11)
    # 4 heads: SP 2 splits them; 12 tokens of 2 x 2 x 3 patches.
    WanTransformer3DModel(**dict(T2V, num_attention_heads=4)).save_pretrained(str(tmp_path))
    dist_pools.get(world_size, backend).run(_sp_fsdp_compiled_vs_unsplit, str(tmp_path))


@pytest.mark.cuda
@pytest.mark.parametrize("compile", ["off", "on"])
def test_cuda_bf16_kernels_and_compiled_blocks_track_diffusers(tmp_path, compile):
    # The GPU defaults (rms_norm/rope triton eager, sdpa attention via dit_ops; compiled: inductor, eager formulas)
    # on a Wan-shaped model of 1.3B's head size, bf16 with diffusers' fp32 modules, against diffusers' own.
    config = dict(T2V, num_attention_heads=4, attention_head_dim=128, ffn_dim=256, num_layers=2)
    torch.manual_seed(11)
    WanTransformer3DModel(**config).save_pretrained(str(tmp_path))
    hw = Hardware(device_type="cuda")
    model = build_model(
        str(tmp_path), weights=str(tmp_path), ops=OpsConfig(compile=compile, hardware=hw), device="cuda",
        dtype=torch.bfloat16,
    )  # fmt: skip
    assert model.veomni_kernels.config.attention == "sdpa"
    # ops=None: diffusers' own attention code in the same dtype policy (equal to from_pretrained: test_dit_build).
    ref = build_model(str(tmp_path), weights=str(tmp_path), ops=None, device="cuda", dtype=torch.bfloat16)
    batch = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in inputs().items()}
    batch = {k: v.to("cuda") for k, v in batch.items()}
    for _ in range(2):  # the second step runs the compiled graphs without the priming forward
        got, want = loss_and_grads(model, batch), loss_and_grads(ref, batch)
    torch.testing.assert_close(got[0], want[0], rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(got[1].float(), want[1].float(), rtol=5e-2, atol=5e-2)
    for name, grad in want[2].items():
        cosine = torch.nn.functional.cosine_similarity(
            got[2][name].float().flatten(), grad.float().flatten(), dim=0
        )
        assert cosine > 0.99, name
