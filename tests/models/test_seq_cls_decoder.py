"""The decoder inside every registered ``*ForSequenceClassification`` adapter is the generated module's patched base
model (upstream's ``GenericForSequenceClassification.__init__`` builds transformers' own through ``AutoModel``), so
the kernels reach it; with and without kernels the classifier equals upstream's (logits, loss, every gradient), and
checkpoints load and export under upstream's key names."""

from __future__ import annotations

import copy
import importlib
from collections import Counter

import pytest
import torch
import transformers
from safetensors import safe_open
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_next import modeling_qwen3_next

from veomni.core.ep import apply_expert_plan
from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import build_parallel_state, use_parallel_state
from veomni.kernels import OpsConfig
from veomni.models.build import build_model
from veomni.models.export.hf import export_hf
from veomni.models.heads.seq_cls import init_sequence_classifier
from veomni.models.hf.kernel_hooks import apply_ops
from veomni.models.registry import MODELS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, tie_word_embeddings=False,
)  # fmt: skip
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
GDN = dict(
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, head_dim=16, full_attention_interval=2,
)  # fmt: skip
# model_type -> (generated package, class prefix, config overrides). Hybrids: layer 0 Gated DeltaNet, layer 1 full
# attention (partial RoPE); Qwen3-Next with routed + shared experts.
FAMILIES = {
    "llama": ("llama", "Llama", {}),
    "qwen2": ("qwen2", "Qwen2", {}),
    "qwen3": ("qwen3", "Qwen3", {}),
    "seed_oss": ("seed_oss", "SeedOss", dict(attention_bias=True, mlp_bias=True)),
    "qwen3_moe": ("qwen3_moe", "Qwen3Moe", MOE),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3", dict(
        moe_intermediate_size=16, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, n_shared_experts=1, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=12,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
    )),
    "gpt_oss": ("gpt_oss", "GptOss", dict(
        num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    )),
    "qwen3_next": ("qwen3_next", "Qwen3Next", dict(
        **MOE, **GDN, shared_expert_intermediate_size=16, partial_rotary_factor=0.25,
        mlp_only_layers=[],
    )),
    "qwen3_5_text": ("qwen3_5", "Qwen3_5Text", dict(**GDN, rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25, mrope_section=[1, 1, 0],
        mrope_interleaved=True,
    ))),
}  # fmt: skip
HYBRIDS = ("qwen3_next", "qwen3_5_text")
MOES = ("qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_next")
# Every op eager but attention (veomni's sdpa entry), so the hardware defaults (the fused CE on CUDA) stay out.
EAGER_OPS = dict(
    attention="sdpa", rms_norm="eager", rope="eager", swiglu="eager", cross_entropy="eager", moe_experts="eager",
    load_balancing_loss="eager", gated_delta_rule="eager", causal_conv1d="eager", rms_norm_gated="eager",
)  # fmt: skip
# The decoder's kernels on every host (Triton through its interpreter on CPU); RMSNorm and the experts' grouped GEMMs
# through their torch backends (their Triton kernels have their own parity tests; the interpreter is slow).
KERNEL_OPS = {**EAGER_OPS, "rms_norm": "torch", "rope": "triton", "swiglu": "triton", "cross_entropy": "triton",
              "moe_experts": "torch"}  # fmt: skip


@pytest.fixture(autouse=True)
def torch_fallback(monkeypatch):
    # As in test_qwen3_next: upstream sends its Gated DeltaNet to fla (CUDA-only) whenever fla is installed, and the
    # upstream hybrids here run on CPU tensors.
    for module in (modeling_qwen3_next, modeling_qwen3_5):
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                     "causal_conv1d_update"):  # fmt: skip
            fn = getattr(module, name)
            monkeypatch.setattr(module, name, getattr(fn, "__wrapped__", fn))


def _config(model_type: str, num_labels: int = 3) -> transformers.PreTrainedConfig:
    _, _, extra = FAMILIES[model_type]
    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **extra}, num_labels=num_labels)
    # transformers' gpt-oss has no sdpa path (sinks): its upstream twin runs eager attention.
    config._attn_implementation = "eager" if model_type == "gpt_oss" else "sdpa"
    if model_type in MOES:
        config._experts_implementation = "eager"
    return config


def _generated(model_type: str):
    package, _, _ = FAMILIES[model_type]
    return importlib.import_module(f"veomni.models.{package}.generated.patched_modeling_{package}")


def _upstream_class(model_type: str) -> type:
    return getattr(transformers, f"{FAMILIES[model_type][1]}ForSequenceClassification")


def _pair(model_type: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    config = _config(model_type)
    torch.manual_seed(0)
    upstream = _upstream_class(model_type)(copy.deepcopy(config)).eval()
    with torch.no_grad():  # the hybrids zero-initialise their (1 + w) norms: random ones exercise that path
        for name, p in upstream.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0, 0.1)
    ours = getattr(_generated(model_type), f"{FAMILIES[model_type][1]}ForSequenceClassification")(config).eval()
    missing, unexpected = ours.load_state_dict(upstream.state_dict(), strict=True)
    assert not missing and not unexpected
    return upstream.to(DEVICE), ours.to(DEVICE)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 96, (3, 10), generator=gen)
    ids[1, 7:] = 0  # right padding: pooled at position 6
    labels = torch.tensor([2, 0, -100])  # one unlabelled row
    return ids.to(DEVICE), labels.to(DEVICE)


def _run(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_decoder_is_the_generated_base_model_and_eager_is_bitwise_upstream(model_type):
    module = _generated(model_type)
    prefix = FAMILIES[model_type][1]
    # Built as transformers builds it: the same seed gives the same initial weights (same modules, same order).
    # Qwen3-Next's generated base model draws its router weights differently from upstream's (so does its
    # ForCausalLM: an adapter matter, not the classifier's), so its decoder is held to veomni's own base model.
    config = _config(model_type)
    torch.manual_seed(5)
    if model_type == "qwen3_next":
        base = getattr(module, f"{prefix}Model")(copy.deepcopy(config)).state_dict()
        want = {f"model.{k}": v for k, v in base.items()}
    else:
        want = _upstream_class(model_type)(copy.deepcopy(config)).state_dict()
    torch.manual_seed(5)
    got = getattr(module, f"{prefix}ForSequenceClassification")(config).state_dict()
    assert [k for k in got if k in want] == list(want)
    assert all(torch.equal(got[k], v) for k, v in want.items())
    upstream, ours = _pair(model_type)
    assert MODELS.model_class(ours.config, "sequence_classification").cls is type(ours)
    base = getattr(module, f"{prefix}Model")
    assert type(ours.model) is base and type(upstream.model) is not base
    # No module of the classifier is transformers' modeling class (those ignore the attached kernels).
    upstream_modules = sorted({type(m).__name__ for m in ours.modules() if type(m).__module__.startswith(
        "transformers.models.")})  # fmt: skip
    assert upstream_modules == []
    assert list(ours.state_dict()) == list(upstream.state_dict())
    ids, labels = _batch()
    want, got = _run(upstream, ids, labels), _run(ours, ids, labels)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[2].keys() == want[2].keys()
    assert all(torch.equal(got[2][n], g) for n, g in want[2].items())


def _spy(kernels, fields: tuple[str, ...]) -> Counter:
    # Count the calls of every variant of these ops in the model's own kernel set (per instance: no global patch).
    calls: Counter = Counter()

    def counted(key, fn):
        def wrapper(*args, **kwargs):
            calls[key[0]] += 1
            return fn(*args, **kwargs)

        return wrapper

    table = {k: counted(k, fn) if k[0] in fields else fn for k, fn in kernels._table.items()}
    object.__setattr__(kernels, "_table", table)
    return calls


def _module_calls(model: torch.nn.Module, suffix: str) -> Counter:
    # How often the decoder's RMSNorm / attention modules run, from forward hooks (class names end with `suffix`).
    calls: Counter = Counter()
    for m in model.modules():
        if type(m).__name__.endswith(suffix):
            m.register_forward_hook(lambda *_: calls.update([suffix]))
    return calls


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_kernels_reach_the_decoder_and_match_upstream(model_type):
    upstream, ours = _pair(model_type)
    kernels = apply_ops(ours, OpsConfig(**KERNEL_OPS))
    calls = _spy(kernels, ("rms_norm", "rope", "swiglu", "cross_entropy"))
    norms, attentions = _module_calls(ours, "RMSNorm"), _module_calls(ours, "Attention")
    ids, labels = _batch()
    want, got = _run(upstream, ids, labels), _run(ours, ids, labels)
    # Every attention's rotary and (where the family patches it: not gpt-oss) every RMSNorm went through a kernel.
    assert calls["rope"] == attentions["Attention"] > 0
    if model_type != "gpt_oss":
        assert calls["rms_norm"] == norms["RMSNorm"] > 0
    if model_type not in ("gpt_oss", "qwen3_moe"):  # every layer here is routed experts only (no SwiGLU module)
        assert calls["swiglu"] > 0
    assert calls["cross_entropy"] == 1
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    assert got[2].keys() == want[2].keys()
    for name, grad in want[2].items():
        torch.testing.assert_close(got[2][name], grad, rtol=1e-4, atol=1e-5 * float(grad.abs().max()) + 1e-7,
                                   msg=lambda m, n=name: f"{n}: {m}")  # fmt: skip


def _keys(directory) -> set[str]:
    keys: set[str] = set()
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            keys |= set(f.keys())
    return keys


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_checkpoint_loads_and_exports_under_upstream_keys(tmp_path, model_type):
    src, out = tmp_path / "src", tmp_path / "out"
    upstream, _ = _pair(model_type)
    upstream.cpu().save_pretrained(src)
    model = build_model(
        str(src), weights=str(src), ops=OpsConfig(**EAGER_OPS), task="sequence_classification"
    ).eval()
    module = _generated(model_type)
    prefix = FAMILIES[model_type][1]
    assert type(model) is getattr(module, f"{prefix}ForSequenceClassification")
    assert type(model.model) is getattr(module, f"{prefix}Model")
    export_hf(model, out)
    assert _keys(out) == _keys(src) and "score.weight" in _keys(out)
    reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert type(reloaded) is _upstream_class(model_type)
    ids, _ = _batch()
    ids = ids.cpu()
    with torch.no_grad():
        want = upstream.cpu()(input_ids=ids).logits
        assert torch.equal(model.cpu()(input_ids=ids).logits, want)
        assert torch.equal(reloaded(input_ids=ids).logits, want)


def test_init_sequence_classifier_refuses_a_mismatched_config_or_class():
    module = _generated("qwen3")
    with pytest.raises(TypeError, match="the base model Qwen3Model takes a Qwen3Config, got LlamaConfig"):
        module.Qwen3ForSequenceClassification(_config("llama"))
    with pytest.raises(TypeError, match="expects a GenericForSequenceClassification subclass, got Qwen3Model"):
        init_sequence_classifier(module.Qwen3Model(_config("qwen3")), _config("qwen3"), module.Qwen3Model)


def _sp_refusal_case(ctx) -> str:
    state = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type)
    _, ours = _pair("qwen3")
    apply_ops(ours, OpsConfig(**EAGER_OPS))
    ids, labels = _batch()
    with use_parallel_state(state), pytest.raises(NotImplementedError) as err:
        ours(input_ids=ids[:, :5], labels=labels)
    return str(err.value)


@pytest.mark.slow  # starting the two-rank pool dominates (shared with other tests in a full run)
def test_ulysses_sp_is_refused_not_pooled_from_a_slice(dist_pools):
    for message in dist_pools.get(2).run(_sp_refusal_case):
        assert "under Ulysses sequence parallelism (sp=2)" in message and "with sp=1" in message


def _ep_case(ctx) -> dict:
    # Each rank classifies its own batch with half of the experts; the oracle is the whole model on every batch.
    # Under EP, rank r's expert slices get the gradient of every rank's loss, its other parameters only its own.
    upstream, ours = _pair("qwen3_moe")
    batches = []
    for r in range(ctx.world_size):
        ids = torch.randint(1, 96, (2, 8), generator=torch.Generator().manual_seed(10 + r))
        batches.append((ids, torch.tensor([r % 3, 2])))
    ref = [_run(upstream, ids, labels) for ids, labels in batches]
    plan = ours.get_parallel_plan()
    state = build_parallel_state(ParallelDims(dp_shard=ctx.world_size, ep=ctx.world_size), ctx.device_type)
    shards = apply_expert_plan(ours, plan, ep_size=state.dims.ep, ep_rank=state.ep_rank)
    apply_ops(ours, OpsConfig(**{**EAGER_OPS, "moe_experts": "torch"}))
    with use_parallel_state(state):
        logits, loss, grads = _run(ours, *batches[ctx.rank])
    worst = 0.0
    for name, grad in grads.items():
        if name in shards:
            want = sum(r[2][name] for r in ref)[shards[name].start : shards[name].stop]
        else:
            want = ref[ctx.rank][2][name]
        worst = max(worst, float((grad - want).abs().max() / want.abs().max().clamp(min=1e-12)))
    return {
        "sharded": sorted(shards),
        "logits": float((logits - ref[ctx.rank][0]).abs().max()),
        "loss": float((loss - ref[ctx.rank][1]).abs()),
        "worst_grad_rel": worst,
    }


@pytest.mark.slow  # the two-rank pool (shared with the SP test above)
def test_moe_classifier_under_expert_parallelism_matches_the_whole_model(dist_pools):
    for result in dist_pools.get(2).run(_ep_case):
        assert result["sharded"] == sorted(
            f"model.layers.{i}.mlp.experts.{n}" for i in (0, 1) for n in ("down_proj", "gate_up_proj")
        )
        assert result["logits"] < 1e-5 and result["loss"] < 1e-6 and result["worst_grad_rel"] < 1e-4, result


@pytest.mark.cuda
@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_cuda_defaults_in_bf16_track_upstream_fp32(model_type):
    # The CUDA hardware defaults (Triton RMSNorm / RoPE / SwiGLU / CE / experts) on a bf16 classifier, against
    # upstream in fp32 (attention sdpa on both sides: no optional package needed).
    upstream, ours = _pair(model_type)
    ours = ours.to(torch.bfloat16)
    kernels = apply_ops(ours, OpsConfig(attention="sdpa"))
    assert kernels.config.rms_norm != "eager" and kernels.config.cross_entropy != "eager"
    calls = _spy(kernels, ("rope", "cross_entropy"))
    ids, labels = _batch()
    want, got = _run(upstream, ids, labels), _run(ours, ids, labels)
    assert calls["rope"] > 0 and calls["cross_entropy"] == 1
    torch.testing.assert_close(got[0].float(), want[0], rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(got[1].float(), want[1], rtol=5e-2, atol=5e-2)
    for name in ("score.weight", "model.embed_tokens.weight"):
        rel = (got[2][name].float() - want[2][name]).norm() / want[2][name].norm()
        assert rel < 5e-2, (name, float(rel))
