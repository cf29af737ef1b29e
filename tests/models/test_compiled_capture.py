"""transformers' output capture inside compiled MoE blocks: router logits recorded once per layer, the
load-balancing loss and gradients equal to eager, no recompile, and the collector's ContextVar never read while
dynamo traces (torch <= 2.11 cannot trace ``ContextVar.get``)."""

from __future__ import annotations

import contextvars
import copy

import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers.utils import output_capturing

from veomni.core.compile import compile_blocks
from veomni.kernels import OpsConfig
from veomni.kernels.hardware import Hardware
from veomni.models.hf.kernel_hooks import apply_ops
from veomni.models.hf.output_capture import capture_into_compiled_block
from veomni.models.qwen3_moe.generated.patched_modeling_qwen3_moe import Qwen3MoeForCausalLM

LAYERS = 2


class _UntraceableVar:
    """A ContextVar stand-in that fails when dynamo traces a read, as torch 2.11's dynamo does."""

    def __init__(self) -> None:
        self.var: contextvars.ContextVar = contextvars.ContextVar("probe", default=None)

    def get(self):  # noqa: ANN201
        if torch.compiler.is_compiling():
            raise RuntimeError("the output collector's ContextVar was read inside a compiled region")
        return self.var.get()

    def set(self, value):  # noqa: ANN001, ANN201
        return self.var.set(value)

    def reset(self, token) -> None:  # noqa: ANN001
        self.var.reset(token)


@pytest.fixture
def untraceable_collector(monkeypatch):
    monkeypatch.setattr(output_capturing._active_collector, "context_var", _UntraceableVar())
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    config = Qwen3MoeConfig(
        vocab_size=48, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=64, tie_word_embeddings=False, use_cache=False, router_aux_loss_coef=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    eager = Qwen3MoeForCausalLM(copy.deepcopy(config))
    compiled = Qwen3MoeForCausalLM(copy.deepcopy(config))
    compiled.load_state_dict(eager.state_dict())
    for model in (eager, compiled):
        apply_ops(model, OpsConfig(moe_experts="torch", compile="off", hardware=Hardware(device_type="cpu")))
    return eager, compiled


def _step(model: torch.nn.Module, seed: int):  # noqa: ANN202
    # One packed row of two documents, with the packing kwargs veomni's collator passes.
    lens = [5 + seed, 9 - seed]  # same row length, another split
    ids = torch.randint(0, 48, (1, sum(lens)), generator=torch.Generator().manual_seed(seed))
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lens])[None]
    packing = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lens), "max_length_k": max(lens)}
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, position_ids=positions, output_router_logits=True, **packing)
    out.loss.backward()
    return out, [p.grad.clone() for p in model.parameters()]


def test_router_logits_recorded_once_per_layer_and_equal_to_eager(untraceable_collector):
    eager, compiled = _pair()
    stats = compile_blocks(
        compiled, ("model.layers.*",), backend="aot_eager", call_context=capture_into_compiled_block
    ).stats
    for seed in range(3):  # the first call primes each block eagerly: its records must not count
        want, want_grads = _step(eager, seed)
        got, got_grads = _step(compiled, seed)
        assert len(got.router_logits) == len(want.router_logits) == LAYERS
        for a, b in zip(got.router_logits, want.router_logits, strict=True):
            assert torch.equal(a, b)
        assert torch.equal(got.aux_loss, want.aux_loss) and torch.equal(got.loss, want.loss)
        for a, b in zip(got_grads, want_grads, strict=True):
            assert torch.equal(a, b)
    assert stats.graphs == 1  # both layers, three steps: one graph
    assert output_capturing._active_collector.compiling is False  # handed back after every call


def test_recomputation_under_checkpointing_never_reads_the_context_var(untraceable_collector):
    # Activation checkpointing reruns the compiled block in backward, after the model's forward has reset the
    # collector: the hooks must still take the traceable path (nothing to record), not the ContextVar.
    from veomni.core.checkpointing import apply_activation_checkpointing

    eager, compiled = _pair()
    stats = compile_blocks(
        compiled, ("model.layers.*",), backend="aot_eager", call_context=capture_into_compiled_block
    ).stats
    apply_activation_checkpointing(compiled, ("model.layers.*",))
    for seed in range(2):
        want, want_grads = _step(eager, seed)
        got, got_grads = _step(compiled, seed)
        assert len(got.router_logits) == LAYERS and torch.equal(got.loss, want.loss)
        for a, b in zip(got_grads, want_grads, strict=True):
            assert torch.equal(a, b)
    assert stats.graphs <= 2  # the recomputation's (no collector) variant at most once more


def test_without_the_handoff_the_collector_is_read_while_tracing(untraceable_collector):
    _, compiled = _pair()
    compile_blocks(compiled, ("model.layers.*",), backend="aot_eager")
    with pytest.raises(Exception, match="read inside a compiled region"):
        _step(compiled, 0)
