"""LoRA on fused MoE experts (`veomni.models.lora.experts`, per-expert adapters inside the grouped-GEMM experts
kernels) against PEFT's ``target_parameters`` adapters on upstream transformers (fp32, CPU):

- forward and backward equal PEFT's ``get_peft_model`` of the upstream class with the same base weights and adapter
  values (logits, loss, every adapter gradient), on the eager and torch experts backends, for every MoE family of
  the conformance table;
- an adapter we save loads with ``peft.PeftModel.from_pretrained`` into plain upstream with our logits, and back
  into ours; a merged export loads with plain transformers as ``W[e] + scaling * B[e] @ A[e]``;
- target selection (the ``experts`` group, one projection by glob, bare names) and the refusals.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conformance_table import ROWS
from peft import PeftModel, get_peft_model, set_peft_model_state_dict
from test_conformance import EAGER_OPS, batch, build_ours, tiny_config, use_torch_fallback
from transformers import AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from veomni.kernels import OpsConfig
from veomni.models.export.hf import export_hf
from veomni.models.hf.kernel_hooks import apply_ops
from veomni.models.lora import (
    LoraSpec,
    apply_lora,
    init_lora,
    peft_config,
    peft_state_dict,
    save_peft_adapter,
)
from veomni.models.lora.experts import peft_expert_keys, to_peft_layout
from veomni.models.registry import config_for_class

MOE_TYPES = ["qwen3_moe", "deepseek_v3", "glm4_moe", "qwen3_next", "qwen3_5_moe_text"]
SPEC = LoraSpec(rank=4, alpha=8.0, targets=("experts", "attention"))


def pair(
    model_type: str, monkeypatch: pytest.MonkeyPatch, spec: LoraSpec, backend: str = "torch"
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(upstream transformers model, our adapted model) with equal base weights; LoRA applied before the kernels
    are bound, as `build_model` does; our adapters random (B = 0 would leave A's gradient untested)."""
    config = tiny_config(model_type, "eager")
    upstream_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    use_torch_fallback(monkeypatch, ROWS[model_type], upstream_class)
    ours = build_ours(model_type)
    upstream = upstream_class(config_for_class(copy.deepcopy(config), upstream_class))
    upstream.load_state_dict(ours.state_dict(), strict=True)
    apply_lora(ours, spec)
    apply_ops(ours, OpsConfig(**{**EAGER_OPS, "moe_experts": backend}))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in ours.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return upstream, ours


def peft_grads(model: torch.nn.Module, ours: bool) -> dict[str, torch.Tensor]:
    """Adapter gradients under PEFT's saved names and layout (ours converted)."""
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    if ours:
        for key, (peft_key, which) in peft_expert_keys(model).items():
            grads[peft_key] = to_peft_layout(grads.pop(key), which)
        return grads
    return {n.removeprefix("base_model.model.").replace(".default.", "."): g for n, g in grads.items()}


def step(model: torch.nn.Module, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    out = model(**inputs, use_cache=False)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach()


def _check_equal_peft(model_type: str, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    upstream, ours = pair(model_type, monkeypatch, SPEC, backend)
    assert any(k.endswith(".mlp.experts.gate_up_proj_lora_A") for k, _ in ours.named_parameters())
    peft_model = get_peft_model(upstream, peft_config(ours, SPEC))
    result = set_peft_model_state_dict(peft_model, peft_state_dict(ours))
    assert not [k for k in result.missing_keys if "lora_" in k] and not result.unexpected_keys
    inputs = {k: v for k, v in batch(rows=2).items() if k != "position_ids"}
    want, got = step(peft_model, inputs), step(ours, inputs)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)
    want_grads, got_grads = peft_grads(peft_model, ours=False), peft_grads(ours, ours=True)
    assert got_grads.keys() == want_grads.keys()
    assert any(".experts.base_layer.lora_A." in k for k in got_grads)
    for name, grad in want_grads.items():
        tol = 1e-5 * float(grad.abs().max()) + 1e-9
        torch.testing.assert_close(
            got_grads[name], grad, rtol=1e-4, atol=tol, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.parametrize("backend", [pytest.param("eager", marks=pytest.mark.slow), "torch"])
def test_qwen3_moe_forward_backward_equal_peft(backend, monkeypatch):
    _check_equal_peft("qwen3_moe", backend, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["eager", "torch"])
@pytest.mark.parametrize("model_type", MOE_TYPES[1:])
def test_moe_families_forward_backward_equal_peft(model_type, backend, monkeypatch):
    _check_equal_peft(model_type, backend, monkeypatch)


@pytest.mark.parametrize(
    "targets",
    [
        ("experts",),
        pytest.param(("model.layers.*.mlp.experts.down_proj",), marks=pytest.mark.slow),
        pytest.param(("experts", "attention", "q_proj"), marks=pytest.mark.slow),
    ],
)
def test_adapter_round_trip_through_peft(targets, monkeypatch, tmp_path):
    spec = LoraSpec(rank=2, alpha=6.0, targets=targets, use_rslora=True)
    upstream, ours = pair("qwen3_moe", monkeypatch, spec)
    base = copy.deepcopy(upstream.state_dict())
    inputs = {"input_ids": batch()["input_ids"]}
    with torch.no_grad():
        want = ours(**inputs, use_cache=False).logits
    save_peft_adapter(ours, spec, tmp_path)
    with torch.no_grad():
        got = PeftModel.from_pretrained(upstream, tmp_path)(**inputs, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    # ... and back into a fresh model of ours (base as saved, adapters read from the file).
    fresh_spec = LoraSpec(rank=2, alpha=6.0, targets=targets, use_rslora=True, init_from=str(tmp_path))
    _, fresh = pair("qwen3_moe", monkeypatch, fresh_spec)
    fresh.load_state_dict(base, strict=False)
    init_lora(fresh, fresh_spec, seed=0)
    with torch.no_grad():
        assert torch.equal(fresh(**inputs, use_cache=False).logits, want)


def test_merged_export_equals_base_plus_update(monkeypatch, tmp_path):
    _, ours = pair("qwen3_moe", monkeypatch, SPEC)
    export_hf(ours, tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    experts = ours.model.layers[1].mlp.experts
    for name in ("gate_up_proj", "down_proj"):
        a, b = getattr(experts, f"{name}_lora_A"), getattr(experts, f"{name}_lora_B")
        merged = getattr(experts, name) + SPEC.scaling * torch.bmm(b, a)
        torch.testing.assert_close(
            getattr(plain.model.layers[1].mlp.experts, name), merged.detach(), rtol=1e-6, atol=1e-6
        )
    assert not [k for k in plain.state_dict() if "lora_" in k]
    inputs = {"input_ids": batch()["input_ids"]}
    with torch.no_grad():
        torch.testing.assert_close(plain(**inputs).logits, ours(**inputs, use_cache=False).logits,
                                   rtol=1e-4, atol=1e-4)  # fmt: skip


@pytest.mark.parametrize(
    "model_type", [MOE_TYPES[0], *(pytest.param(t, marks=pytest.mark.slow) for t in MOE_TYPES[1:])]
)
def test_experts_group_selects_the_fused_projections(model_type):
    adapted = apply_lora(build_ours(model_type), LoraSpec(rank=2, targets=("experts",)))
    assert adapted and all(
        n.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")) for n in adapted
    )
    assert len(adapted) % 2 == 0


def test_selectors_of_projections():
    model = build_ours("qwen3_moe")
    # A bare "down_proj" names linear layers (PEFT's target_modules), not the experts' fused parameter.
    assert apply_lora(model, LoraSpec(targets=("down_proj",))) == ["model.layers.0.mlp.down_proj"]
    model = build_ours("qwen3_moe")
    chosen = apply_lora(
        model, LoraSpec(targets=("experts",), exclude=("model.layers.1.mlp.experts.gate_up_proj",))
    )
    assert chosen == [
        "model.layers.1.mlp.experts.down_proj",
        "model.layers.2.mlp.experts.gate_up_proj",
        "model.layers.2.mlp.experts.down_proj",
    ]
    assert model.model.layers[1].mlp.experts.lora_targets == ("down_proj",)


def test_refusals(monkeypatch):
    with pytest.raises(ValueError, match="lora.dropout=0.1 with fused experts targets"):
        apply_lora(build_ours("qwen3_moe"), LoraSpec(targets=("experts",), dropout=0.1))
    with pytest.raises(ValueError, match=r"GptOssExperts\) is not in the SwiGLU experts layout"):
        apply_lora(build_ours("gpt_oss"), LoraSpec(targets=("model.layers.*.mlp.experts",)))
    model = build_ours("qwen3_moe")
    apply_lora(model, SPEC)
    with pytest.raises(ValueError, match=r"moe_experts='triton' has no \['lora_grouped', 'lora_routed'\]"):
        apply_ops(model, OpsConfig(**{**EAGER_OPS, "moe_experts": "triton"}))
    # Without veomni's experts implementation, upstream's forward would drop the adapters: refused at the call.
    with pytest.raises(RuntimeError, match="only veomni's experts implementation applies"):
        model(input_ids=batch()["input_ids"], use_cache=False)


def test_a_defaulted_triton_backend_becomes_torch_for_lora_experts():
    from veomni.kernels.hardware import Hardware
    from veomni.models.hf.experts import fit_experts_backend

    model = build_ours("qwen3_moe")
    apply_lora(model, LoraSpec(targets=("experts",)))
    hopper = OpsConfig(hardware=Hardware(device_type="cuda", capability=(9, 0)))
    assert hopper.moe_experts == "triton" and "moe_experts" in hopper.defaulted
    assert fit_experts_backend(model, hopper).moe_experts == "torch"
    # torch._grouped_mm's sync-free path needs sm_90: older GPUs get the eager loop.
    ampere = OpsConfig(hardware=Hardware(device_type="cuda", capability=(8, 0)))
    assert fit_experts_backend(model, ampere).moe_experts == "eager"


@pytest.mark.slow
@pytest.mark.parametrize("which", ["qwen3_vl_moe", "qwen3_omni_moe"])
def test_vlm_language_model_experts_round_trip_through_peft(which, tmp_path):
    # The VLM / omni thinker classes: the experts sit under model.language_model, which PEFT's load conversion
    # must leave in place.
    from test_qwen3_omni_moe import pair as omni_pair
    from test_qwen3_vl_moe import build_pair as vl_pair

    upstream, ours = {"qwen3_vl_moe": vl_pair, "qwen3_omni_moe": omni_pair}[which]()
    apply_lora(ours, SPEC)
    apply_ops(ours, OpsConfig(**{**EAGER_OPS, "attention": "sdpa", "moe_experts": "torch"}))
    assert any(
        ".language_model.layers.1.mlp.experts.down_proj_lora_B" in n for n, _ in ours.named_parameters()
    )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ours.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    ids = torch.arange(3, 30)[None]
    with torch.no_grad():
        want = ours(input_ids=ids).logits
    save_peft_adapter(ours, SPEC, tmp_path)
    with torch.no_grad():
        got = PeftModel.from_pretrained(upstream, tmp_path)(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_compiled_blocks_trace_the_lora_experts_kernels():
    # fullgraph=True through the experts forward, its adapter check hook and the lora_routed torch kernel.
    from veomni.core.compile import compile_blocks
    from veomni.models.hf.output_capture import capture_into_compiled_block

    def adapted() -> torch.nn.Module:
        model = build_ours("qwen3_moe")
        apply_lora(model, SPEC)
        apply_ops(model, OpsConfig(moe_experts="torch", compile="off"))
        with torch.no_grad():
            for p in (p for p in model.parameters() if p.requires_grad):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
        return model

    eager, compiled = adapted(), adapted()
    compile_blocks(
        compiled, ("model.layers.*",), backend="aot_eager", call_context=capture_into_compiled_block
    )
    cu = torch.tensor([0, 7, 19, 24], dtype=torch.int32)
    inputs = {**batch(), "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 12, "max_length_k": 12}
    want, got = step(eager, inputs), step(compiled, inputs)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        if p.requires_grad:
            torch.testing.assert_close(
                q.grad, p.grad, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}"
            )
