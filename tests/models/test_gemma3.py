"""Gemma 3 specifics beyond the dense-adapter tables (test_dense_adapters.py, test_seq_cls*.py): the attention soft-cap
that upstream ignores is refused, the final logit soft-cap reaches every loss path, the swiglu guard refuses only an
explicit choice."""

from __future__ import annotations

import copy

import pytest
import torch
from test_dense_adapters import (
    DEVICE,
    EAGER_OPS,
    UpstreamGemma3,
    batch,
    build_pair,
    tiny_config,
)

from veomni.kernels import Hardware, OpsConfig, resolve_kernels
from veomni.models.gemma3.generated.patched_modeling_gemma3 import Gemma3ForCausalLM
from veomni.models.gemma3.guards import check_swiglu_choice
from veomni.models.hf.kernel_hooks import attach_kernels


def test_attention_softcap_is_refused_because_upstream_ignores_it():
    # The premise: transformers' Gemma 3 computes the same logits with and without the field set.
    logits = []
    for cap in (None, 0.01):
        torch.manual_seed(0)
        upstream = UpstreamGemma3(tiny_config("gemma3", attn_logit_softcapping=cap)).eval().to(DEVICE)
        logits.append(upstream(**batch()).logits)
    assert torch.equal(logits[0], logits[1])
    with pytest.raises(
        ValueError, match=r"attn_logit_softcapping=0.01, but transformers' Gemma 3 attention never"
    ):
        Gemma3ForCausalLM(tiny_config("gemma3", attn_logit_softcapping=0.01))


@pytest.mark.parametrize("ce", ["eager", "chunk_loss", "triton"])
def test_final_logit_softcap_reaches_every_loss_path(ce):
    # The tables' cap (0.5) bites: logits within it, and the loss differs from the uncapped model's (same weights).
    upstream, ours = build_pair("sdpa", "gemma3")
    attach_kernels(ours, resolve_kernels(OpsConfig(**{**EAGER_OPS, "cross_entropy": ce})))
    want = upstream(**batch())
    got = ours(**batch())
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=1e-6)
    assert float(want.logits.abs().max()) <= 0.5
    uncapped = copy.deepcopy(upstream)
    uncapped.config.final_logit_softcapping = None
    assert abs(float(uncapped(**batch()).loss - want.loss)) > 1e-3
    if ce == "eager":
        assert torch.equal(got.logits, want.logits)
    else:
        assert got.logits is None  # the fused loss took the cap itself


def test_swiglu_guard_refuses_only_an_explicit_choice():
    # The CUDA default (Triton SwiGLU) is the hardware's pick, not an instruction: Gemma 3's MLP just runs upstream.
    cuda = Hardware(device_type="cuda", capability=(9, 0))
    defaulted = OpsConfig(hardware=cuda)
    assert defaulted.swiglu == "triton" and "swiglu" in defaulted.defaulted

    class Bound:  # what check_swiglu_choice reads of a Kernels: its config
        def __init__(self, config: OpsConfig) -> None:
            self.config = config

    check_swiglu_choice(Bound(defaulted), "gelu_pytorch_tanh")
    check_swiglu_choice(Bound(OpsConfig(hardware=cuda, swiglu="eager")), "gelu_pytorch_tanh")
    with pytest.raises(ValueError, match=r"swiglu='triton' computes silu\(gate\) \* up"):
        check_swiglu_choice(Bound(OpsConfig(hardware=cuda, swiglu="triton")), "gelu_pytorch_tanh")
