"""The generated Qwen3-Next adapter against upstream transformers with veomni's kernels; packed varlen (by positions)
equals per-document runs (the Gated DeltaNet state resets per document); Ulysses SP (4 ranks, positions only) and EP
on real gloo ranks equal one process. Bitwise parity, packing with cu_seq_lens, SP 2 and the per-expert checkpoint's
export round trip: tests/models/test_conformance.py.

Upstream's Gated DeltaNet dispatches to flash-linear-attention whenever it is installed, and fla's kernels are
CUDA-only; the upstream models here run on CPU tensors, so the `torch_fallback` fixture points upstream's module
at its own torch functions (the ``__wrapped__`` originals), which is what upstream computes without fla.
"""

from __future__ import annotations

import copy

import pytest
import torch
from adapter_helpers import sp_against_one_process
from transformers import Qwen3NextConfig
from transformers.models.qwen3_next import modeling_qwen3_next as upstream_modeling

from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import build_parallel_state, use_parallel_state
from veomni.core.sp import gather_sequence, slice_sequence
from veomni.kernels import KERNELS, OpsConfig, detect_hardware
from veomni.models.hf.attention import packed_kwargs
from veomni.models.hf.kernel_hooks import apply_ops
from veomni.models.qwen3_next.generated.patched_modeling_qwen3_next import Qwen3NextForCausalLM
from veomni.models.qwen3_next.sp import check_gdn_sp_heads

EAGER_OPS = dict(
    attention="sdpa", rms_norm="eager", rope="eager", swiglu="eager", moe_experts="eager",
    cross_entropy="eager", load_balancing_loss="eager", gated_delta_rule="eager", causal_conv1d="eager",
    rms_norm_gated="eager",
)  # fmt: skip


@pytest.fixture(autouse=True)
def torch_fallback(monkeypatch):
    # Every upstream model here runs on CPU tensors (also on a GPU host); the cuda test uses no upstream model.
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                 "causal_conv1d_update"):  # fmt: skip
        fn = getattr(upstream_modeling, name)
        monkeypatch.setattr(upstream_modeling, name, getattr(fn, "__wrapped__", fn))


def tiny_config(**overrides) -> Qwen3NextConfig:
    # Qwen3-Next-80B-A3B's structure cut down: 3 linear-attention layers then 1 full-attention layer, grouped
    # value heads (4 v heads on 2 k heads), partial RoPE (a quarter of head_dim), layer 0 dense, the rest
    # routed + shared experts.
    values = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
        shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2, num_hidden_layers=4,
        mlp_only_layers=[0], num_attention_heads=4, num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.25,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
        output_router_logits=True, router_aux_loss_coef=0.05, norm_topk_prob=True,
    )  # fmt: skip
    values.update(overrides)
    config = Qwen3NextConfig(**values)
    config._attn_implementation = "sdpa"
    config._experts_implementation = "eager"
    return config


def build_pair(**overrides) -> tuple[torch.nn.Module, torch.nn.Module]:
    config = tiny_config(**overrides)
    torch.manual_seed(0)
    upstream = upstream_modeling.Qwen3NextForCausalLM(copy.deepcopy(config))
    with torch.no_grad():  # upstream zero-initialises the offset norms; random ones exercise the (1 + w) path
        for name, p in upstream.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.normal_(0, 0.1)
    ours = Qwen3NextForCausalLM(config)
    missing, unexpected = ours.load_state_dict(upstream.state_dict(), strict=True)
    assert not missing and not unexpected
    return upstream, ours


def batch(lengths=(7, 12, 5), rows: int = 1, seed: int = 1) -> dict[str, torch.Tensor]:
    """``rows`` packed rows of documents; each document's first token is unlabelled (no target crosses)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (rows, sum(lengths)), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lengths])[None].expand(rows, -1)
    labels = ids.clone()
    labels[:, torch.cumsum(torch.tensor((0, *lengths[:-1])), 0)] = -100
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def run(model, inputs, **extra) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(**inputs, use_cache=False, **extra)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


def assert_match(got, want, tol: float, *, model_scale: bool = False) -> None:
    """Logits, loss and every gradient within ``tol``; a gradient's absolute slack is ``tol`` x its own largest
    element, or with ``model_scale`` x the largest gradient element of the whole model (kernels at TF32-level
    precision leave ~1e-5 noise on gradients that are ~0 in fp32, e.g. a decay bias the loss barely sees)."""
    torch.testing.assert_close(got[0], want[0], rtol=tol, atol=tol)
    torch.testing.assert_close(got[1], want[1], rtol=tol, atol=tol)
    assert got[2].keys() == want[2].keys()
    largest = max(float(g.abs().max()) for g in want[2].values())
    for name, grad in want[2].items():
        scale = largest if model_scale else float(grad.abs().max())
        torch.testing.assert_close(got[2][name], grad, rtol=tol, atol=tol * scale + 1e-7,
                                   msg=lambda m, n=name: f"{n}: {m}")  # fmt: skip


def assert_fresh_init_like_upstream(upstream_class, ours_class, config) -> None:
    """Built from the same seed, every weight of ours is drawn as upstream's: deterministic ones equal, random ones
    with the same spread. transformers skips the parameter-less sparse block of non-transformers code, from which
    upstream draws the router: ours draws it on the router itself (it stayed all zeros before)."""
    torch.manual_seed(0)
    upstream = dict(upstream_class(copy.deepcopy(config)).named_parameters())
    torch.manual_seed(0)
    ours = dict(ours_class(copy.deepcopy(config)).named_parameters())
    assert ours.keys() == upstream.keys()
    for name, p in ours.items():
        want = upstream[name].detach().float()
        if want.std() == 0:  # norms, biases, dt_bias: deterministic values, equal exactly
            torch.testing.assert_close(p.detach().float(), want, rtol=0, atol=0, msg=name)
        elif "A_log" not in name:  # A_log: log-uniform, a handful of values per layer
            assert abs(p.detach().float().std() / want.std() - 1) < 0.35, name
            assert p.detach().abs().max() < 8 * config.initializer_range, name


def test_fresh_init_draws_every_weight_as_upstream_does():
    assert_fresh_init_like_upstream(upstream_modeling.Qwen3NextForCausalLM, Qwen3NextForCausalLM, tiny_config())


def test_eager_kernels_match_upstream():
    upstream, ours = build_pair()
    apply_ops(ours, OpsConfig(**EAGER_OPS))
    assert ours.config._experts_implementation == "veomni"
    inputs = {k: v for k, v in batch(rows=2).items() if k != "position_ids"}
    assert_match(run(ours, inputs), run(upstream, inputs), 2e-5)


# With veomni's cu_seq_lens_q kwargs: tests/models/test_conformance.py (packed).
@pytest.mark.parametrize("packing", ["position_ids"])
def test_packed_row_equals_documents_run_alone(packing):
    # position_ids alone is HF's DataCollatorWithFlattening packing: every layer, Gated DeltaNet too, must honour it.
    _, ours = build_pair()
    apply_ops(ours, OpsConfig(**EAGER_OPS))
    inputs = batch(lengths=(7, 12, 5))
    extra = packed_kwargs(inputs["position_ids"]) if packing == "cu_seq_lens_q" else {}
    packed = run(ours, inputs, output_router_logits=False, **extra)
    # The oracle: each document through the same model on its own (HF's loss over all labelled tokens).
    ours.zero_grad(set_to_none=True)
    bounds = [(0, 7), (7, 19), (19, 24)]
    logits = torch.cat([ours(input_ids=inputs["input_ids"][:, a:b], use_cache=False,
                             output_router_logits=False).logits for a, b in bounds], 1)  # fmt: skip
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], inputs["labels"][0, 1:], ignore_index=-100)
    loss.backward()
    alone = (
        logits.detach(),
        loss.detach(),
        {n: p.grad.clone() for n, p in ours.named_parameters() if p.grad is not None},
    )
    assert_match(packed, alone, 2e-5)
    # Without the packing kwargs the recurrent state and the conv window run across document boundaries.
    leaky = run(ours, {k: v for k, v in inputs.items() if k != "position_ids"}, output_router_logits=False)
    assert not torch.allclose(leaky[0][:, 7:], packed[0][:, 7:], atol=1e-3)


def test_rows_packed_by_position_ids_alone_equal_each_row_packed_alone():
    # Two rows, each packed by its positions only (batch > 1): the documents of every row restart their state.
    _, ours = build_pair()
    apply_ops(ours, OpsConfig(**EAGER_OPS))
    inputs = batch(lengths=(7, 12, 5), rows=2, seed=3)
    both = run(ours, inputs, output_router_logits=False)
    for row in range(2):
        alone = {k: v[row : row + 1] for k, v in inputs.items()}
        logits = ours(**alone, use_cache=False, output_router_logits=False, **packed_kwargs(alone["position_ids"]))
        torch.testing.assert_close(both[0][row : row + 1], logits.logits.detach(), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("packing", ["cu_seq_lens_q", "position_ids"])
def test_a_packed_forward_with_the_default_use_cache_runs_the_training_path(packing):
    # The config's use_cache=True is what a forward builds a cache from unless told otherwise (HF's Trainer does not
    # say): a cache sends Gated DeltaNet to upstream's generation code, which ignores the packing.
    _, ours = build_pair()
    apply_ops(ours, OpsConfig(**EAGER_OPS))
    assert ours.config.use_cache
    inputs = batch(lengths=(7, 12, 5))
    extra = dict(packed_kwargs(inputs["position_ids"]) if packing == "cu_seq_lens_q" else {}, output_router_logits=False)
    with torch.no_grad():
        default = ours(**inputs, **extra)
        training = ours(**inputs, use_cache=False, **extra)
    torch.testing.assert_close(default.logits, training.logits, rtol=0, atol=0)
    # A cache the caller passes cannot take a packed row: refused, not run across the documents.
    cache = upstream_modeling.DynamicCache(config=ours.config)
    with pytest.raises(ValueError, match="packed rows .* cannot run with a cache"), torch.no_grad():
        ours(**inputs, past_key_values=cache, **{**extra, **packed_kwargs(inputs["position_ids"])})


def test_sp_head_counts_must_divide():
    check_gdn_sp_heads(2, 4, 2)
    with pytest.raises(ValueError, match=r"linear_num_key_heads \(2\) and linear_num_value_heads \(4\) must both "
                                         r"be divisible by the SP size 4"):  # fmt: skip
        check_gdn_sp_heads(2, 4, 4)


def _sp_case(ctx, lengths: tuple[int, ...], by_positions: bool = False) -> dict[str, float]:
    state = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type)
    # Heads divisible by the SP size: 4 key heads, 8 value heads (grouped 2:1).
    _, model = build_pair(linear_num_key_heads=4, linear_num_value_heads=8, num_key_value_heads=4)
    apply_ops(model, OpsConfig(**EAGER_OPS))
    inputs = batch(lengths=lengths, seed=4)
    ids, positions = inputs["input_ids"], inputs["position_ids"]
    labels = torch.cat([inputs["labels"][:, 1:], torch.full_like(ids[:, :1], -100)], 1)  # pre-shifted
    whole = dict(packed_kwargs(positions), output_router_logits=False, use_cache=False)
    # by_positions: each rank's slice of the positions only, and the config's use_cache (HF Trainer's call).
    sharded = dict(output_router_logits=False) if by_positions else dict(whole)
    return sp_against_one_process(
        model, state, ids, positions, labels, whole=whole, sharded=dict(sharded, sp_unpadded_len=ids.shape[1])
    )


# SP 2 with the cu_seq_lens_q kwargs: tests/models/test_conformance.py (sp).
@pytest.mark.parametrize(
    "world, by_positions",
    [(2, True), (4, False), (4, True)],
    ids=["2-position_ids", "4-cu_seq_lens_q", "4-position_ids"],
)
def test_sp_equals_single_process(dist_pools, world, by_positions):
    # 25 tokens: not divisible by 2 or 4, so the SP padding path runs too.
    for worst in dist_pools.get(world).run(_sp_case, (7, 13, 5), by_positions):
        assert worst["missing"] == 0
        assert worst["logits"] < 1e-4, worst
        assert worst["grad"] <= 1.0, worst


def _sp_padding_mask_case(ctx, family: str, length: int, mask_form: str) -> dict[str, object]:
    """Two right-padded rows (row 1 padded at its tail, in the last shard) with an ``attention_mask``: the SP
    forward against one process. ``mask_form``: "local" (this rank's shard), "full" (the ``[B, S]`` mask) or
    "wrong" (a width that is neither)."""
    state = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type)
    group = state.sp_group
    if family == "qwen3_next":
        _, model = build_pair(linear_num_key_heads=4, linear_num_value_heads=8, num_key_value_heads=4)
    else:
        from test_qwen3_5 import build_pair as build_qwen3_5_pair  # 2 key / 4 value heads: divisible by 2

        _, model = build_qwen3_5_pair()
    apply_ops(model, OpsConfig(**EAGER_OPS))
    model.eval()
    # No router aux loss: it refuses a mask of another width by itself; the Gated DeltaNet layers are under test.
    extra = {"output_router_logits": False} if family == "qwen3_next" else {}
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 128, (2, length), generator=gen)
    positions = torch.arange(length)[None].expand(2, -1)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, length - 3 :] = 0
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, **extra).logits
        given = {"local": lambda: slice_sequence(mask, 1, group), "full": lambda: mask,
                 "wrong": lambda: mask[:, 4:]}[mask_form]()  # fmt: skip
        with use_parallel_state(state):
            try:
                local = model(input_ids=slice_sequence(ids, 1, group), attention_mask=given,
                              position_ids=slice_sequence(positions, 1, group), sp_unpadded_len=length,
                              use_cache=False, **extra).logits  # fmt: skip
            except ValueError as error:
                return {"error": str(error)}
    full = gather_sequence(local, group, dim=1, equal_sizes=True)[:, :length]
    return {"error": None, "rel": ((full - ref).abs().max() / ref.abs().max()).item()}


@pytest.mark.parametrize("length", [16, 15])
def test_sp_with_a_per_rank_padding_mask_equals_single_process(dist_pools, length):
    # Under SP every per-token input is this rank's shard, the padding mask too. 15 tokens: the shards are padded
    # to 16 (sp_unpadded_len).
    for worst in dist_pools.get(2).run(_sp_padding_mask_case, "qwen3_next", length, "local"):
        assert worst["error"] is None, worst
        assert worst["rel"] < 1e-5, worst


@pytest.mark.parametrize("mask_form", ["full", "wrong"])
def test_sp_refuses_a_padding_mask_that_is_not_the_ranks_shard(dist_pools, mask_form):
    # HF's create_recurrent_attention_mask trims a [B, S] mask to its last S/P columns on every rank: row 1's tail
    # padding zeroed the hidden states of rank 0's real tokens in every Gated DeltaNet layer, silently.
    for worst in dist_pools.get(2).run(_sp_padding_mask_case, "qwen3_next", 16, mask_form):
        assert worst["error"] is not None, worst
        assert "[2, 8]" in worst["error"] and "Ulysses SP" in worst["error"], worst


def _ep_step(ctx) -> dict:
    from veomni.core.ep import apply_expert_plan

    _, model = build_pair()
    # The oracle is our adapter unsharded with eager kernels: upstream's torch path cannot run packed rows.
    reference = copy.deepcopy(model)
    apply_ops(reference, OpsConfig(**EAGER_OPS))
    batches = [batch(seed=10 + r) for r in range(ctx.world_size)]
    # Oracle: the whole model on each rank's batch. Under EP, rank r's expert slices receive the gradient of every
    # rank's loss (tokens travel to their experts), its dense parameters only that of its own loss.
    ref_losses, ref_grads = [], []
    for b in batches:
        _, loss, grads = run(reference, b, **packed_kwargs(b["position_ids"]))
        ref_losses.append(loss)
        ref_grads.append(grads)
    state = build_parallel_state(ParallelDims(dp_shard=ctx.world_size, ep=ctx.world_size), ctx.device_type)
    shards = apply_expert_plan(model, model.get_parallel_plan(), ep_size=state.dims.ep, ep_rank=state.ep_rank)
    apply_ops(model, OpsConfig(**{**EAGER_OPS, "moe_experts": "torch"}))
    mine = batches[ctx.rank]
    with use_parallel_state(state):
        _, loss, grads = run(model, mine, **packed_kwargs(mine["position_ids"]))
    # A gradient's error is measured against its own largest element, floored at 1e-4 x the largest gradient element
    # of the model: the decay parameters (dt_bias, A_log) get gradients of ~1e-8 here, and fp32 reordering leaves
    # ~1e-12 on them, which is 1e-4 of their own size on some CPUs (2.7e-4 on an AMD EPYC) but no real error.
    floor = 1e-4 * max(float(g.abs().max()) for g in ref_grads[ctx.rank].values())
    worst = 0.0
    for name, grad in grads.items():
        if name in shards:
            want = sum(g[name] for g in ref_grads)[shards[name].start : shards[name].stop]
        else:
            want = ref_grads[ctx.rank][name]
        worst = max(worst, float((grad - want).abs().max()) / max(float(want.abs().max()), floor))
    return {
        "loss_err": float((loss - ref_losses[ctx.rank]).abs()),
        "worst_grad_rel": worst,
        "sharded": len(shards),
    }


def test_expert_parallel_matches_the_whole_model(dist_pools):
    for result in dist_pools.get(2).run(_ep_step):
        assert result["sharded"] == 6  # gate_up_proj and down_proj of the three MoE layers
        assert result["loss_err"] < 1e-5, result
        assert result["worst_grad_rel"] < 1e-4, result


@pytest.mark.cuda
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_fla_kernels_match_the_eager_oracles_on_gpu(packed):
    # The whole adapter on fla's Gated DeltaNet kernels (and the CUDA defaults elsewhere) against the same weights on
    # the eager oracles; fp32 weights, TF32-level agreement (fla's matmuls).
    problem = KERNELS.backend_problem("gated_delta_rule", "fla", detect_hardware())
    if problem is not None:
        pytest.skip(problem)  # fla not installed, or refused on this GPU / Triton (the registry's reason)
    _, eager = build_pair()
    eager = eager.cuda()
    fast = copy.deepcopy(eager)
    apply_ops(eager, OpsConfig(**EAGER_OPS))
    # Eager cross-entropy: the fused one never materialises the logits this test compares.
    apply_ops(fast, OpsConfig(attention="sdpa", moe_experts="torch", cross_entropy="eager", compile="off"))
    assert (fast.config._experts_implementation, fast.veomni_kernels.config.gated_delta_rule) == (
        "veomni",
        "fla",
    )
    inputs = {k: v.cuda() for k, v in batch(lengths=(70, 3, 55), rows=1 if packed else 2).items()}
    extra = packed_kwargs(inputs["position_ids"]) if packed else {}
    if not packed:
        inputs.pop("position_ids")
    # Measured on an H200: dt_bias grads ~1e-10 in fp32 eager came out ~8e-6 on fla (per-tensor slack failed).
    assert_match(run(fast, inputs, **extra), run(eager, inputs, **extra), 3e-3, model_scale=True)
