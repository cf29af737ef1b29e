"""LoRA (`veomni.models.lora`) against PEFT itself, on the conformance suite's tiny configs (fp32, CPU):

- forward and backward of our adapted model equal PEFT's ``get_peft_model`` of upstream transformers' class with
  the same base weights and adapter values (logits, loss, every adapter gradient);
- an adapter we save loads with ``peft.PeftModel.from_pretrained`` into plain upstream and gives our logits, and
  loads back into ours (hypothesis over rank, alpha, rsLoRA, targets, modules to save);
- a merged export loads with plain transformers as ``W + scaling * B @ A`` and gives our logits;
- training steps leave the base bit-identical; every family declares target groups that select layers.
"""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
from conformance_table import ROWS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peft import PeftModel, get_peft_model, set_peft_model_state_dict
from test_conformance import EAGER_OPS, batch, build_ours, tiny_config, use_torch_fallback
from transformers import AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from veomni.kernels import OpsConfig
from veomni.models.export.hf import export_hf
from veomni.models.families import lora_targets
from veomni.models.hf.kernel_hooks import apply_ops
from veomni.models.lora import (
    LoraSpec,
    adapted_layers,
    apply_lora,
    gather_trainable,
    init_lora,
    load_peft_adapter,
    peft_config,
    peft_state_dict,
    save_peft_adapter,
)
from veomni.models.registry import config_for_class

PARITY_TYPES = ["qwen3", "deepseek_v3", "qwen3_next", "gemma3_text"]


def pair(model_type: str, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(upstream transformers model, our adapter) with equal weights, eager kernels."""
    config = tiny_config(model_type, "eager")
    upstream_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    use_torch_fallback(monkeypatch, ROWS[model_type], upstream_class)
    ours = build_ours(model_type)
    apply_ops(ours, OpsConfig(**EAGER_OPS))
    upstream = upstream_class(config_for_class(copy.deepcopy(config), upstream_class))
    upstream.load_state_dict(ours.state_dict(), strict=True)
    return upstream, ours


def randomise_adapters(model: torch.nn.Module, seed: int = 3) -> None:
    # The default init zeroes B, which would leave A's gradient and the branch's output untested.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in adapted_layers(model).values():
            for w in (layer.lora_A.weight, layer.lora_B.weight):
                w.copy_(torch.randn(w.shape, generator=gen) * 0.05)


def peft_of(upstream: torch.nn.Module, ours: torch.nn.Module, spec: LoraSpec) -> torch.nn.Module:
    """PEFT's model of ``upstream`` for our adapted layers, holding our adapter values."""
    peft_model = get_peft_model(upstream, peft_config(ours, spec))
    result = set_peft_model_state_dict(peft_model, peft_state_dict(ours))
    assert not [k for k in result.missing_keys if "lora_" in k]
    return peft_model


def forward_backward(model: torch.nn.Module, inputs: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    out = model(**inputs, use_cache=False)
    out.loss.backward()
    # PEFT names adapters lora_A.default.weight and prefixes base_model.model.: compare by our names.
    grads = {
        n.removeprefix("base_model.model.").replace(".default.", "."): p.grad.clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    return out.logits.detach(), out.loss.detach(), grads


@pytest.mark.parametrize("model_type", PARITY_TYPES)
def test_forward_backward_equal_peft(model_type, monkeypatch):
    upstream, ours = pair(model_type, monkeypatch)
    spec = LoraSpec(rank=4, alpha=8.0)
    adapted = apply_lora(ours, spec)
    assert adapted, "the family's default groups selected nothing"
    randomise_adapters(ours)
    peft_model = peft_of(upstream, ours, spec)
    inputs = {k: v for k, v in batch(rows=2).items() if k != "position_ids"}
    want, got = forward_backward(peft_model, inputs), forward_backward(ours, inputs)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)
    assert got[2].keys() == want[2].keys() and all("lora_" in n for n in got[2])
    assert len(got[2]) == 2 * len(adapted)
    for name, grad in want[2].items():
        torch.testing.assert_close(got[2][name], grad, rtol=1e-5, atol=1e-6 * float(grad.abs().max()) + 1e-9)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rank=st.sampled_from([1, 2, 4]),
    alpha=st.sampled_from([1.0, 4.0, 16.0]),
    rslora=st.booleans(),
    targets=st.sampled_from([(), ("attention",), ("q_proj", "v_proj"), ("model.layers.0.mlp.down_proj",)]),
    save_head=st.booleans(),
)
def test_adapter_round_trip_through_peft(rank, alpha, rslora, targets, save_head, monkeypatch):
    upstream, ours = pair("qwen3", monkeypatch)
    base_state = copy.deepcopy(upstream.state_dict())
    spec = LoraSpec(rank=rank, alpha=alpha, use_rslora=rslora, targets=targets,
                    modules_to_save=("lm_head",) if save_head else ())  # fmt: skip
    apply_lora(ours, spec)
    randomise_adapters(ours)
    if save_head:
        with torch.no_grad():
            ours.lm_head.weight.add_(0.01)
    inputs = {"input_ids": batch()["input_ids"]}
    with torch.no_grad():
        want = ours(**inputs, use_cache=False).logits
    with tempfile.TemporaryDirectory() as d:
        save_peft_adapter(ours, spec, d)
        loaded = PeftModel.from_pretrained(upstream, d)
        with torch.no_grad():
            got = loaded(**inputs, use_cache=False).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

        # ... and back into a fresh model of ours (zero-initialised adapters, base as saved).
        _, fresh = pair("qwen3", monkeypatch)
        fresh.load_state_dict(base_state)
        fresh_spec = LoraSpec(rank=rank, alpha=alpha, use_rslora=rslora, targets=targets, init="zeros",
                              modules_to_save=spec.modules_to_save, init_from=d)  # fmt: skip
        apply_lora(fresh, fresh_spec)
        init_lora(fresh, fresh_spec, seed=0)
        with torch.no_grad():
            assert torch.equal(fresh(**inputs, use_cache=False).logits, want)


def test_merged_export_equals_base_plus_update(monkeypatch, tmp_path):
    upstream, ours = pair("qwen3", monkeypatch)
    spec = LoraSpec(rank=4, alpha=8.0, targets=("attention", "mlp"))
    apply_lora(ours, spec)
    randomise_adapters(ours)
    export_hf(ours, tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    layer = ours.model.layers[0].self_attn.q_proj
    merged = layer.weight + spec.scaling * layer.lora_B.weight @ layer.lora_A.weight
    torch.testing.assert_close(plain.model.layers[0].self_attn.q_proj.weight, merged.detach(), rtol=0, atol=0)
    assert not [k for k in plain.state_dict() if "lora_" in k]
    inputs = {"input_ids": batch()["input_ids"]}
    with torch.no_grad():
        torch.testing.assert_close(plain(**inputs).logits, ours(**inputs, use_cache=False).logits,
                                   rtol=1e-4, atol=1e-4)  # fmt: skip


def test_training_changes_only_the_adapters(monkeypatch):
    _, ours = pair("qwen3", monkeypatch)
    spec = LoraSpec(rank=4, alpha=8.0)
    apply_lora(ours, spec)
    init_lora(ours, spec, seed=5)
    before = {n: p.detach().clone() for n, p in ours.named_parameters()}
    trained = [p for p in ours.parameters() if p.requires_grad]
    assert trained and all(n.endswith(("lora_A.weight", "lora_B.weight"))
                           for n, p in ours.named_parameters() if p.requires_grad)  # fmt: skip
    opt = torch.optim.AdamW(trained, lr=1e-2)
    inputs = {k: v for k, v in batch(rows=2).items() if k != "position_ids"}
    for _ in range(3):
        opt.zero_grad()
        ours(**inputs, use_cache=False).loss.backward()
        opt.step()
    changed = {n for n, p in ours.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {n for n, p in ours.named_parameters() if p.requires_grad}


def test_init_is_seeded_and_starts_at_the_base(monkeypatch):
    _, a = pair("qwen3", monkeypatch)
    _, b = pair("qwen3", monkeypatch)
    inputs = {"input_ids": batch()["input_ids"]}
    with torch.no_grad():
        base = a(**inputs, use_cache=False).logits
    spec = LoraSpec(rank=4)
    for m in (a, b):
        apply_lora(m, spec)
        init_lora(m, spec, seed=11)
    assert all(
        torch.equal(x, y)
        for x, y in zip(gather_trainable(a).values(), gather_trainable(b).values(), strict=True)
    )
    with torch.no_grad():
        assert torch.equal(a(**inputs, use_cache=False).logits, base)  # B = 0


@pytest.mark.parametrize("model_type", sorted(ROWS))
def test_family_default_groups_select_layers(model_type):
    declared = lora_targets(tiny_config(model_type).model_type)
    assert declared is not None, f"{model_type}'s family declares no LoRA targets"
    model = build_ours(model_type)
    adapted = apply_lora(model, LoraSpec(rank=2))
    assert any(".self_attn." in n or ".linear_attn." in n for n in adapted)
    assert not any("lm_head" in n or n.endswith(".gate") for n in adapted)


def test_bad_targets_and_tied_modules_are_refused(monkeypatch):
    _, ours = pair("qwen3", monkeypatch)
    with pytest.raises(ValueError, match=r"'qq_proj' selects nothing.*matches no module name"):
        apply_lora(ours, LoraSpec(targets=("qq_proj",)))
    with pytest.raises(ValueError, match=r"'model.norm' selects nothing.*Qwen3RMSNorm"):
        apply_lora(ours, LoraSpec(targets=("model.norm",)))
    tied = build_ours("qwen3", tie_word_embeddings=True)
    tied.tie_weights()
    with pytest.raises(ValueError, match="tied embeddings"):
        apply_lora(tied, LoraSpec(modules_to_save=("lm_head",)))


def test_importing_an_adapter_of_another_rank_is_refused(monkeypatch, tmp_path):
    _, ours = pair("qwen3", monkeypatch)
    spec = LoraSpec(rank=4)
    apply_lora(ours, spec)
    save_peft_adapter(ours, spec, tmp_path)
    _, other = pair("qwen3", monkeypatch)
    other_spec = LoraSpec(rank=8, init_from=str(tmp_path))
    apply_lora(other, other_spec)
    with pytest.raises(ValueError, match=r"rank \(r\): ours 8, the adapter's 4"):
        load_peft_adapter(other, other_spec, tmp_path)
