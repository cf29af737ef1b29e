"""Sequence classification through the cross_entropy registry equals upstream HF, and a fused CE is refused for a
forward that veomni did not patch (token classification) instead of silently doing nothing."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
import transformers

from veomni.kernels import Hardware, OpsConfig
from veomni.models.heads.seq_cls import check_loss_dispatch, loss_dispatch
from veomni.models.hf.kernel_hooks import apply_ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EAGER_OPS = dict(rms_norm="eager", rope="eager", swiglu="eager", attention="sdpa")
TINY = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0,
)  # fmt: skip
# model_type -> (generated module, class prefix, config overrides)
FAMILIES = {
    "llama": ("llama", "Llama", {}),
    "qwen2": ("qwen2", "Qwen2", {}),
    "qwen3": ("qwen3", "Qwen3", {}),
    "seed_oss": ("seed_oss", "SeedOss", {}),
    "qwen3_moe": (
        "qwen3_moe",
        "Qwen3Moe",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    ),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3", dict(
        moe_intermediate_size=16, first_k_dense_replace=0, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, n_shared_experts=1, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=12,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
    )),
    "gpt_oss": ("gpt_oss", "GptOss", dict(
        num_local_experts=4, num_experts_per_tok=2, sliding_window=4, layer_types=["sliding_attention"],
    )),
}  # fmt: skip


def _pair(model_type: str, num_labels: int = 3):
    module, prefix, extra = FAMILIES[model_type]
    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **extra}, num_labels=num_labels)
    upstream_cls = getattr(transformers, f"{prefix}ForSequenceClassification")
    ours_mod = importlib.import_module(f"veomni.models.{module}.generated.patched_modeling_{module}")
    torch.manual_seed(0)
    upstream = upstream_cls(copy.deepcopy(config)).eval().to(DEVICE)
    ours = getattr(ours_mod, f"{prefix}ForSequenceClassification")(config).eval().to(DEVICE)
    ours.load_state_dict(upstream.state_dict(), strict=True)
    return upstream, ours


def _batch(num_labels: int = 3):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 96, (4, 10), generator=gen)
    ids[1, 7:] = 0  # right padding
    ids[2, :3] = 0  # left padding
    labels = torch.randint(0, num_labels, (4,), generator=gen)
    labels[3] = -100  # an unlabelled row
    return ids.to(DEVICE), labels.to(DEVICE)


def _loss_and_grads(model, ids, labels):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.logits.detach(), grads


# chunk_loss for every family here; the Triton CE (with the decoder's kernels) for every family in
# test_seq_cls_decoder.py, once qwen3 here.
CASES = [(m, "chunk_loss") for m in sorted(FAMILIES)] + [("qwen3", "triton")]


@pytest.mark.parametrize(("model_type", "ce"), CASES)
def test_seq_cls_loss_through_the_registry_equals_upstream(model_type, ce):
    upstream, ours = _pair(model_type)
    apply_ops(ours, OpsConfig(**EAGER_OPS, cross_entropy=ce, moe_experts="eager"))
    assert loss_dispatch(ours) == "veomni"
    ids, labels = _batch()
    want = _loss_and_grads(upstream, ids, labels)
    got = _loss_and_grads(ours, ids, labels)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-4, atol=1e-6, msg=name)


def test_kernel_is_what_computes_the_loss():
    # A kernel that returns a marker proves the patched forward calls kernels.get("cross_entropy", "seq_cls").
    _, ours = _pair("qwen3")
    kernels = apply_ops(ours, OpsConfig(**EAGER_OPS, cross_entropy="chunk_loss"))
    calls = []

    def marker(hidden, weight, labels, **kw):
        calls.append((tuple(hidden.shape), tuple(weight.shape), tuple(labels.shape)))
        return hidden.sum() * 0 + 42.0, torch.tensor(2, device=hidden.device)

    object.__setattr__(kernels, "_table", {**kernels._table, ("cross_entropy", "seq_cls"): marker})
    ids, labels = _batch()
    assert ours(input_ids=ids, labels=labels).loss.item() == 21.0
    assert calls == [((4, 32), (3, 32), (4,))]


def test_regression_and_eager_keep_upstream_loss():
    upstream, ours = _pair("qwen3", num_labels=1)
    apply_ops(ours, OpsConfig(**EAGER_OPS, cross_entropy="chunk_loss"))
    ids, _ = _batch()
    targets = torch.randn(4, device=DEVICE)
    torch.testing.assert_close(
        ours(input_ids=ids, labels=targets).loss, upstream(input_ids=ids, labels=targets).loss
    )
    upstream, ours = _pair("llama")
    apply_ops(ours, OpsConfig(**EAGER_OPS, cross_entropy="eager"))
    ids, labels = _batch()
    assert torch.equal(ours(input_ids=ids, labels=labels).loss, upstream(input_ids=ids, labels=labels).loss)


def test_fused_ce_on_an_unpatched_forward_is_an_error_and_a_default_becomes_eager():
    config = transformers.AutoConfig.for_model("qwen3", **TINY, num_labels=3)
    mod = importlib.import_module("veomni.models.qwen3.generated.patched_modeling_qwen3")
    token_cls = mod.Qwen3ForTokenClassification(config)
    assert loss_dispatch(token_cls) == "upstream"
    with pytest.raises(
        ValueError, match=r"cross_entropy='chunk_loss', but Qwen3ForTokenClassification's forward"
    ):
        apply_ops(token_cls, OpsConfig(**EAGER_OPS, cross_entropy="chunk_loss"))
    # Defaulted (the CUDA default is the fused triton CE): eager for this model, `defaulted` kept.
    ops = OpsConfig(hardware=Hardware(device_type="cuda", capability=(9, 0)))
    assert ops.cross_entropy == "triton" and "cross_entropy" in ops.defaulted
    fixed = check_loss_dispatch(token_cls, ops)
    assert fixed.cross_entropy == "eager" and fixed.defaulted == ops.defaulted
    # A base model computes no loss: nothing to refuse.
    assert loss_dispatch(mod.Qwen3Model(config)) == "none"
    assert check_loss_dispatch(mod.Qwen3Model(config), ops) is ops
    assert loss_dispatch(mod.Qwen3ForCausalLM(config)) == "veomni"


def test_experts_backend_without_the_models_variants_is_refused_or_made_eager():
    # gpt-oss's experts need the clamped_* kernels; the npu backend (NPU default) has none, the qwen3_moe ones it has.
    import attrs

    from veomni.kernels import KERNELS, KernelRegistry
    from veomni.models.hf.experts import fit_experts_backend

    reg = KernelRegistry()  # the registry as an NPU host with torch_npu sees it
    for s in KERNELS.specs():
        requires = attrs.evolve(s.requires, packages=()) if s.backend == "npu" else s.requires
        reg.register(s.op, s.variant, s.backend, s.factory, requires, s.description, s.capabilities)
    npu = Hardware(device_type="npu")

    def causal_lm(model_type):
        module, prefix, extra = FAMILIES[model_type]
        config = transformers.AutoConfig.for_model(model_type, **{**TINY, **extra})
        mod = importlib.import_module(f"veomni.models.{module}.generated.patched_modeling_{module}")
        return getattr(mod, f"{prefix}ForCausalLM")(config)

    gpt_oss = causal_lm("gpt_oss")
    ops = OpsConfig(hardware=npu, registry=reg)
    assert ops.moe_experts == "npu"
    fixed = fit_experts_backend(gpt_oss, ops)
    assert fixed.moe_experts == "eager" and fixed.defaulted == ops.defaulted
    with pytest.raises(
        ValueError, match=r"moe_experts='npu' has no \['clamped_grouped', 'clamped_routed'\] kernels"
    ):
        fit_experts_backend(gpt_oss, OpsConfig(hardware=npu, registry=reg, moe_experts="npu"))
    assert fit_experts_backend(causal_lm("qwen3_moe"), ops) is ops
