"""The generated GLM-4.5 MoE adapter (``glm4_moe``) equals upstream transformers: bitwise without kernels, within fp32
tolerance with veomni's kernels, on a tiny config with GLM's specifics (partial RoPE with an explicit head_dim, q/k
norm, q/k/v biases, a sigmoid router with a non-zero correction bias and group-limited top-k, shared experts, a dense
first layer). Also: a packed row equals its documents run alone, EP on real gloo ranks equals the whole model,
generation with the KV cache, the fp32 router bias, and a checkpoint from plain transformers (with GLM's MTP layer
weights, which are skipped as upstream skips them) built, trained-on and exported back. The default config without
kernels (parity, packed with eager experts, SP=2 sync and async) is the conformance suite's glm4_moe row
(test_conformance)."""

from __future__ import annotations

import copy

import pytest
import torch
from adapter_helpers import assert_router_bias_is_an_fp32_buffer, grad_norm, packed_batch, run, upstream_pair
from safetensors.torch import load_file, save_file
from transformers import Glm4MoeConfig
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeForCausalLM as UpstreamGlm4Moe

from veomni.core.ep import apply_expert_plan
from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import build_parallel_state, use_parallel_state
from veomni.kernels import OpsConfig, resolve_kernels
from veomni.models.build import build_model
from veomni.models.export.hf import export_hf
from veomni.models.glm4_moe.generated.patched_modeling_glm4_moe import Glm4MoeForCausalLM, Glm4MoeModel
from veomni.models.hf.attention import packed_kwargs
from veomni.models.hf.experts import register_hf_experts
from veomni.models.hf.kernel_hooks import apply_ops, attach_kernels
from veomni.models.loading.loader import CheckpointMismatchError
from veomni.models.registry import MODELS

EAGER_OPS = dict(
    rms_norm="eager", rope="eager", swiglu="eager", moe_experts="eager", cross_entropy="eager",
    load_balancing_loss="eager",
)  # fmt: skip


def tiny_config(**overrides) -> Glm4MoeConfig:
    # GLM-4.5's structure cut down: head_dim 24 (not hidden / heads = 16) with partial_rotary_factor 0.5, so 12 dims
    # rotate and 12 pass through; GQA 4:2; q/k norm and attention biases on; 8 experts in 2 groups of which 1 is kept
    # (top-3 inside it), 2 shared experts, layer 0 dense. Widths are multiples of 4 (the 'torch' grouped GEMM).
    values = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=3,
        first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=3, n_group=2, topk_group=1,
        n_shared_experts=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24, partial_rotary_factor=0.5,
        use_qk_norm=True, attention_bias=True, routed_scaling_factor=2.5, norm_topk_prob=True,
        max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
    )  # fmt: skip
    values.update(overrides)
    config = Glm4MoeConfig(**values)
    config._attn_implementation = "sdpa"
    config._experts_implementation = "eager"
    return config


def randomize(model: torch.nn.Module, seed: int = 5) -> None:
    """A non-zero router correction bias (zeros at init) large enough to change which experts win, and non-zero
    attention biases (zeros at init), so that dropping either would show."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for fqn, tensor in [*model.named_buffers(), *model.named_parameters()]:
            if fqn.endswith("e_score_correction_bias"):
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.1)
            elif fqn.endswith("_proj.bias"):
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.2)


def build_pair(**overrides) -> tuple[torch.nn.Module, torch.nn.Module]:
    return upstream_pair(UpstreamGlm4Moe, Glm4MoeForCausalLM, tiny_config(**overrides), perturb=randomize)


def assert_close(got, want, tol: float) -> None:
    """`run` results: logits (unless a fused loss made none), loss, every gradient and the grad norm."""
    if got[0] is not None:
        torch.testing.assert_close(got[0], want[0], rtol=tol, atol=tol)
    torch.testing.assert_close(got[1], want[1], rtol=tol, atol=tol / 10)
    assert got[2].keys() == want[2].keys()
    for name, grad in want[2].items():
        torch.testing.assert_close(got[2][name], grad, rtol=10 * tol, atol=tol / 10, msg=name)
    assert grad_norm(got[2]) == pytest.approx(grad_norm(want[2]), rel=10 * tol)


VARIANTS = [
    pytest.param({}, id="partial0.5-qknorm-bias-groups"),
    # GLM-4.5's published attention (no q/k norm) with full RoPE; one group, unnormalised top-k weights.
    pytest.param(
        dict(
            use_qk_norm=False,
            attention_bias=False,
            partial_rotary_factor=1.0,
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
        ),
        id="full_rope-plain-one_group",
    ),  # fmt: skip
]


@pytest.mark.parametrize("overrides", VARIANTS)
@pytest.mark.parametrize("kernels", [None, "eager"], ids=["no-kernels", "eager-kernels"])
def test_eager_paths_are_bitwise_upstream(overrides, kernels):
    if kernels is None and not overrides:
        pytest.skip("the default config without kernels is test_conformance's parity_sdpa cell (glm4_moe)")
    upstream, ours = build_pair(**overrides)
    if kernels:
        attach_kernels(ours, resolve_kernels(OpsConfig(**EAGER_OPS)))
        ours.set_experts_implementation(register_hf_experts())  # the veomni experts function, eager branch
    want, got = run(upstream, packed_batch()), run(ours, packed_batch())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[2].keys() == want[2].keys() and all(torch.equal(got[2][n], want[2][n]) for n in want[2])


KERNEL_CASES = [
    # Every op on a kernel in at least one case; the partial RoPE kernel in both.
    pytest.param(
        {},
        dict(rms_norm="triton", rope="triton", swiglu="triton", moe_experts="torch"),
        id="partial-triton_norm_rope_swiglu-torch_experts",
    ),
    pytest.param(
        dict(use_qk_norm=False, attention_bias=False, partial_rotary_factor=1.0),
        dict(rms_norm="torch", rope="triton", moe_experts="triton", cross_entropy="triton"),
        id="full_rope-torch_norm-triton_experts_ce",
    ),
]


@pytest.mark.triton_cpu
@pytest.mark.parametrize("overrides, ops", KERNEL_CASES)
def test_kernels_match_upstream(overrides, ops):
    """RMSNorm (layer and q/k norms), partial RoPE, SwiGLU (dense layer and shared experts), routed experts and the
    loss on veomni's kernels, attention through veomni's sdpa on a packed row: fp32 logits, loss, gradients."""
    upstream, ours = build_pair(**overrides)
    apply_ops(ours, OpsConfig(**{**EAGER_OPS, **ops, "attention": "sdpa"}))
    assert ours.config._experts_implementation == "veomni"
    assert ours.config._attn_implementation == "veomni_sdpa"
    batch = packed_batch(seed=2)
    got = run(ours, batch, **packed_kwargs(batch["position_ids"]))
    if ops.get("cross_entropy", "eager") != "eager":
        assert got[0] is None  # the fused loss never materialises logits
    assert_close(got, run(upstream, batch), 1e-5)


def run_per_document(model: torch.nn.Module, inputs: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """`run` on a packed row computed one document at a time (HF's loss: shifted labels, mean over the labelled
    tokens; each document's first token is unlabelled, so no target crosses a boundary)."""
    model.zero_grad(set_to_none=True)
    starts = (inputs["position_ids"][0] == 0).nonzero().flatten().tolist() + [inputs["input_ids"].shape[1]]
    ids = inputs["input_ids"]
    pieces = [
        model(input_ids=ids[:, a:b], use_cache=False).logits for a, b in zip(starts, starts[1:], strict=False)
    ]
    logits = torch.cat(pieces, 1)
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], inputs["labels"][0, 1:], ignore_index=-100)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), loss.detach(), grads


def test_packed_row_equals_its_documents_run_alone():
    # Ours reads the packing from the cu_seq_lens a collator passes; upstream runs each document on its own. With
    # the torch grouped-GEMM experts (eager experts: test_conformance's packed cell).
    upstream, ours = build_pair()
    apply_ops(ours, OpsConfig(**{**EAGER_OPS, "attention": "sdpa", "moe_experts": "torch"}))
    inputs = packed_batch(lengths=(6, 1, 9, 5), seed=3)
    assert_close(
        run(ours, inputs, **packed_kwargs(inputs["position_ids"])), run_per_document(upstream, inputs), 2e-5
    )


def test_generation_with_the_kv_cache_matches_upstream():
    upstream, ours = build_pair()
    apply_ops(ours, OpsConfig(**{**EAGER_OPS, "attention": "sdpa", "rope": "triton", "moe_experts": "torch"}))
    ids = packed_batch()["input_ids"][:, :9]
    last = ours(input_ids=ids, logits_to_keep=1).logits
    torch.testing.assert_close(last, upstream(input_ids=ids, logits_to_keep=1).logits, rtol=1e-5, atol=1e-5)
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **settings), upstream.generate(ids, **settings))


def test_router_bias_is_an_fp32_buffer_in_a_bf16_build():
    assert_router_bias_is_an_fp32_buffer(tiny_config(), OpsConfig(**EAGER_OPS))


def test_registry_and_parallel_plan():
    resolved = MODELS.model_class(tiny_config())
    assert resolved.cls is Glm4MoeForCausalLM and resolved.fast_paths == {"sp", "ep", "fused_kernels"}
    assert MODELS.model_class(tiny_config(), "base").cls is Glm4MoeModel
    with torch.device("meta"):
        model = Glm4MoeForCausalLM(tiny_config())
    shards = apply_expert_plan(model, model.get_parallel_plan(), ep_size=4, ep_rank=3)
    # layer 0 is dense; the shared experts and the router are not expert-sharded
    assert sorted(shards) == sorted(
        f"model.layers.{i}.mlp.experts.{name}" for i in (1, 2) for name in ("down_proj", "gate_up_proj")
    )
    experts = model.model.layers[1].mlp.experts
    assert experts.gate_up_proj.shape == (2, 32, 64) and experts.down_proj.shape == (2, 64, 16)
    assert all(s.start == 6 and s.stop == 8 for s in shards.values())


def test_the_family_hook_counts_this_routers_choices_for_aux_free_balancing():
    """The family's ``balanced_routers`` hook (what the trainer calls for ``optim.moe_bias_update_speed``) finds the
    MoE layers' routers and counts their top-k picks; the sign rule then moves the bias."""
    from veomni.models.families import training_hooks
    from veomni.models.family import resolve
    from veomni.models.moe.aux_free_balance import LOAD, update_correction_biases

    attach_load_counters = resolve(training_hooks("glm4_moe").balanced_routers)
    _, ours = build_pair()
    routers = attach_load_counters(ours)
    assert len(routers) == 2  # the two MoE layers' routers, not the dense layer
    batch = packed_batch()
    ours(**batch, use_cache=False).loss.backward()
    loads = torch.stack([getattr(r, LOAD) for r in routers])
    assert loads.sum(dim=1).tolist() == [17.0 * 3] * 2  # every token's top-3 choices
    before = routers[0].e_score_correction_bias.clone()
    update_correction_biases(routers, 0.01)
    step = routers[0].e_score_correction_bias - before
    torch.testing.assert_close(step, 0.01 * torch.sign(loads[0].mean() - loads[0]), rtol=0, atol=1e-7)


# zai-org/GLM-4.5-Air's architecture keys (config.json); the glm4_5_air recipe quotes the figures below.
GLM_4_5_AIR = dict(
    vocab_size=151552, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=46,
    num_attention_heads=96, num_key_value_heads=8, head_dim=128, n_routed_experts=128, n_shared_experts=1,
    num_experts_per_tok=8, first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.0,
    norm_topk_prob=True, partial_rotary_factor=0.5, use_qk_norm=False, attention_bias=True, rms_norm_eps=1e-5,
    max_position_embeddings=131072, tie_word_embeddings=False,
)  # fmt: skip


def test_glm4_5_air_recipe_parameter_counts():
    """The figures in the glm4_5_air recipe's memory notes (billions): total, routed experts, active per token,
    matmul parameters per token as MFU counts them, and one MoE layer's non-expert part (millions)."""
    from veomni.train.tasks.text import TextTask

    config = Glm4MoeConfig(**GLM_4_5_AIR)
    with torch.device("meta"):
        model = Glm4MoeForCausalLM(config)
    params = dict(model.named_parameters())
    routed = sum(p.numel() for n, p in params.items() if ".experts." in n)
    total = sum(p.numel() for p in params.values())
    active = total - routed + routed * config.num_experts_per_tok / config.n_routed_experts
    assert (round(total / 1e9, 2), round(routed / 1e9, 2), round(active / 1e9, 2)) == (106.85, 99.66, 13.42)
    assert round(TextTask.for_model(model).flops_per_token / 6e9, 2) == 12.80
    layer = model.model.layers[-1]
    assert round(sum(p.numel() for n, p in layer.named_parameters() if ".experts." not in n) / 1e6) == 127
    assert model.model.rotary_emb.inv_freq.numel() * 2 == 64  # half of each 128-wide head rotates


# ---------------------------------------------------------------- checkpoints in and out


def test_checkpoint_with_mtp_layers_builds_and_exports_to_plain_transformers(tmp_path):
    """A checkpoint saved by plain transformers (per-expert layout) plus the weights of GLM's MTP layer (which
    upstream's class skips: ``model.layers.{46,92}.*``) builds, matches upstream, and exports back loadably."""
    from transformers import AutoModelForCausalLM

    upstream = build_pair()[0].cpu()  # build_model below builds on the CPU
    upstream.save_pretrained(tmp_path / "src")
    tensors = load_file(tmp_path / "src" / "model.safetensors")
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in tensors  # the original per-expert layout
    original = set(tensors)
    mtp = {
        "model.layers.46.eh_proj.weight": torch.randn(64, 128),
        "model.layers.46.enorm.weight": torch.ones(64),
    }
    save_file({**tensors, **mtp}, tmp_path / "src" / "model.safetensors", metadata={"format": "pt"})

    ops = OpsConfig(**{**EAGER_OPS, "attention": "sdpa", "moe_experts": "torch"})
    model = build_model(tmp_path / "src", weights=tmp_path / "src", ops=ops)
    assert type(model) is Glm4MoeForCausalLM
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert torch.equal(model.state_dict()[bias], upstream.state_dict()[bias])
    batch = {k: v.cpu() for k, v in packed_batch().items()}
    assert_close(run(model, batch, **packed_kwargs(batch["position_ids"])), run(upstream, batch), 2e-5)

    export_hf(model, tmp_path / "out")
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert set(written) == original  # back in the upstream layout, the MTP weights not invented
    assert written[bias].dtype == torch.float32 and torch.equal(written[bias], upstream.state_dict()[bias])
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(plain) is UpstreamGlm4Moe
    ids = batch["input_ids"][:, :9]
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(model.eval().generate(ids, **settings), plain.generate(ids, **settings))


def test_a_checkpoint_with_a_stray_layer_is_refused(tmp_path):
    # Only upstream's MTP indices are skipped: any other unexpected weight is an error naming it.
    build_pair()[0].cpu().save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.7.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        CheckpointMismatchError, match=r"unexpected keys \(1\): \['model\.layers\.7\.eh_proj\.weight'\]"
    ):
        build_model(tmp_path, weights=tmp_path, ops=OpsConfig(**EAGER_OPS))


# ---------------------------------------------------------------- EP on real gloo ranks
# (SP 2 == one process, sync and async Ulysses: test_conformance's sp cells for glm4_moe.)


def _ep_step(ctx, kernel: str) -> dict:
    _, model = build_pair()
    model.to(ctx.device)
    # The oracle: the same adapter unsharded, on each rank's batch. Under EP, rank r's expert slices receive the
    # gradient of every rank's loss (tokens travel to their experts), its dense parameters only that of its own.
    reference = copy.deepcopy(model)
    apply_ops(reference, OpsConfig(**{**EAGER_OPS, "attention": "sdpa"}))
    batches = [
        {k: v.to(ctx.device) for k, v in packed_batch(seed=10 + r).items()} for r in range(ctx.world_size)
    ]
    refs = [run(reference, b, **packed_kwargs(b["position_ids"])) for b in batches]
    state = build_parallel_state(ParallelDims(dp_shard=ctx.world_size, ep=ctx.world_size), ctx.device_type)
    shards = apply_expert_plan(model, model.get_parallel_plan(), ep_size=state.dims.ep, ep_rank=state.ep_rank)
    apply_ops(model, OpsConfig(**{**EAGER_OPS, "attention": "sdpa", "moe_experts": kernel}))
    mine = batches[ctx.rank]
    with use_parallel_state(state):
        _, loss, grads = run(model, mine, **packed_kwargs(mine["position_ids"]))
    worst = 0.0
    for name, grad in grads.items():
        if name in shards:
            want = sum(r[2][name] for r in refs)[shards[name].start : shards[name].stop]
        else:
            want = refs[ctx.rank][2][name]
        worst = max(worst, float((grad - want).abs().max() / want.abs().max().clamp(min=1e-12)))
    return {
        "loss_err": float((loss - refs[ctx.rank][1]).abs()),
        "worst_grad_rel": worst,
        "sharded": len(shards),
    }


@pytest.mark.parametrize("kernel", ["torch", pytest.param("triton", marks=pytest.mark.triton_cpu)])
def test_expert_parallel_matches_the_whole_model(dist_pools, kernel):
    for result in dist_pools.get(2).run(_ep_step, kernel):
        assert result["sharded"] == 4  # gate_up_proj and down_proj of the two MoE layers
        assert result["loss_err"] < 1e-5, result
        assert result["worst_grad_rel"] < 1e-4, result
