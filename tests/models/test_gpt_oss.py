"""The generated GPT-OSS adapter against upstream transformers (fp32 logits, loss and every gradient, sinks and
both layer types), its experts kernels against HF's ``GptOssExperts`` (forward and backward), the experts guard's
explicit claim, expert parallelism on gloo ranks, the build-time attention capability check, export to plain
transformers (generate equal), and the MXFP4 refusal."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as UpstreamExperts
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssForCausalLM as UpstreamGptOss

from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import build_parallel_state, use_parallel_state
from veomni.kernels import KERNELS, KernelRegistry, OpsConfig, resolve_kernels
from veomni.models.build import build_model
from veomni.models.export.hf import export_hf
from veomni.models.gpt_oss.experts import GPT_OSS_EXPERTS
from veomni.models.gpt_oss.generated.patched_modeling_gpt_oss import GptOssExperts, GptOssForCausalLM
from veomni.models.hf.attention import packed_kwargs
from veomni.models.hf.experts import (
    EXPERTS_CLAIMS,
    check_experts_modules,
    claim_experts,
    experts_mismatches,
)
from veomni.models.hf.kernel_hooks import apply_ops, attach_kernels
from veomni.models.registry import MODELS

# compile="off": these CPU models would otherwise be compiled on a GPU host ("auto" follows the hardware).
EAGER = dict(
    attention="eager", rms_norm="eager", rope="eager", swiglu="eager", moe_experts="eager",
    cross_entropy="eager", load_balancing_loss="eager", compile="off",
)  # fmt: skip


def tiny_config(**overrides) -> GptOssConfig:
    # Odd sizes (H = 36, I = 20, 5 experts, 6 query / 2 KV heads); a window of 4 so the sliding layer differs from
    # the full one on these lengths; yarn RoPE as published, scaled down; a low swiglu_limit so clamps bite.
    values = dict(
        vocab_size=97, hidden_size=36, intermediate_size=20, num_local_experts=5, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, head_dim=8, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0},
        tie_word_embeddings=False, output_router_logits=True, router_aux_loss_coef=0.05, swiglu_limit=1.5,
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )  # fmt: skip
    values.update(overrides)
    config = GptOssConfig(**values)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    return config


def build_pair(**overrides) -> tuple[torch.nn.Module, torch.nn.Module]:
    config = tiny_config(**overrides)
    torch.manual_seed(0)
    upstream = UpstreamGptOss(copy.deepcopy(config))
    with torch.no_grad():  # upstream zero-inits the biases; random ones make every bias path count
        for name, p in upstream.named_parameters():
            if name.endswith("bias") or name.endswith("sinks"):
                p.normal_(0.0, 0.5)
    ours = GptOssForCausalLM(config)
    missing, unexpected = ours.load_state_dict(upstream.state_dict(), strict=True)
    assert not missing and not unexpected
    return upstream, ours


def batch(packed: bool, seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    if not packed:
        ids = torch.randint(3, 97, (2, 11), generator=gen)
        return {"input_ids": ids, "labels": ids.clone()}
    lengths = (7, 12, 5)
    ids = torch.randint(3, 97, (1, sum(lengths)), generator=gen)
    labels = ids.clone()
    labels[0, torch.tensor([0, 7, 19])] = -100
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def run(model: torch.nn.Module, inputs: dict, **extra) -> tuple[torch.Tensor, torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    out = model(**inputs, use_cache=False, **extra)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


def assert_match(got, want, tol: float) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=tol, atol=tol)
    torch.testing.assert_close(got[1], want[1], rtol=tol, atol=tol)
    assert got[2].keys() == want[2].keys()
    assert any("sinks" in n for n in want[2]) and any("gate_up_proj_bias" in n for n in want[2])
    for name in want[2]:
        torch.testing.assert_close(
            got[2][name], want[2][name], rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_eager_kernels_are_bitwise_upstream():
    upstream, ours = build_pair()
    attach_kernels(ours, resolve_kernels(OpsConfig(**EAGER)))
    want = run(upstream, batch(False))
    got = run(ours, batch(False))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(got[2][n], want[2][n]) for n in want[2])


SDPA_TORCH = dict(EAGER, attention="sdpa", moe_experts="torch")
SDPA_TRITON = dict(EAGER, attention="sdpa", moe_experts="triton", rope="triton", load_balancing_loss="triton")


@pytest.mark.parametrize(
    "ops, packed",
    [
        (EAGER, False),
        (EAGER, True),
        (SDPA_TORCH, True),
        pytest.param(SDPA_TRITON, False, marks=pytest.mark.triton_cpu),
    ],
    ids=["veomni_eager-batch", "veomni_eager-packed", "sdpa+torch-packed", "sdpa+triton-batch"],
)
def test_adapter_matches_upstream(ops, packed):
    upstream, ours = build_pair()
    apply_ops(ours, OpsConfig(**ops))
    assert ours.config._attn_implementation == f"veomni_{ops['attention']}"
    assert ours.config._experts_implementation == "veomni"
    inputs = batch(packed)
    if not packed:
        assert_match(run(ours, inputs), run(upstream, inputs), 2e-5)
        return
    # Upstream's eager masks do not keep attention inside documents of a packed row, so its oracle is each
    # document run on its own (no aux loss: it is a statistic of the whole row); ours reads the packing from the
    # cu_seq_lens a collator passes.
    extra = dict(packed_kwargs(inputs["position_ids"]), output_router_logits=False)
    assert_match(run(ours, inputs, **extra), run_per_document(upstream, inputs), 2e-5)


def run_per_document(model: torch.nn.Module, inputs: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Logits, loss and gradients of a packed row computed one document at a time (HF's loss: shifted labels,
    mean over the labelled tokens; the first token of each document is unlabelled, so no target crosses)."""
    model.zero_grad(set_to_none=True)
    starts = (inputs["position_ids"][0] == 0).nonzero().flatten().tolist() + [inputs["input_ids"].shape[1]]
    ids = inputs["input_ids"]
    logits = torch.cat(
        [
            model(input_ids=ids[:, a:b], use_cache=False).logits
            for a, b in zip(starts, starts[1:], strict=False)
        ],
        1,
    )
    labels = inputs["labels"][:, 1:]
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], labels[0], ignore_index=-100)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), loss.detach(), grads


def test_capability_check_refuses_backends_without_sinks_or_windows():
    # A third-party CPU backend with no optional features: building gpt_oss on it is refused, naming the ones
    # that have sinks and sliding windows.
    registry = KernelRegistry()
    for spec in KERNELS.specs():
        registry.register(spec.op, spec.variant, spec.backend, spec.factory, spec.requires, spec.description,
                          spec.capabilities)  # fmt: skip
    plain = KERNELS.get("attention", "default", "sdpa")
    registry.register("attention", "default", "plain_cpu", plain.factory, plain.requires, "no features")
    _, ours = build_pair()
    ops = OpsConfig(**dict(EAGER, attention="plain_cpu"), registry=registry)
    with pytest.raises(
        ValueError, match=r"gpt_oss .*needs \['sinks', 'sliding_window'\].*'plain_cpu'.*lacks"
    ) as err:
        apply_ops(ours, ops)
    assert "Backends with all of them: ['eager', 'flash_attn_4', 'flex', 'sdpa']" in str(err.value)


# ----- experts -----


def _experts_pair(seed: int = 0):
    config = tiny_config()
    torch.manual_seed(seed)
    upstream = UpstreamExperts(config)
    with torch.no_grad():
        for p in upstream.parameters():
            p.normal_(0.0, 0.7)
    return upstream, [p.detach().clone() for p in GPT_OSS_EXPERTS.tensors(upstream)]


@pytest.mark.parametrize("backend", ["eager", "torch", pytest.param("triton", marks=pytest.mark.triton_cpu)])
def test_clamped_experts_match_hf_forward_backward(backend):
    upstream, params = _experts_pair()
    gen = torch.Generator().manual_seed(2)
    tokens = 9
    hidden = torch.randn(tokens, 36, generator=gen) * 2
    index = torch.stack([torch.randperm(5, generator=gen)[:2] for _ in range(tokens)])
    index[3] = torch.tensor([4, 4])  # one token picks the same expert twice
    weights = torch.softmax(torch.randn(tokens, 2, generator=gen), -1)
    grad = torch.randn(tokens, 36, generator=gen)

    h_ref, w_ref = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
    upstream(h_ref, index, w_ref).backward(grad)
    kernel = KERNELS.get("moe_experts", "clamped_routed", backend).factory()
    h, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
    leaves = [p.clone().requires_grad_() for p in params]
    out = kernel(h, index, w, *leaves, limit=upstream.limit, alpha=upstream.alpha)
    out.backward(grad)
    torch.testing.assert_close(out.detach(), upstream(hidden, index, weights).detach(), rtol=1e-5, atol=1e-5)
    # The input gradient sums 2 experts x 36 products in another order than upstream's: one element in 324 came
    # out 2e-5 apart on a 2-core CI machine (fp32 rounding at these magnitudes).
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-5, atol=5e-5)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-5, atol=1e-4)
    for leaf, ref in zip(leaves, GPT_OSS_EXPERTS.tensors(upstream), strict=True):
        torch.testing.assert_close(leaf.grad, ref.grad, rtol=1e-5, atol=1e-4)


def test_generic_experts_kernels_refuse_gpt_oss_and_the_claim_is_explicit():
    config = tiny_config()
    ours, theirs = GptOssExperts(config), UpstreamExperts(config)
    # The generic contract refuses both classes, naming the flags.
    for module in (ours, theirs):
        problems = " ".join(experts_mismatches(module))
        assert "is_transposed: expected False" in problems and "has_bias: expected False" in problems
        assert "_apply_gate" in problems
    # Only the generated class is claimed: transformers' own copy (and any subclass) stays refused.
    assert EXPERTS_CLAIMS.get(GptOssExperts) is GPT_OSS_EXPERTS
    assert UpstreamExperts not in EXPERTS_CLAIMS
    upstream_model = UpstreamGptOss(config)
    with pytest.raises(ValueError, match=r"GptOssExperts at model\.layers\.0\.mlp\.experts and 1 more"):
        check_experts_modules(upstream_model, "triton")
    assert check_experts_modules(GptOssForCausalLM(config), "triton") == 2

    class Unclamped(GptOssExperts):
        def _apply_gate(self, gate_up):
            return torch.nn.functional.silu(gate_up[..., ::2]) * gate_up[..., 1::2]

    assert experts_mismatches(Unclamped(config))
    with pytest.raises(ValueError, match="is not \\(clamp\\(up\\) \\+ 1\\)"):
        claim_experts(Unclamped, GPT_OSS_EXPERTS)


def test_parallel_plan_covers_weights_and_biases():
    model = GptOssForCausalLM(tiny_config())
    plan = model.get_parallel_plan()
    matched = sorted(n for n, _ in model.named_parameters() if plan.matches(n))
    assert len(matched) == 8 and all(".mlp.experts." in n for n in matched)
    assert {n.rsplit(".", 1)[1] for n in matched} == set(GPT_OSS_EXPERTS.params)


def _ep_step(ctx, backend: str) -> float:
    from veomni.core.ep import apply_expert_plan

    upstream, ours = build_pair(num_local_experts=4)
    batches = [batch(False, seed=10 + r) for r in range(ctx.world_size)]
    # Oracle: the whole model on each rank's batch. Rank r's expert slices receive the gradient of every rank's
    # loss (tokens travel to their experts), its other parameters only that of its own loss.
    refs = [run(upstream, b) for b in batches]
    state = build_parallel_state(ParallelDims(dp_shard=ctx.world_size, ep=ctx.world_size), "cpu")
    shards = apply_expert_plan(ours, ours.get_parallel_plan(), ep_size=state.dims.ep, ep_rank=state.ep_rank)
    assert sorted(name.rsplit(".", 1)[1] for name in shards) == sorted(GPT_OSS_EXPERTS.params * 2)
    apply_ops(ours, OpsConfig(**dict(EAGER, attention="sdpa", moe_experts=backend)))
    with use_parallel_state(state):
        logits, loss, grads = run(ours, batches[ctx.rank])
    torch.testing.assert_close(loss, refs[ctx.rank][1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, refs[ctx.rank][0], rtol=1e-5, atol=1e-5)
    worst = 0.0
    for name, grad in grads.items():
        if name in shards:
            want = sum(r[2][name] for r in refs)[shards[name].start : shards[name].stop]
        else:
            want = refs[ctx.rank][2][name]
        worst = max(worst, float((grad - want).abs().max() / want.abs().max().clamp(min=1e-12)))
    return worst


@pytest.mark.triton_cpu
def test_expert_parallel_matches_the_whole_model(dist_pools):
    # Triton's clamped_grouped kernels (interpreted on CPU) on 2 of 4 experts per rank, biases sharded too; the
    # trainer grid (tests/train/test_loop.py) runs the torch kernels.
    for worst in dist_pools.get(2, "gloo").run(_ep_step, "triton"):
        assert worst < 1e-4


# ----- export, generate, MXFP4 -----


def test_export_round_trip_generates_like_ours(tmp_path):
    upstream, _ = build_pair()
    src, out = tmp_path / "src", tmp_path / "out"
    upstream.save_pretrained(src)
    ours = build_model(
        str(src), weights=str(src), ops=OpsConfig(**dict(EAGER, attention="sdpa", moe_experts="torch"))
    )
    assert type(ours) is GptOssForCausalLM and ours.config._attn_implementation == "veomni_sdpa"
    export_hf(ours, str(out))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["GptOssForCausalLM"] and "veomni" not in json.dumps(config)
    plain = UpstreamGptOss.from_pretrained(str(out), attn_implementation="eager").eval()
    ours.eval()
    prompt = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(4))
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        theirs_ids = plain.generate(prompt, **kwargs)
        our_ids = ours.generate(prompt, **kwargs)
        # The window (4) is shorter than the generated sequence, so decoding runs the windowed cached path.
        assert theirs_ids.shape[1] == 14
        assert torch.equal(our_ids, theirs_ids)
        torch.testing.assert_close(ours(theirs_ids).logits, plain(theirs_ids).logits, rtol=1e-5, atol=1e-5)


def test_registry_resolves_the_adapter_and_refuses_mxfp4(tmp_path):
    config = tiny_config()
    assert MODELS.model_class(config).cls is GptOssForCausalLM
    assert MODELS.entry("gpt_oss").fast_paths == {"sp", "ep", "fused_kernels"}
    # A published gpt-oss config.json carries an MXFP4 quantization_config.
    raw = config.to_dict()
    raw["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn"],
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(
        ValueError, match=r"(?s)'quant_method': 'mxfp4'.*Mxfp4Config\(dequantize=True\)"
    ) as err:
        build_model(str(tmp_path), ops=OpsConfig(**EAGER))
    assert "save_pretrained(DST)" in str(err.value)


def test_mxfp4_tensors_without_their_config_are_refused_as_quantized(tmp_path):
    # The published layout (experts as uint8 *_blocks / *_scales) beside no config.json: the tensors alone must say
    # "quantized, dequantise with Mxfp4Config", not a list of missing and unexpected keys.
    from safetensors.torch import load_file, save_file

    from veomni.models.loading.quantized import QuantizedCheckpointError

    upstream = build_pair()[0]
    upstream.save_pretrained(tmp_path / "bf16")
    tensors = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, rows = tensors.pop(key).shape[:2]
        tensors[key + "_blocks"] = torch.zeros(experts, rows, 2, 16, dtype=torch.uint8)
        tensors[key + "_scales"] = torch.zeros(experts, rows, 2, dtype=torch.uint8)
    (tmp_path / "bare").mkdir()
    save_file(tensors, str(tmp_path / "bare" / "model.safetensors"))
    with pytest.raises(
        QuantizedCheckpointError, match=r"(?s)8 MXFP4 tensors .*Mxfp4Config\(dequantize=True\)"
    ):
        build_model(tmp_path / "bf16", weights=tmp_path / "bare", ops=OpsConfig(**EAGER))
