"""The generated dense adapters (Llama, Qwen2, Qwen3, Seed-OSS, Gemma 3) with veomni's kernels attached equal upstream
transformers: bitwise with every op eager, within fp32 tolerance per kernel combination (Triton runs through the
interpreter on CPU), for logits, loss and grad norm; greedy generation; Seed-OSS's training dropouts; Gemma 3 under
Ulysses SP with positions only and with fewer KV heads than ranks; SP refusing inputs without positions.

Without kernels, the adapter conformance suite covers these models (`test_conformance`, `conformance_table`):
bitwise parity with upstream (eager and sdpa attention), a packed row == its documents, SP=2 == one process, and
the export round trip (Seed-OSS with every bias, Gemma 3 with tied embeddings)."""

from __future__ import annotations

import copy

import pytest
import torch
from adapter_helpers import DEVICE, sp_against_one_process
from transformers import (
    Gemma3TextConfig,
    LlamaConfig,
    Qwen2Config,
    Qwen3Config,
    SeedOssConfig,
)
from transformers.models.gemma3.modeling_gemma3 import Gemma3ForCausalLM as UpstreamGemma3
from transformers.models.llama.modeling_llama import LlamaForCausalLM as UpstreamLlama
from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM as UpstreamQwen2
from transformers.models.qwen3.modeling_qwen3 import Qwen3ForCausalLM as UpstreamQwen3
from transformers.models.seed_oss.modeling_seed_oss import SeedOssForCausalLM as UpstreamSeedOss

from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import build_parallel_state, use_parallel_state
from veomni.core.sp import slice_sequence
from veomni.kernels import OpsConfig, resolve_kernels
from veomni.models.gemma3.generated.patched_modeling_gemma3 import Gemma3ForCausalLM
from veomni.models.hf.attention import packed_kwargs
from veomni.models.hf.kernel_hooks import apply_ops, attach_kernels
from veomni.models.llama.generated.patched_modeling_llama import LlamaForCausalLM
from veomni.models.qwen2.generated.patched_modeling_qwen2 import Qwen2ForCausalLM
from veomni.models.qwen3.generated.patched_modeling_qwen3 import Qwen3ForCausalLM
from veomni.models.seed_oss.generated.patched_modeling_seed_oss import SeedOssForCausalLM

# Every op eager: the hardware defaults (e.g. the fused cross-entropy on CUDA) must not sneak into a comparison.
EAGER_OPS = dict(rms_norm="eager", rope="eager", swiglu="eager", cross_entropy="eager")

# model -> (config class, upstream class, generated class)
MODELS = {
    "llama": (LlamaConfig, UpstreamLlama, LlamaForCausalLM),
    "qwen2": (Qwen2Config, UpstreamQwen2, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, UpstreamQwen3, Qwen3ForCausalLM),
    "seed_oss": (SeedOssConfig, UpstreamSeedOss, SeedOssForCausalLM),
    "gemma3": (Gemma3TextConfig, UpstreamGemma3, Gemma3ForCausalLM),
}

# Per-family odd shapes: Seed-OSS with every bias on (q/k/v, o_proj, MLP) and head_dim 24 != hidden / heads = 16,
# so a kernel that assumed either would show. Its dropouts keep the upstream default (0.1); eval() turns them off.
# Gemma 3: a sliding layer (window 5, shorter than the 24-token rows) then a global one, each with its own RoPE base,
# a softmax scale from query_pre_attn_scalar (24, not head_dim), and a final logit soft-cap small enough to bite on
# these logits (|z| ~ 0.6); the attention soft-cap stays null (upstream never applies it: test_gemma3.py).
FAMILY_OVERRIDES = {
    "seed_oss": dict(head_dim=24, attention_bias=True, attention_out_bias=True, mlp_bias=True),
    "gemma3": dict(
        sliding_window=5, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24,
        final_logit_softcapping=0.5, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "default", "rope_theta": 5000.0},
        },
    ),
}  # fmt: skip
# Families whose RMSNorm scales by (1 + weight) with zero-initialised weights: random ones exercise the weight path.
OFFSET_NORMS = {"gemma3"}
# Families whose MLP is not SwiGLU (Gemma 3: GELU-tanh gated): an explicit swiglu kernel is refused.
NO_SWIGLU = {"gemma3"}


def tiny_config(model: str, **overrides):
    # Real ratios (GQA 2:1, intermediate 3x hidden, explicit head_dim), cut in width and depth.
    values = dict(
        vocab_size=128, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )  # fmt: skip
    values.update(FAMILY_OVERRIDES.get(model, {}))
    values.update(overrides)
    return MODELS[model][0](**values)


def build_pair(attn: str, model: str = "qwen3", **overrides) -> tuple[torch.nn.Module, torch.nn.Module]:
    config = tiny_config(model, **overrides)
    config._attn_implementation = attn
    torch.manual_seed(0)
    upstream = (
        MODELS[model][1](copy.deepcopy(config)).eval().to(DEVICE)
    )  # apply_ops edits the config it is given
    if model in OFFSET_NORMS:
        randomise_norms(upstream)
    ours = MODELS[model][2](config).eval().to(DEVICE)
    missing, unexpected = ours.load_state_dict(upstream.state_dict(), strict=True)
    assert not missing and not unexpected
    return upstream, ours


def randomise_norms(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0, 0.1)


def batch(seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (2, 24), generator=gen).to(DEVICE)
    return {"input_ids": ids, "labels": ids.clone()}


def loss_and_grad_norm(model: torch.nn.Module, inputs: dict) -> tuple[torch.Tensor, torch.Tensor, float]:
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    grads = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
    logits = None if out.logits is None else out.logits.detach()
    return logits, out.loss.detach(), float(torch.cat(grads).norm())


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_eager_kernels_are_bitwise_upstream(model, attn):
    # Kernels attached, every op eager: the patched forwards' dispatch computes upstream's maths bit for bit (the
    # adapters without kernels: test_conformance's parity cells).
    upstream, ours = build_pair(attn, model)
    attach_kernels(ours, resolve_kernels(OpsConfig(**EAGER_OPS)))
    ref_logits, ref_loss, ref_norm = loss_and_grad_norm(upstream, batch())
    logits, loss, norm = loss_and_grad_norm(ours, batch())
    assert torch.equal(logits, ref_logits) and torch.equal(loss, ref_loss) and norm == ref_norm


@pytest.mark.parametrize(
    "ops",
    [
        {"rms_norm": "triton", "rope": "triton", "swiglu": "triton"},
        {"rms_norm": "torch"},
        {"rms_norm": "triton"},
        {"rope": "triton"},
        {"swiglu": "triton"},
        {"cross_entropy": "triton"},
    ],
    ids=lambda ops: "+".join(f"{k}={v}" for k, v in ops.items()),
)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_kernel_combinations_match_upstream(model, ops):
    upstream, ours = build_pair("sdpa", model)
    if model in NO_SWIGLU and "swiglu" in ops:
        # Refused at the first forward, naming the activation; the rest of the combination is checked without it.
        attach_kernels(ours, resolve_kernels(OpsConfig(**{**EAGER_OPS, **ops})))
        with pytest.raises(ValueError, match=r"silu\(gate\) \* up, but Gemma 3's MLP is gelu_pytorch_tanh"):
            ours(**batch(2))
        ops = {k: v for k, v in ops.items() if k != "swiglu"}
    attach_kernels(ours, resolve_kernels(OpsConfig(**{**EAGER_OPS, **ops})))  # unnamed ops stay eager
    ref_logits, ref_loss, ref_norm = loss_and_grad_norm(upstream, batch(2))
    logits, loss, norm = loss_and_grad_norm(ours, batch(2))
    if ops.get("cross_entropy", "eager") == "eager":
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    else:
        assert logits is None  # the fused loss never materialises [T, V] logits
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert norm == pytest.approx(ref_norm, rel=1e-5)


def test_swiglu_kernel_refuses_other_activations():
    _, ours = build_pair("sdpa", hidden_act="gelu")
    attach_kernels(ours, resolve_kernels(OpsConfig(swiglu="triton")))
    with pytest.raises(ValueError, match="hidden_act is 'gelu'; set swiglu='eager'"):
        ours(**batch())


def test_two_instances_keep_their_own_kernels():
    _, fast = build_pair("sdpa")
    _, ref = build_pair("sdpa")
    attach_kernels(fast, resolve_kernels(OpsConfig(rms_norm="torch")))
    attach_kernels(ref, resolve_kernels(OpsConfig(rms_norm="eager")))
    assert fast.model.norm.veomni_kernels.config.rms_norm == "torch"
    assert ref.model.norm.veomni_kernels.config.rms_norm == "eager"
    with pytest.raises(TypeError, match="expects veomni.kernels.Kernels"):
        attach_kernels(ref, OpsConfig())  # type: ignore[arg-type]


@pytest.mark.parametrize("model", sorted(MODELS))
def test_generation_with_veomni_ops_matches_upstream(model):
    upstream, ours = build_pair("sdpa", model)
    apply_ops(
        ours,
        OpsConfig(attention="sdpa", cross_entropy="triton", rms_norm="eager", rope="eager", swiglu="eager"),
    )
    prompt = batch()["input_ids"][:1, :7]
    settings = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, **settings), upstream.generate(prompt, **settings))
    last = ours(input_ids=prompt, logits_to_keep=1).logits
    torch.testing.assert_close(
        last, upstream(input_ids=prompt, logits_to_keep=1).logits, rtol=1e-5, atol=1e-5
    )


# ---------------------------------------------------------------- Seed-OSS: residual dropout in training mode


def seeded_train_step(model: torch.nn.Module, inputs: dict) -> tuple[torch.Tensor, torch.Tensor, float]:
    # Same seed before each model: equal dropout masks exactly when both draw the same RNG calls in the same order.
    model.train()
    torch.manual_seed(1234)
    return loss_and_grad_norm(model, inputs)


def test_seed_oss_training_dropouts_are_bitwise_upstream():
    upstream, ours = build_pair("eager", "seed_oss", attention_dropout=0.2, residual_dropout=0.3)
    attach_kernels(ours, resolve_kernels(OpsConfig(**EAGER_OPS)))
    ref_logits, ref_loss, ref_norm = seeded_train_step(upstream, batch())
    logits, loss, norm = seeded_train_step(ours, batch())
    assert torch.equal(logits, ref_logits) and torch.equal(loss, ref_loss) and norm == ref_norm
    upstream.eval()
    eval_loss = upstream(**batch()).loss.detach()
    assert not torch.equal(eval_loss, ref_loss)  # the dropouts were really active in the training step


def test_seed_oss_kernels_keep_the_residual_dropout():
    # Kernels replace silu(gate) * up, RMSNorm and RoPE only; the residual dropouts after o_proj and down_proj
    # must still run (and draw the same masks). veomni's attention has no dropout, so attention_dropout is 0 here.
    upstream, ours = build_pair("sdpa", "seed_oss", attention_dropout=0.0, residual_dropout=0.3)
    attach_kernels(
        ours,
        resolve_kernels(
            OpsConfig(**{**EAGER_OPS, "rms_norm": "triton", "rope": "triton", "swiglu": "triton"})
        ),
    )
    ref_logits, ref_loss, ref_norm = seeded_train_step(upstream, batch(2))
    logits, loss, norm = seeded_train_step(ours, batch(2))
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert norm == pytest.approx(ref_norm, rel=1e-5)


# ---------------------------------------------------------------- Gemma 3 under Ulysses SP


def packed_row(lengths: list[int], seed: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One packed row ``(input_ids, position_ids, labels)``, each ``[1, sum(lengths)]``; labels stay in documents."""
    ids = torch.randint(0, 128, (1, sum(lengths)), generator=torch.Generator().manual_seed(seed))
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    labels = torch.cat(
        [torch.cat([ids[0, s + 1 : s + n], torch.tensor([-100])]) for s, n in _starts(lengths)]
    )[None]
    return ids, positions, labels


# Gemma 3 with a window of 3 inside the 5- and 7-token documents, which under SP applies to global positions across
# the ranks' shards.
SP_OVERRIDES = {"gemma3": dict(sliding_window=3)}


def _sp_case(ctx, model_name: str, mode: str, extra: dict) -> dict[str, float]:
    # One packed row of three documents through our adapter with veomni_sdpa, whole vs sliced over the SP ranks.
    state = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type)
    torch.manual_seed(0)
    model = MODELS[model_name][2](tiny_config(model_name, **SP_OVERRIDES[model_name], **extra))
    if model_name in OFFSET_NORMS:
        randomise_norms(model)
    apply_ops(model, OpsConfig(**EAGER_OPS, attention="sdpa"))
    ids, positions, labels = packed_row([5, 1, 7])
    # cu_unpadded: the packing's cu_seqlens and the true length; positions: the ranks derive the packing from the
    # gathered position_ids.
    whole = packed_kwargs(positions)
    sharded = {**whole, "sp_unpadded_len": ids.shape[1]} if mode == "cu_unpadded" else {}
    return sp_against_one_process(model, state, ids, positions, labels, whole=whole, sharded=sharded)


def _starts(lengths: list[int]) -> list[tuple[int, int]]:
    return [(sum(lengths[:i]), n) for i, n in enumerate(lengths)]


def _sp_without_positions(ctx) -> str:
    state = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type)
    torch.manual_seed(0)
    model = SeedOssForCausalLM(tiny_config("seed_oss", attention_dropout=0.0, residual_dropout=0.0))
    apply_ops(model, OpsConfig(**EAGER_OPS, attention="sdpa"))
    apply_ops(model, OpsConfig(**EAGER_OPS, attention="sdpa"))  # bound twice: still one guard
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(4))
    model(input_ids=ids)  # outside SP: HF's default positions are right
    with use_parallel_state(state), pytest.raises(ValueError, match="under Ulysses SP needs position_ids") as err:
        model(input_ids=slice_sequence(ids, 1, state.sp_group))
    with use_parallel_state(state):  # positions given by keyword or by position: both accepted
        local_ids = slice_sequence(ids, 1, state.sp_group)
        positions = slice_sequence(torch.arange(8).expand(2, 8), 1, state.sp_group)
        model(input_ids=local_ids, position_ids=positions)
        model(local_ids, None, positions)
    assert len(model._forward_pre_hooks) == 1
    return str(err.value)


def test_a_text_model_under_sp_refuses_inputs_without_position_ids(dist_pools):
    # HF would number each rank's shard from 0: wrong RoPE and each shard attending only to itself (logits off by
    # 0.43 on 2 gloo ranks), silently.
    assert all("slice_sequence" in message for message in dist_pools.get(2).run(_sp_without_positions))


@pytest.mark.parametrize(
    "model, mode, extra",
    [
        ("gemma3", "positions", {}),
        ("gemma3", "cu_unpadded", {"num_key_value_heads": 1}),  # fewer KV heads than SP ranks
    ],
    ids=["gemma3-positions", "gemma3-kv1"],
)
def test_ulysses_sp2_matches_single_process(dist_pools, model, mode, extra):
    # The packing from the gathered positions alone, and KV heads replicated over the ranks; the plain cu_seqlens
    # case of every SP model is test_conformance's SP cell.
    for worst in dist_pools.get(2).run(_sp_case, model, mode, extra):
        assert worst["logits"] < 1e-5 and worst["grad"] <= 1.0, worst
