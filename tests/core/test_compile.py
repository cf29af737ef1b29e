"""Per-block ``torch.compile`` (`veomni.core.compile.compile_blocks`) on a tiny Qwen3 with veomni's kernels.

Compiled blocks must equal eager ones (``aot_eager`` runs the captured graphs op for op, so loss and every
gradient agree bitwise; inductor generates fused CPU code, so there a float tolerance), with ``fullgraph=True``
(any graph break is an error), one graph for all blocks, and no recompile when the number of packed documents
changes. On CPU the Triton kernels run through Triton's interpreter, so the model is tiny.
"""

from __future__ import annotations

import copy
import importlib
import types

import pytest
import torch
from transformers import Qwen3Config
from transformers.modeling_layers import GradientCheckpointingLayer

from veomni.core.checkpointing import apply_activation_checkpointing
from veomni.core.compile import compile_blocks, compile_stats
from veomni.kernels import OpsConfig
from veomni.kernels.attention.functions import segment_ids
from veomni.kernels.hardware import Hardware
from veomni.models.build import build_model
from veomni.models.hf.kernel_hooks import apply_ops
from veomni.models.qwen3.generated.patched_modeling_qwen3 import Qwen3ForCausalLM

CPU = Hardware(device_type="cpu", triton_interpret=True)
# Triton kernels need CUDA, or Triton's interpreter on CPU (tests/conftest.py sets it when there is no GPU).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCKS = ("model.layers.*",)
SEQ = 16
TRITON = dict(rms_norm="triton", rope="triton", swiglu="triton")


def tiny_config(layers: int = 2) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=48, hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
        use_cache=False,
    )  # fmt: skip


def pair(
    ops: dict[str, str], layers: int = 2, device: str = DEVICE
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Two identical models with the same kernels bound: (eager, to be compiled), fp32 on ``device``."""
    config = tiny_config(layers)
    torch.manual_seed(0)
    eager = Qwen3ForCausalLM(copy.deepcopy(config)).to(device)
    other = Qwen3ForCausalLM(copy.deepcopy(config)).to(device)
    other.load_state_dict(eager.state_dict())
    for model in (eager, other):
        apply_ops(model, OpsConfig(**ops, compile="off", hardware=CPU))
    return eager, other


def packed(doc_lens: list[int], seed: int = 0, device: str = DEVICE) -> dict[str, object]:
    """One packed row of ``sum(doc_lens)`` tokens, with HF's packing kwargs (as veomni's collator passes them)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 48, (1, sum(doc_lens)), generator=gen).to(device)
    cu = torch.tensor([0, *torch.tensor(doc_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    positions = torch.cat([torch.arange(n) for n in doc_lens])[None].to(device)
    return {
        "input_ids": ids, "labels": ids.clone(), "position_ids": positions, "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu, "max_length_q": max(doc_lens), "max_length_k": max(doc_lens),
    }  # fmt: skip


def loss_and_grads(
    model: torch.nn.Module, batch: dict[str, object]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "ops",
    [dict(rms_norm="eager", rope="eager", swiglu="eager"), dict(rms_norm="triton"), dict(rope="triton"),
     dict(swiglu="triton"), TRITON],
    ids=["eager", "rms_norm", "rope", "swiglu", "all-triton"],
)  # fmt: skip
def test_compiled_blocks_equal_eager_bitwise(ops):
    eager, compiled = pair(ops)
    result = compile_blocks(compiled, BLOCKS, backend="aot_eager")
    assert result.fqns == ("model.layers.0", "model.layers.1")
    batch = packed([6, 10])
    want_loss, want_grads = loss_and_grads(eager, batch)
    loss, grads = loss_and_grads(compiled, batch)
    assert torch.equal(loss, want_loss)
    for got, want in zip(grads, want_grads, strict=True):
        assert torch.equal(got, want)
    # fullgraph=True turns a graph break into an error; the counters confirm that nothing fell back.
    assert not torch._dynamo.utils.counters["graph_break"]
    assert result.stats.graphs == 1  # both blocks share one graph


@pytest.mark.slow
def test_document_count_changes_do_not_recompile():
    eager, compiled = pair(TRITON, layers=1)
    stats = compile_blocks(compiled, BLOCKS, backend="aot_eager").stats
    for i, lens in enumerate(([6, 10], [3, 5, 8], [2, 2, 2, 10], [8, 8])):
        loss, _ = loss_and_grads(compiled, packed(lens, seed=i))
        want, _ = loss_and_grads(eager, packed(lens, seed=i))
        assert torch.equal(loss, want)
    assert stats.graphs == 1, f"recompiled: {stats.graphs} graphs for one block type"


@pytest.mark.slow
def test_inductor_cpu_matches_eager_within_float_tolerance():
    # Inductor fuses the eager parts around the custom ops (residual adds, attention mask maths), so fp32
    # rounding may differ; veomni's kernels inside are the same opaque calls.
    eager, compiled = pair(TRITON, layers=1)
    compile_blocks(compiled, BLOCKS, backend="inductor")
    batch = packed([7, 9])
    want_loss, want_grads = loss_and_grads(eager, batch)
    loss, grads = loss_and_grads(compiled, batch)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_activation_checkpointing_wraps_the_compiled_forward():
    eager, compiled = pair(TRITON, layers=1)
    stats = compile_blocks(compiled, BLOCKS, backend="aot_eager").stats
    apply_activation_checkpointing(compiled, BLOCKS)
    batch = packed([5, 11])
    want_loss, want_grads = loss_and_grads(eager, batch)
    loss, grads = loss_and_grads(compiled, batch)
    assert torch.equal(loss, want_loss)
    for got, want in zip(grads, want_grads, strict=True):
        assert torch.equal(got, want)
    assert stats.graphs == 1  # the recomputation in backward reuses the forward's graph


def test_keys_are_unchanged_and_misuse_is_refused():
    _, model = pair({"rms_norm": "eager"}, layers=1)
    keys = list(model.state_dict())
    compile_blocks(model, BLOCKS, backend="aot_eager")
    assert list(model.state_dict()) == keys
    assert compile_stats(model) is compile_stats(model.model.layers[0])
    with pytest.raises(ValueError, match="already compiled"):
        compile_blocks(model, BLOCKS, backend="aot_eager")
    with pytest.raises(ValueError, match="matched no module"):
        compile_blocks(model, ("model.blocks.*",), backend="aot_eager")
    _, checkpointed = pair({"rms_norm": "eager"}, layers=1)
    apply_activation_checkpointing(checkpointed, BLOCKS)
    with pytest.raises(ValueError, match="before activation checkpointing"):
        compile_blocks(checkpointed, BLOCKS, backend="aot_eager")


@pytest.mark.parametrize("setting, device, expected", [
    ("auto", "cpu", False), ("auto", "cuda", True), ("on", "cpu", True), ("off", "cuda", False),
])  # fmt: skip
def test_ops_compile_setting(setting, device, expected):
    hardware = Hardware(device_type=device, capability=(9, 0) if device == "cuda" else None)
    ops = OpsConfig(compile=setting, hardware=hardware)
    assert ops.compile_enabled is expected
    assert "compile" not in ops.defaulted


def test_ops_compile_rejects_other_values():
    with pytest.raises(
        ValueError, match=r"OpsConfig.compile must be one of \('auto', 'on', 'off'\), got 'yes'"
    ):
        OpsConfig(compile="yes", hardware=CPU)


def test_build_model_compiles_blocks_only_when_enabled():
    config = tiny_config(layers=1)
    off = build_model(config, ops=OpsConfig(compile="auto", hardware=CPU))
    assert compile_stats(off) is None
    on = build_model(config, ops=OpsConfig(compile="on", hardware=CPU))
    stats = compile_stats(on)
    assert stats is not None and stats.backend_name == "inductor" and stats.graphs == 0  # compiled lazily
    assert compile_stats(on.model.layers[0]) is stats


@pytest.mark.cuda
@pytest.mark.parametrize("attention", ["sdpa", "varlen"])
def test_cuda_inductor_blocks_match_eager_bf16_without_recompiles(attention):
    # The real thing on a GPU: bf16, compiled Triton kernels inside inductor's code, packed rows of 256 tokens
    # with 2 to 5 documents. Inductor fuses the eager parts differently, so bf16-level agreement, not bitwise.
    config = tiny_config(layers=2)
    torch.manual_seed(0)
    eager = Qwen3ForCausalLM(copy.deepcopy(config)).to("cuda", torch.bfloat16)
    compiled = Qwen3ForCausalLM(copy.deepcopy(config)).to("cuda", torch.bfloat16)
    compiled.load_state_dict(eager.state_dict())
    for model in (eager, compiled):
        apply_ops(model, OpsConfig(**TRITON, attention=attention, compile="off"))
    stats = compile_blocks(compiled, BLOCKS).stats
    for i, lens in enumerate(([100, 156], [30, 60, 166], [64, 64, 64, 64], [10, 20, 30, 40, 156])):
        batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in packed(lens, seed=i).items()}
        want_loss, want_grads = loss_and_grads(eager, batch)
        loss, grads = loss_and_grads(compiled, batch)
        torch.testing.assert_close(loss, want_loss, rtol=2e-2, atol=2e-2)
        for got, want in zip(grads, want_grads, strict=True):
            rel = (got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-6)
            assert rel < 5e-2, f"relative gradient error {rel:.3g} with documents {lens}"
    assert stats.graphs == 1, f"{stats.graphs} graphs: document-count changes recompiled"


@pytest.mark.cuda
def test_cuda_first_static_graph_matches_eager_fp32():
    """The trainer's dense block (eager formulas, SDPA with a packed mask) in fp32, compiled afresh for an odd
    packed length: dynamo's first graph is static. On torch 2.11 inductor's comprehensive padding made that graph's
    forward 2.5e-3 relative off (SAFE_INDUCTOR_OPTIONS); fp32 must agree to rounding."""
    config = Qwen3Config(
        vocab_size=1024, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    eager = Qwen3ForCausalLM(copy.deepcopy(config)).to("cuda")
    compiled = Qwen3ForCausalLM(copy.deepcopy(config)).to("cuda")
    compiled.load_state_dict(eager.state_dict())
    ops = OpsConfig(rms_norm="eager", rope="eager", swiglu="eager", attention="sdpa", compile="off")
    for model in (eager, compiled):
        apply_ops(model, ops)
    stats = compile_blocks(compiled, BLOCKS).stats
    for i, lens in enumerate(([100, 80, 69], [120, 135], [7, 64, 64, 121])):
        batch = packed(lens, seed=i, device="cuda")
        batch["input_ids"] = torch.randint(0, 1024, batch["input_ids"].shape, device="cuda")
        batch["labels"] = batch["input_ids"].clone()
        want_loss, want_grads = loss_and_grads(eager, batch)
        loss, grads = loss_and_grads(compiled, batch)
        torch.testing.assert_close(
            loss, want_loss, rtol=1e-5, atol=0, msg=lambda m, lens=lens: f"{m}\ndocuments {lens}"
        )
        for got, want in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(
                got, want, rtol=1e-4, atol=1e-5, msg=lambda m, lens=lens: f"{m}\ndocuments {lens}"
            )
    assert stats.graphs >= 1


@pytest.mark.cuda
def test_cuda_compiled_segment_ids_equal_eager():
    # torch 2.11's inductor read cu_seqlens[:-1] for the slice cu_seqlens[1:] in a compiled searchsorted.
    cu = torch.tensor([0, 5, 9, 9, 20], dtype=torch.int32, device="cuda")
    torch._dynamo.maybe_mark_dynamic(cu, 0)
    got = torch.compile(segment_ids, fullgraph=True)(cu, 20)
    assert got.tolist() == [0] * 5 + [1] * 4 + [3] * 11


class LazyBlock(torch.nn.Module):
    """Sets itself up on its first call with code dynamo cannot trace, as HF attention functions do."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.act = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act is None:
            self.act = importlib.import_module("torch.nn.functional").gelu
        return self.act(self.lin(x))


def test_first_call_primes_lazy_setup_eagerly_then_runs_the_graph():
    torch.manual_seed(0)
    model = torch.nn.Sequential(LazyBlock(), LazyBlock())
    reference = copy.deepcopy(model)
    stats = compile_blocks(model, ("*",), backend="aot_eager").stats
    x = torch.randn(3, 4, requires_grad=True)
    out = model(x)
    assert out.requires_grad and stats.graphs == 1  # the result came from the compiled graph
    (grad,) = torch.autograd.grad(out.sum(), x)
    (want,) = torch.autograd.grad(reference(x).sum(), x)
    assert torch.equal(grad, want)
    model(x)
    assert stats.graphs == 1


def _layer_kind(k: int) -> type[GradientCheckpointingLayer]:
    """A GradientCheckpointingLayer subclass whose ``forward`` has a code object of its own, as each model's layer
    class has (one closure would share one: what the test is about)."""

    def __init__(self: torch.nn.Module) -> None:
        GradientCheckpointingLayer.__init__(self)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * (1.0 + k)

    own = types.FunctionType(forward.__code__.replace(co_name=f"forward_{k}"), globals(), closure=forward.__closure__)
    return type(f"Kind{k}", (GradientCheckpointingLayer,), {"__init__": __init__, "forward": own})


def test_block_kinds_do_not_share_one_recompile_budget():
    # transformers wraps every GradientCheckpointingLayer's forward in one closure: compiled as such, ten block kinds
    # (text layers, ViT blocks, audio layers, ... of several models in one process) shared one code object and
    # its 8 cache entries, and the ninth kind failed with "recompile limit" under fullgraph=True.
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(_layer_kind(k)() for k in range(10)))
    reference = copy.deepcopy(model)
    stats = compile_blocks(model, ("*",), backend="eager").stats
    x = torch.randn(3, 4)
    assert torch.equal(model(x), reference(x))
    assert stats.graphs == 10


def test_later_models_of_one_class_reuse_the_graphs():
    # Dynamo tags a code object's graphs with the backend that built them; one backend object per compile_blocks
    # call made every build add graphs of its own, and the fifth model built in one process hit the recompile limit
    # (a hard error under fullgraph). Equal settings now compare equal, so later builds reuse the first's graphs.
    kinds = (_layer_kind(0), _layer_kind(1))
    x = torch.randn(3, 4)
    graphs = []
    for seed in range(10):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(*(kind() for kind in kinds))
        reference = copy.deepcopy(model)
        stats = compile_blocks(model, ("*",), backend="eager").stats
        assert torch.equal(model(x), reference(x))  # each model computes with its own parameters
        graphs.append(stats.graphs)
    assert graphs == [2] + [0] * 9
    model = torch.nn.Sequential(kinds[0]())
    other = compile_blocks(model, ("*",), backend="aot_eager").stats
    model(x)
    assert other != stats and other.graphs == 1  # another backend compiles its own graph


def test_moe_block_with_grouped_mm_experts_compiles_and_matches_eager():
    # moe_experts="torch" (torch._grouped_mm over device-side offsets): routing changes per batch change only
    # tensor values, never shapes, so one graph serves every batch.
    from transformers import Qwen3MoeConfig

    from veomni.models.qwen3_moe.generated.patched_modeling_qwen3_moe import Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=48, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=64, tie_word_embeddings=False, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    eager = Qwen3MoeForCausalLM(copy.deepcopy(config))
    compiled = Qwen3MoeForCausalLM(copy.deepcopy(config))
    compiled.load_state_dict(eager.state_dict())
    for model in (eager, compiled):
        apply_ops(model, OpsConfig(moe_experts="torch", compile="off", hardware=CPU))
    stats = compile_blocks(compiled, BLOCKS, backend="aot_eager").stats
    for i, lens in enumerate(([6, 10], [3, 5, 8])):
        want_loss, want_grads = loss_and_grads(eager, packed(lens, seed=i, device="cpu"))
        loss, grads = loss_and_grads(compiled, packed(lens, seed=i, device="cpu"))
        assert torch.equal(loss, want_loss)
        for got, want in zip(grads, want_grads, strict=True):
            assert torch.equal(got, want)
    assert stats.graphs == 1


def test_build_model_refuses_moe_compile_it_cannot_trace(caplog):
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=48, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"moe_experts='triton' cannot be traced.*use 'off'"):
        build_model(config, ops=OpsConfig(moe_experts="triton", compile="on", hardware=CPU))
    auto_cuda = OpsConfig(moe_experts="eager", compile="auto", hardware=Hardware(device_type="cuda"))
    with caplog.at_level("INFO", logger="veomni.models.build"):
        model = build_model(config, ops=auto_cuda)
    assert compile_stats(model) is None and "leaves the blocks eager" in caplog.text
    model = build_model(config, ops=OpsConfig(moe_experts="torch", compile="on", hardware=CPU))
    assert compile_stats(model) is not None
    # CUDA's torch._grouped_mm is traced in bf16 only: an fp32 model's MoE blocks stay eager (auto) or raise (on).
    cuda = Hardware(device_type="cuda")
    caplog.clear()
    with caplog.at_level("INFO", logger="veomni.models.build"):
        model = build_model(config, ops=OpsConfig(moe_experts="torch", compile="auto", hardware=cuda))
    assert compile_stats(model) is None and "traced on CUDA in bfloat16 only" in caplog.text
    with pytest.raises(ValueError, match="bfloat16 only, and this model computes in torch.float32"):
        build_model(config, ops=OpsConfig(moe_experts="torch", compile="on", hardware=cuda))


@pytest.mark.parametrize("composite", [False, True], ids=["qwen3_5_text", "qwen3_5-vlm"])
def test_build_model_refuses_compile_of_gated_deltanet_layers(composite, caplog):
    # The hybrid's layer kinds live in the text config; a composite (vision-language) config holds them in its
    # text_config, where the check must look too (before, it built, then failed in dynamo at the first forward).
    from transformers import Qwen3_5Config, Qwen3_5TextConfig

    text = dict(
        vocab_size=48, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    )  # fmt: skip
    if composite:
        vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32)
        config, task = Qwen3_5Config(text_config=text, vision_config=vision), "image_text_to_text"
    else:
        config, task = Qwen3_5TextConfig(**text), "causal_lm"
    with pytest.raises(ValueError, match=r"Gated DeltaNet layers.*use 'off'"):
        build_model(config, task=task, ops=OpsConfig(compile="on", hardware=CPU))
    with caplog.at_level("INFO", logger="veomni.models.build"):
        auto_cuda = OpsConfig(compile="auto", hardware=Hardware(device_type="cuda"))
        model = build_model(config, task=task, ops=auto_cuda)
    assert compile_stats(model) is None and "Gated DeltaNet" in caplog.text


def test_inductor_mode_and_options_reach_inductor():
    _, model = pair({"rms_norm": "eager"}, layers=1)
    stats = compile_blocks(model, BLOCKS, mode="max-autotune-no-cudagraphs", options=None).stats
    assert stats._inner.config.get("max_autotune") is True
    _, other = pair({"rms_norm": "eager"}, layers=1)
    stats = compile_blocks(other, BLOCKS, options={"epilogue_fusion": False}).stats
    assert stats._inner.config == {"comprehensive_padding": False, "epilogue_fusion": False}
    # The safety default is a default: an explicit option wins.
    _, third = pair({"rms_norm": "eager"}, layers=1)
    stats = compile_blocks(third, BLOCKS, options={"comprehensive_padding": True}).stats
    assert stats._inner.config == {"comprehensive_padding": True}


class _EncoderBlock(torch.nn.Module):
    """An encoder tower block's calling convention (HF Qwen-VL vision blocks): packed ``[T, C]`` items with the
    tower's own ``cu_seqlens`` and a python-int ``max_seqlen`` that both change with every micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, hidden_states, cu_seqlens, max_seqlen, position_embeddings):
        cos, sin = position_embeddings
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        # max_seqlen used in arithmetic, as a varlen kernel would size its grid with it.
        scale = 1.0 / (1 + max_seqlen)
        return self.proj(hidden_states * cos + sin) * scale + lengths.sum() * 0


def test_encoder_blocks_do_not_recompile_on_new_item_counts_and_lengths():
    tower = torch.nn.Module()
    tower.blocks = torch.nn.ModuleList([_EncoderBlock(), _EncoderBlock()])
    stats = compile_blocks(tower, ["blocks.*"], backend="eager").stats
    # Two or more items each time: dynamo specialises a size-2 cu_seqlens (one item) as it does sizes 0 and 1.
    for lengths in ([4, 6], [3, 9, 2], [10, 6], [5, 5, 5, 1]):
        total = sum(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        x = torch.randn(total, 8)
        emb = (torch.randn(total, 8), torch.randn(total, 8))
        for block in tower.blocks:
            out = block(x, cu_seqlens=cu, max_seqlen=max(lengths), position_embeddings=emb)
            assert out.shape == (total, 8)
    assert stats.graphs == 1, f"recompiled: {stats.graphs} graphs for one encoder block type"


class DropoutBlock(torch.nn.Module):
    """A block drawing random numbers (dropout) in training."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 32)
        self.down = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.nn.functional.dropout(torch.relu(self.up(x)), p=0.5, training=self.training)
        return x + self.down(hidden)


def test_checkpointed_compiled_dropout_blocks_recompute_the_forwards_masks():
    # Checkpointing restores the RNG state of its call for the recomputation; the first call's eager priming run
    # must not draw from it, or the recomputed graph uses the priming's dropout masks instead of the forward's
    # (step 0's gradients were wrong, by up to 14 in this model).
    torch.manual_seed(0)
    base = torch.nn.Sequential(DropoutBlock(), DropoutBlock())
    compiled = copy.deepcopy(base)
    compile_blocks(compiled, ("*",), backend="aot_eager")
    checkpointed = copy.deepcopy(base)
    compile_blocks(checkpointed, ("*",), backend="aot_eager")
    apply_activation_checkpointing(checkpointed, ("*",))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    for step in range(2):
        grads = []
        for model in (compiled, checkpointed):
            torch.manual_seed(step)
            model(x).square().sum().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            model.zero_grad()
        for a, b in zip(*grads, strict=True):
            assert torch.equal(a, b), f"step {step}"


def test_priming_draws_no_random_numbers():
    # Eager and compiled blocks then see the same random stream: equal dropout masks, equal gradients.
    torch.manual_seed(0)
    eager = torch.nn.Sequential(DropoutBlock(), DropoutBlock())
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled, ("*",), backend="aot_eager")
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    outputs = []
    for model in (eager, compiled):
        torch.manual_seed(3)
        outputs.append(model(x))
        outputs.append(torch.rand(()))  # what the rest of the step draws next
    assert torch.equal(outputs[0], outputs[2]) and torch.equal(outputs[1], outputs[3])
