"""veomni attention functions inside HF models: parity with HF, packed sequences, Ulysses SP on real ranks.

Tiny Qwen3 / Llama models (hidden 64, 4 query heads, 2 or 1 KV heads, 2 layers, vocab 128) run in fp32 on CPU.
The oracles are HF's own ``eager`` / ``sdpa`` implementations and, for packing and SP, the same model run on
each document separately / in one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import build_parallel_state, use_parallel_state
from veomni.core.sp import gather_sequence, pad_to_multiple, slice_sequence
from veomni.kernels.attention import available_attention_functions
from veomni.models.hf.attention import (
    hf_attention_function,
    hf_attention_name,
    packed_kwargs,
    register_hf_attention,
)

VOCAB, IGNORE = 128, -100
FAMILIES = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}
FP32 = {"rtol": 1e-5, "atol": 1e-5}


def build_model(
    family: str, attn: str, kv_heads: int = 2, seed: int = 0, dtype=torch.float32, head_dim: int = 16, **extra
):
    """A seeded tiny causal LM of ``family`` using attention implementation ``attn``."""
    register_hf_attention()
    config_cls, model_cls = FAMILIES[family]
    config = config_cls(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        **extra,
    )
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype)
    model.set_attn_implementation(attn)
    return model


def doc_batch(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One packed row ``(input_ids, position_ids, labels)``, each ``[1, L]``; labels stay inside documents."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    labels = torch.full_like(ids, IGNORE)
    start = 0
    for n in lengths:
        labels[0, start : start + n - 1] = ids[0, start + 1 : start + n]
        start += n
    return ids, positions, labels


def summed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum"
    )


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(got: dict, want: dict, **tol) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], **tol, msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------- registration and errors


def test_register_is_idempotent_and_lists_names():
    first = register_hf_attention()
    functions = {n: ALL_ATTENTION_FUNCTIONS[n] for n in first}
    assert register_hf_attention() == first
    assert {"veomni_eager", "veomni_sdpa", "veomni_flex", "veomni_varlen"} <= set(first)
    # No "flash" in the names: transformers would route those through its own FlashAttention loader.
    assert {"veomni_fa2", "veomni_fa3", "veomni_fa4"} <= set(first)
    assert not any("flash" in name for name in first)
    for name in first:
        assert ALL_ATTENTION_FUNCTIONS[name] is functions[name]
        assert name in ALL_MASK_ATTENTION_FUNCTIONS
    assert register_hf_attention(["sdpa"]) == ["veomni_sdpa"]


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(KeyError, match="no 'nope' implementation"):
        hf_attention_function("nope")
    with pytest.raises(KeyError, match="registered backends"):
        register_hf_attention(["nope"])
    model = build_model("llama", "sdpa")
    with pytest.raises((KeyError, ValueError), match="veomni_nope"):
        model.set_attn_implementation("veomni_nope")


def test_foreign_function_under_our_name_is_refused():
    register_hf_attention()
    ours = AttentionInterface._global_mapping["veomni_eager"]
    AttentionInterface.register("veomni_eager", lambda *a, **k: None)
    try:
        with pytest.raises(ValueError, match="already registered by someone else"):
            register_hf_attention(["eager"])
    finally:
        AttentionInterface.register("veomni_eager", ours)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without a GPU")
@pytest.mark.parametrize("backend", ["varlen", "flex", "flash_attn_2"])
def test_backend_unavailable_here_raises_when_used(backend):
    name = hf_attention_name(backend)
    model = build_model("qwen3", name)  # selecting it is fine: configs stay portable
    with pytest.raises(RuntimeError, match=rf"'{name}' is unavailable: .*Runnable here: .*veomni_sdpa"):
        model(torch.zeros(1, 4, dtype=torch.long))


def test_dropout_in_training_is_refused():
    model = build_model("llama", "veomni_sdpa", attention_dropout=0.1).train()
    with pytest.raises(ValueError, match="no attention dropout"):
        model(torch.zeros(1, 4, dtype=torch.long))
    model.eval()  # HF passes dropout=0 outside training
    model(torch.zeros(1, 4, dtype=torch.long))


# ---------------------------------------------------------------- parity with HF's own implementations


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("kv_heads", [2, 1])
@pytest.mark.parametrize("hf_name, ours", [("eager", "veomni_eager"), ("sdpa", "veomni_sdpa")])
def test_matches_hf_on_a_normal_batch(family, kv_heads, hf_name, ours):
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(3))
    results = []
    for attn in (hf_name, ours):
        model = build_model(family, attn, kv_heads=kv_heads)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        results.append((out.logits.detach(), out.loss.detach(), grads(model)))
    (ref_logits, ref_loss, ref_grads), (logits, loss, got_grads) = results
    torch.testing.assert_close(logits, ref_logits, **FP32)
    torch.testing.assert_close(loss, ref_loss, **FP32)
    assert_grads_close(got_grads, ref_grads, **FP32)


def test_scaling_and_is_causal_are_honoured():
    # A bidirectional model with a non-default scale: both must reach the kernel to match HF.
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(5))
    logits = []
    for attn in ("sdpa", "veomni_eager"):
        model = build_model("llama", attn)
        for layer in model.model.layers:
            layer.self_attn.is_causal = False
            layer.self_attn.scaling = 0.37
        # The mask builder follows config.is_causal, the attention functions module.is_causal.
        model.config.is_causal = False
        logits.append(model(ids).logits.detach())
    torch.testing.assert_close(logits[1], logits[0], **FP32)


def test_right_padding_matches_hf_and_left_padding_runs_hf_sdpa():
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    # Right padding: veomni's kernel; left: transformers' sdpa for the call.
    for padding in (mask, mask.flip(1)):
        ref = build_model("qwen3", "sdpa")(input_ids=ids, attention_mask=padding).logits
        got = build_model("qwen3", "veomni_sdpa")(input_ids=ids, attention_mask=padding).logits
        keep = padding.bool()
        torch.testing.assert_close(got[keep], ref[keep], **FP32)


# ---------------------------------------------------------------- packed sequences


def _packed_vs_separate(family: str, attn: str, lengths: list[int], mode: str, seed: int) -> None:
    model = build_model(family, attn, seed=seed % 3)
    ids, positions, labels = doc_batch(lengths, seed)
    kwargs = packed_kwargs(positions) if mode == "cu" else {}
    packed = model(input_ids=ids, position_ids=positions, **kwargs).logits
    summed_loss(packed, labels).backward()
    packed_grads = grads(model)
    model.zero_grad()

    start, separate = 0, []
    for n in lengths:
        logits = model(input_ids=ids[:, start : start + n]).logits
        summed_loss(logits, labels[:, start : start + n]).backward()
        separate.append(logits.detach())
        start += n
    torch.testing.assert_close(packed.detach(), torch.cat(separate, dim=1), **FP32)
    assert_grads_close(packed_grads, grads(model), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["cu", "positions"])
@pytest.mark.parametrize("attn", ["veomni_eager", "veomni_sdpa"])
@settings(max_examples=12)
@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=4), seed=st.integers(0, 1000))
def test_packed_row_equals_documents_run_separately(attn, mode, lengths, seed):
    _packed_vs_separate("qwen3", attn, lengths, mode, seed)


def test_packed_llama_with_batch_of_two_rows_derived_from_positions():
    # B = 2 rows, each packing two documents: rows and documents are both segment boundaries.
    model = build_model("llama", "veomni_sdpa")
    ids_a, pos_a, _ = doc_batch([3, 5], seed=1)
    ids_b, pos_b, _ = doc_batch([6, 2], seed=2)
    packed = model(input_ids=torch.cat([ids_a, ids_b]), position_ids=torch.cat([pos_a, pos_b])).logits
    for row, (ids, cut) in enumerate([(ids_a, 3), (ids_b, 6)]):
        parts = [model(input_ids=ids[:, :cut]).logits, model(input_ids=ids[:, cut:]).logits]
        torch.testing.assert_close(packed[row : row + 1], torch.cat(parts, dim=1), **FP32)


def test_packed_kwargs_layout():
    kw = packed_kwargs(torch.tensor([0, 1, 2, 0, 1, 0, 1, 2, 3]))
    assert kw["cu_seq_lens_q"].tolist() == [0, 3, 5, 9] and kw["cu_seq_lens_q"].dtype == torch.int32
    assert kw["cu_seq_lens_k"] is kw["cu_seq_lens_q"]
    assert kw["max_length_q"] == kw["max_length_k"] == 4


# ---------------------------------------------------------------- Ulysses SP on real gloo ranks


def _sp_case(ctx, family: str, attn: str, kv_heads: int, lengths: list[int], mode: str) -> dict[str, float]:
    """Single-process reference vs SP=2 on this rank; returns the largest differences seen."""
    state = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type)
    group = state.sp_group
    model = build_model(family, attn, kv_heads=kv_heads)
    ids, positions, labels = doc_batch(lengths, seed=sum(lengths))
    length = ids.shape[1]

    ref_logits = model(input_ids=ids, position_ids=positions, **packed_kwargs(positions)).logits
    summed_loss(ref_logits, labels).backward()
    ref_grads = grads(model)
    model.zero_grad()

    if mode == "cu_unpadded":  # cu_seqlens of the true length, which the ranks are told
        kwargs = {**packed_kwargs(positions), "sp_unpadded_len": length}
    elif mode == "cu_padded":  # the SP padding (positions 0, 0, ...) is part of the packing
        kwargs = packed_kwargs(pad_to_multiple(positions, 1, ctx.world_size))
    else:  # "positions": no cu_seqlens, the ranks derive the packing from gathered position_ids
        kwargs = {}
    with use_parallel_state(state):
        local = model(
            input_ids=slice_sequence(ids, 1, group),
            position_ids=slice_sequence(positions, 1, group),
            **kwargs,
        ).logits
    summed_loss(local, slice_sequence(labels, 1, group, pad_value=IGNORE)).backward()
    full = gather_sequence(local.detach(), group, dim=1, equal_sizes=True)[:, :length]
    worst = {"logits": (full - ref_logits.detach()).abs().max().item(), "grad": 0.0}
    for name, p in model.named_parameters():
        summed = p.grad.clone()
        dist.all_reduce(summed, group=group)
        # Error in units of the tolerance: relative to the tensor's largest grad, with an absolute floor for
        # grads that are zero in exact arithmetic (a one-token document's keys get none) and noise in fp32.
        tol = 1e-5 * ref_grads[name].abs().max() + 1e-6
        worst["grad"] = max(worst["grad"], ((summed - ref_grads[name]).abs().max() / tol).item())
    return worst


def _check_sp(results: list[dict[str, float]]) -> None:
    for worst in results:
        assert worst["logits"] < 1e-5, worst
        assert worst["grad"] <= 1.0, worst  # gradients within tolerance


@pytest.mark.parametrize(
    "family, attn, kv_heads, mode",
    [
        ("qwen3", "veomni_sdpa", 2, "cu_unpadded"),
        ("qwen3", "veomni_eager", 2, "cu_padded"),
        ("llama", "veomni_sdpa", 1, "cu_unpadded"),  # GQA with fewer KV heads than SP ranks
        ("llama", "veomni_eager", 1, "positions"),
        ("qwen3", "veomni_sdpa", 2, "positions"),
    ],
)
def test_ulysses_sp2_matches_single_process(dist_pools, family, attn, kv_heads, mode):
    _check_sp(dist_pools.get(2).run(_sp_case, family, attn, kv_heads, [5, 1, 7], mode))


@settings(max_examples=8)
@given(
    lengths=st.lists(st.integers(1, 8), min_size=1, max_size=4),
    kv_heads=st.sampled_from([1, 2]),
    mode=st.sampled_from(["cu_unpadded", "cu_padded", "positions"]),
)
def test_ulysses_sp2_packed_property(dist_pools, lengths, kv_heads, mode):
    _check_sp(dist_pools.get(2).run(_sp_case, "qwen3", "veomni_sdpa", kv_heads, lengths, mode))


def _sp_bad_unpadded_len(ctx) -> None:
    state = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type)
    model = build_model("qwen3", "veomni_sdpa")
    ids = torch.zeros(1, 4, dtype=torch.long)
    with use_parallel_state(state), pytest.raises(ValueError, match="sp_unpadded_len=9 does not fit"):
        model(input_ids=ids, sp_unpadded_len=9)


def test_ulysses_rejects_an_impossible_unpadded_len(dist_pools):
    dist_pools.get(2).run(_sp_bad_unpadded_len)


# ---------------------------------------------------------------- GPU backends (bf16)

GPU_BACKENDS = ["varlen", "flash_attn_2", "flash_attn_3", "flash_attn_4", "flex"]


@pytest.mark.cuda
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_backend_packed_bf16_matches_sdpa(backend):
    status = available_attention_functions()[backend]
    if status != "ok":
        pytest.skip(f"{backend}: {status}")
    ids, positions, labels = doc_batch([37, 64, 27], seed=7)
    ids, positions, labels = ids.cuda(), positions.cuda(), labels.cuda()
    kwargs = packed_kwargs(positions)
    results = []
    for attn in ("veomni_sdpa", hf_attention_name(backend)):
        # Head size 32: FlashAttention 4's gradients are wrong at 16 (refused, tests/kernels/test_attention.py).
        model = build_model("qwen3", attn, dtype=torch.bfloat16, head_dim=32).cuda()
        logits = model(input_ids=ids, position_ids=positions, **kwargs).logits
        summed_loss(logits, labels).backward()
        results.append((logits.detach().float(), grads(model)))
    (ref, ref_grads), (got, got_grads) = results
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
    for name in ref_grads:
        scale = ref_grads[name].abs().max().float().clamp_min(1e-3)
        assert ((got_grads[name] - ref_grads[name]).abs().max().float() / scale) < 5e-2, name


@pytest.mark.cuda
def test_gpu_sdpa_bf16_matches_hf_sdpa():
    ids = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(1)).cuda()
    ref = build_model("llama", "sdpa", dtype=torch.bfloat16).cuda()(ids).logits.float()
    got = build_model("llama", "veomni_sdpa", dtype=torch.bfloat16).cuda()(ids).logits.float()
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------- cross-attention vs KV-cache decoding


class CrossAttention(torch.nn.Module):
    """The two attributes HF's BERT-family (and diffusers') cross-attention modules carry."""

    is_causal = False
    is_cross_attention = True


def _cross_qkv(seed: int, sq: int, sk: int, batch: int = 2, heads: int = 4, kv_heads: int = 2):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, sq, 8, generator=gen, dtype=torch.float64).requires_grad_()
    k = torch.randn(batch, kv_heads, sk, 8, generator=gen, dtype=torch.float64).requires_grad_()
    v = torch.randn(batch, kv_heads, sk, 8, generator=gen, dtype=torch.float64).requires_grad_()
    return q, k, v


def _cross_oracle(q, k, v, scaling: float) -> torch.Tensor:
    """``[B, S_q, H, D]``: SDPA with every key visible, GQA by repetition."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, scale=scaling).transpose(1, 2)


@pytest.mark.parametrize("attn", ["veomni_eager", "veomni_sdpa"])
@pytest.mark.parametrize("sq, sk", [(7, 5), (5, 12), (6, 6)])
def test_cross_attention_matches_oracle(attn, sq, sk):
    register_hf_attention()
    q, k, v = _cross_qkv(0, sq, sk)
    out, weights = ALL_ATTENTION_FUNCTIONS[attn](CrossAttention(), q, k, v, None, scaling=0.3)
    assert weights is None
    torch.testing.assert_close(out, _cross_oracle(q, k, v, 0.3), **FP32)
    # An unmarked module can declare a call cross-attention through the kwarg.
    plain = torch.nn.Module()
    plain.is_causal = False
    again, _ = ALL_ATTENTION_FUNCTIONS[attn](plain, q, k, v, None, scaling=0.3, is_cross_attention=True)
    torch.testing.assert_close(again, out)


def test_cross_attention_ambiguous_or_unsupported_calls_raise():
    register_hf_attention()
    fn = ALL_ATTENTION_FUNCTIONS["veomni_sdpa"]
    q, k, v = _cross_qkv(1, 4, 6)
    causal = CrossAttention()
    causal.is_causal = True
    with pytest.raises(ValueError, match="marked as cross-attention but attends causally"):
        fn(causal, q, k, v, None)
    with pytest.raises(ValueError, match="marked as cross-attention but attends causally"):
        fn(CrossAttention(), q, k, v, None, is_causal=True)
    with pytest.raises(NotImplementedError, match="cross-attention takes no attention mask"):
        fn(CrossAttention(), q, k, v, torch.ones(2, 6, dtype=torch.bool))
    with pytest.raises(
        NotImplementedError, match="packed sequences \\(cu_seq_lens_q\\) reached a cross-attention"
    ):
        fn(CrossAttention(), q, k, v, None, cu_seq_lens_q=torch.tensor([0, 4], dtype=torch.int32))


def test_kv_cache_decoding_still_matches_hf():
    # Causal keys longer than queries stay KV-cache decoding: greedy generation equals HF's sdpa.
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(8))
    settings_ = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    ref = build_model("qwen3", "sdpa").generate(prompt, **settings_)
    got = build_model("qwen3", "veomni_sdpa").generate(prompt, **settings_)
    assert torch.equal(got, ref)


def test_a_static_cache_runs_hf_attention_not_the_decode_path():
    # A StaticCache hands over all its slots (the unwritten ones zero), not past + new: the decode path would take
    # the queries as the last keys and attend to future prompt tokens and empty slots. HF's mask and sdpa run it.
    from transformers import StaticCache

    model = build_model("qwen3", "veomni_sdpa").eval()
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(8))
    want = model(prompt).logits
    for mask in (None, torch.ones_like(prompt)):
        cache = StaticCache(config=model.config, max_cache_len=16)
        with torch.no_grad():
            got = model(prompt, attention_mask=mask, past_key_values=cache, use_cache=True).logits
        torch.testing.assert_close(got, want.detach(), **FP32)
    # The same numbers from an encoder-decoder's cross-attention mask (no cache) are not a cache.
    from transformers.masking_utils import bidirectional_mask_function

    from veomni.models.hf.attention import padding_mask_passthrough

    assert padding_mask_passthrough(1, 5, 16, mask_function=bidirectional_mask_function) is None


def _sp_cross_case(ctx, attn: str, sq: int, sk: int) -> None:
    state = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type)
    group = state.sp_group
    register_hf_attention()
    fn = ALL_ATTENTION_FUNCTIONS[attn]
    q, k, v = _cross_qkv(sq * 31 + sk, sq, sk)
    probe = torch.randn(2, sq, 4, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ref = _cross_oracle(q, k, v, 0.3)
    (ref * probe).sum().backward()
    ref_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None

    with use_parallel_state(state):
        # HF layout [B, H, S, D]: the queries are this rank's shard, the keys/values the full condition.
        out, _ = fn(CrossAttention(), slice_sequence(q, 2, group), k, v, None, scaling=0.3)
    full = gather_sequence(out.detach(), group, dim=1, equal_sizes=True)[:, :sq]
    torch.testing.assert_close(full, ref.detach(), **FP32)  # veomni_eager computes in fp32
    (out * slice_sequence(probe, 1, group)).sum().backward()
    for t, want in zip((q, k, v), ref_grads, strict=True):
        summed = t.grad.clone()
        dist.all_reduce(summed, group=group)
        torch.testing.assert_close(summed, want, **FP32)

    # Unmarked and bidirectional with another key length: ambiguous under SP, so it names the flag.
    # (Keys as long as the local shard would be read as self-attention: the module flag is what tells them apart.)
    q_local = slice_sequence(q, 2, group).detach()
    other = torch.zeros(2, 2, q_local.shape[2] + 2, 8, dtype=q.dtype)
    plain = torch.nn.Module()
    plain.is_causal = False
    with use_parallel_state(state), pytest.raises(NotImplementedError, match="is_cross_attention = True"):
        fn(plain, q_local, other, other, None)
    plain.is_causal = True
    with use_parallel_state(state), pytest.raises(NotImplementedError, match=r"KV-cache decoding.*\)$"):
        fn(plain, q_local, other, other, None)


@pytest.mark.parametrize(
    "attn, sq, sk", [("veomni_sdpa", 9, 5), ("veomni_eager", 4, 4), ("veomni_sdpa", 3, 11)]
)
def test_cross_attention_sp2_matches_single_process(dist_pools, attn, sq, sk):
    dist_pools.get(2).run(_sp_cross_case, attn, sq, sk)


def test_output_attentions_through_veomni_attention_are_hf_eager_ones_not_a_tuple_of_nones():
    ids, positions, _ = doc_batch([10, 6], seed=3)
    model = build_model("qwen3", hf_attention_name("sdpa"))
    got = model(input_ids=ids, output_attentions=True)
    assert model(input_ids=ids).logits.shape[:2] == ids.shape  # the default path is untouched
    eager = build_model("qwen3", "eager")
    want = eager(input_ids=ids, output_attentions=True)
    assert len(got.attentions) == len(want.attentions)
    for a, b in zip(got.attentions, want.attentions, strict=True):
        torch.testing.assert_close(a, b, **FP32)


def _sp_fallback_refused(ctx) -> None:
    state = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type)
    register_hf_attention()
    q = k = v = torch.zeros(1, 4, 3, 8)
    module = torch.nn.Module()
    with use_parallel_state(state), pytest.raises(NotImplementedError, match="under Ulysses SP \\(sp=2\\)"):
        ALL_ATTENTION_FUNCTIONS["veomni_sdpa"](module, q, k, v, torch.ones(1, 1, 3, 3, dtype=torch.bool))


def test_a_4d_mask_under_ulysses_sp_is_refused_not_routed(dist_pools):
    # Each rank holds a shard of the sequence, which transformers' attention cannot see whole.
    dist_pools.get(2).run(_sp_fallback_refused)
