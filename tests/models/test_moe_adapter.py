"""The generated Qwen3-MoE adapter equals upstream transformers (bitwise in eager mode, within tolerance with veomni
kernels) on a packed batch, keeps the aux loss safe, generates, and runs expert-parallel on real gloo ranks."""

from __future__ import annotations

import copy

import adapter_helpers
import pytest
import torch
import torch.distributed as dist
from adapter_helpers import DEVICE, upstream_pair
from dist_harness import backend_params
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeForCausalLM as UpstreamQwen3Moe

from veomni.core.ep import apply_expert_plan
from veomni.core.parallel_dims import ParallelDims
from veomni.core.parallel_state import build_parallel_state, use_parallel_state
from veomni.kernels import OpsConfig, resolve_kernels
from veomni.models.hf.attention import packed_kwargs
from veomni.models.hf.experts import register_hf_experts
from veomni.models.hf.kernel_hooks import apply_ops, attach_kernels
from veomni.models.qwen3_moe.generated.patched_modeling_qwen3_moe import Qwen3MoeForCausalLM

EAGER_OPS = dict(
    rms_norm="eager", rope="eager", swiglu="eager", moe_experts="eager", cross_entropy="eager",
    load_balancing_loss="eager",
)  # fmt: skip


def tiny_config(**overrides) -> Qwen3MoeConfig:
    # Qwen3-30B-A3B's ratios (GQA, explicit head_dim, expert width 3/8 of hidden, top-k of many experts), cut down;
    # layer 0 dense (mlp_only_layers) so the dense MLP path is covered too.
    values = dict(
        vocab_size=128, hidden_size=64, intermediate_size=160, moe_intermediate_size=24, num_experts=8,
        num_experts_per_tok=3, num_hidden_layers=3, mlp_only_layers=[0], num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
        tie_word_embeddings=False, output_router_logits=True, router_aux_loss_coef=0.05, norm_topk_prob=True,
    )  # fmt: skip
    values.update(overrides)
    config = Qwen3MoeConfig(**values)
    config._attn_implementation = "sdpa"
    config._experts_implementation = "eager"
    return config


def build_pair(**overrides) -> tuple[torch.nn.Module, torch.nn.Module]:
    return upstream_pair(UpstreamQwen3Moe, Qwen3MoeForCausalLM, tiny_config(**overrides))


def packed_batch(lengths=(7, 12, 5), seed: int = 1) -> dict[str, torch.Tensor]:
    """`adapter_helpers.packed_batch` over this module's documents (7, 12, 5)."""
    return adapter_helpers.packed_batch(lengths, seed)


def run(
    model: torch.nn.Module, inputs: dict, **extra
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, float]:
    model.zero_grad(set_to_none=True)
    # No cache: HF then reads the packing from position_ids (with a cache it would attend across documents).
    out = model(**inputs, use_cache=False, **extra)
    out.loss.backward()
    norm = float(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).norm())
    logits = None if out.logits is None else out.logits.detach()
    return logits, out.loss.detach(), out.aux_loss.detach(), norm


def test_eager_kernels_are_bitwise_upstream():
    # Without kernels: tests/models/test_conformance.py (parity).
    upstream, ours = build_pair()
    attach_kernels(ours, resolve_kernels(OpsConfig(**EAGER_OPS)))
    ours.set_experts_implementation(register_hf_experts())  # the veomni experts function, eager branch
    want = run(upstream, packed_batch())
    got = run(ours, packed_batch())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert got[3] == want[3]


def test_apply_ops_selects_veomni_experts_and_attention():
    _, ours = build_pair()
    apply_ops(ours, OpsConfig(attention="sdpa", moe_experts="eager"))
    assert ours.config._experts_implementation == "veomni"
    assert ours.config._attn_implementation == "veomni_sdpa"


def test_veomni_experts_without_kernels_is_a_clear_error():
    _, ours = build_pair()
    ours.set_experts_implementation(register_hf_experts())
    with pytest.raises(RuntimeError, match="has no veomni kernels attached"):
        ours(**packed_batch())


@pytest.mark.parametrize(
    "ops",
    [
        {"load_balancing_loss": "triton"},
        {"moe_experts": "torch"},
        {"moe_experts": "triton"},
        {"cross_entropy": "triton"},
        {"rms_norm": "triton", "rope": "triton", "swiglu": "triton", "moe_experts": "triton",
         "cross_entropy": "triton", "load_balancing_loss": "triton"},
    ],
    ids=lambda ops: "+".join(f"{k}={v}" for k, v in ops.items()) if len(ops) < 3 else "all-triton",
)  # fmt: skip
def test_kernel_combinations_match_upstream(ops):
    upstream, ours = build_pair()
    apply_ops(ours, OpsConfig(**{**EAGER_OPS, "attention": "sdpa", **ops}))
    batch = packed_batch(seed=2)
    want = run(upstream, batch)
    got = run(ours, batch, **packed_kwargs(batch["position_ids"]))
    if ops.get("cross_entropy", "eager") == "eager":
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    else:
        assert got[0] is None  # the fused loss never materialises logits
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)
    assert got[3] == pytest.approx(want[3], rel=1e-4)


def test_aux_loss_is_skipped_without_router_logits():
    # Every layer dense: HF records no router logits. Upstream then crashes on `int.to`; ours leaves the aux term out.
    upstream, ours = build_pair(mlp_only_layers=[0, 1, 2])
    with pytest.raises((AttributeError, IndexError)):  # depends on the transformers version
        upstream(**packed_batch())
    out = ours(**packed_batch())
    assert out.aux_loss is None
    reference = ours(**packed_batch(), output_router_logits=False)
    assert torch.equal(out.loss, reference.loss)


def test_shift_labels_and_num_items_in_batch_follow_hf():
    upstream, ours = build_pair()
    apply_ops(ours, OpsConfig(**{**EAGER_OPS, "attention": "sdpa", "cross_entropy": "triton"}))
    batch = packed_batch(seed=3)
    shifted = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[..., 1:]
    kwargs = {
        "num_items_in_batch": torch.tensor(50, device=DEVICE),
        "output_router_logits": False,
        "use_cache": False,
    }
    want = upstream(**batch, **kwargs).loss
    positions = batch["position_ids"]
    got = ours(
        input_ids=batch["input_ids"],
        position_ids=positions,
        shift_labels=shifted,
        **packed_kwargs(positions),
        **kwargs,
    )
    torch.testing.assert_close(got.loss, want, rtol=1e-5, atol=1e-6)


def test_logits_to_keep_and_generation_match_upstream():
    upstream, ours = build_pair()
    apply_ops(ours, OpsConfig(**{**EAGER_OPS, "attention": "sdpa", "cross_entropy": "triton"}))
    ids = packed_batch()["input_ids"][:, :9]
    last = ours(input_ids=ids, logits_to_keep=1).logits
    torch.testing.assert_close(last, upstream(input_ids=ids, logits_to_keep=1).logits, rtol=1e-5, atol=1e-5)
    assert last.shape[1] == 1
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **settings), upstream.generate(ids, **settings))


def test_parallel_plan_shards_the_fused_experts_on_dim_0():
    config = tiny_config()
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config)
    shards = apply_expert_plan(model, model.get_parallel_plan(), ep_size=4, ep_rank=1)
    moe_layers = [1, 2]  # layer 0 is dense
    assert sorted(shards) == sorted(
        f"model.layers.{i}.mlp.experts.{name}" for i in moe_layers for name in ("gate_up_proj", "down_proj")
    )
    experts = model.model.layers[1].mlp.experts
    assert experts.gate_up_proj.shape == (2, 2 * 24, 64) and experts.down_proj.shape == (2, 64, 24)
    assert all(s.start == 2 and s.stop == 4 for s in shards.values())


# ---------------------------------------------------------------- expert parallelism on real ranks


def _ep_step(ctx, backend: str) -> dict:
    config = tiny_config()
    torch.manual_seed(0)
    reference = UpstreamQwen3Moe(config).to(ctx.device)
    model = Qwen3MoeForCausalLM(config).to(ctx.device)
    model.load_state_dict(reference.state_dict())
    batches = [packed_batch(seed=10 + r) for r in range(ctx.world_size)]
    batches = [{k: v.to(ctx.device) for k, v in b.items()} for b in batches]

    # Oracle: the whole model on each rank's batch. Under EP, rank r's expert slices receive the gradient of every
    # rank's loss (tokens travel to their experts), its dense parameters only that of its own loss.
    ref_losses, ref_grads = [], []
    for b in batches:
        reference.zero_grad(set_to_none=True)
        loss = reference(**b, use_cache=False).loss
        loss.backward()
        ref_losses.append(loss.detach())
        ref_grads.append({n: p.grad.clone() for n, p in reference.named_parameters()})

    state = build_parallel_state(ParallelDims(dp_shard=ctx.world_size, ep=ctx.world_size), ctx.device_type)
    shards = apply_expert_plan(model, model.get_parallel_plan(), ep_size=state.dims.ep, ep_rank=state.ep_rank)
    apply_ops(model, OpsConfig(**{**EAGER_OPS, "attention": "sdpa", "moe_experts": backend}))
    mine = batches[ctx.rank]
    with use_parallel_state(state):
        loss = model(**mine, **packed_kwargs(mine["position_ids"])).loss
        loss.backward()
    loss_ok = torch.allclose(loss.detach(), ref_losses[ctx.rank], rtol=1e-5, atol=1e-6)
    worst = 0.0
    for name, param in model.named_parameters():
        if name in shards:
            shard = shards[name]
            want = sum(g[name] for g in ref_grads)[shard.start : shard.stop]
        else:
            want = ref_grads[ctx.rank][name]
        worst = max(worst, float((param.grad - want).abs().max() / want.abs().max().clamp(min=1e-12)))
    return {"loss_ok": loss_ok, "worst_expert_grad_rel": worst}


@pytest.mark.parametrize("world_size, backend", backend_params(2))
@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_expert_parallel_matches_the_whole_model(dist_pools, world_size, backend, kernel):
    pool = dist_pools.get(world_size, backend)
    for result in pool.run(_ep_step, kernel):
        assert result["loss_ok"]
        assert result["worst_expert_grad_rel"] < 1e-4


def _ep_eager(ctx) -> str:
    config = tiny_config()
    model = Qwen3MoeForCausalLM(config).to(ctx.device)
    state = build_parallel_state(ParallelDims(dp_shard=ctx.world_size, ep=ctx.world_size), ctx.device_type)
    apply_expert_plan(model, model.get_parallel_plan(), ep_size=state.dims.ep, ep_rank=state.ep_rank)
    apply_ops(model, OpsConfig(**{**EAGER_OPS, "attention": "sdpa"}))
    try:
        with use_parallel_state(state):
            model(**{k: v.to(ctx.device) for k, v in packed_batch().items()})
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("world_size, backend", backend_params(2))
def test_eager_experts_are_refused_under_expert_parallelism(dist_pools, world_size, backend):
    for message in dist_pools.get(world_size, backend).run(_ep_eager):
        assert "cannot run on expert-parallel shards" in message and "holds 4 of 8 experts" in message


def _sp_router_step(ctx, state_real_length: bool) -> dict:
    """SP over a packed row of odd length: the row is padded by one token that the routers see on the last rank."""
    from veomni.core.sp import slice_sequence
    from veomni.core.sp.real_tokens import use_real_length
    from veomni.models.hf.attention import register_hf_attention

    register_hf_attention()
    config = tiny_config(router_aux_loss_coef=1.0)  # the aux term dominates the router gradients
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).to(ctx.device)
    apply_ops(model, OpsConfig(**{**EAGER_OPS, "attention": "sdpa"}))
    reference = copy.deepcopy(model)
    batch = {k: v.to(ctx.device) for k, v in packed_batch(lengths=(7, 12, 6), seed=4).items()}
    length = batch["input_ids"].shape[1]
    assert length % ctx.world_size, "the row must need SP padding"
    shift = torch.cat([batch["labels"][:, 1:], torch.full_like(batch["labels"][:, :1], -100)], dim=1)
    items = int((shift != -100).sum())

    out = reference(input_ids=batch["input_ids"], position_ids=batch["position_ids"], shift_labels=shift,
                    num_items_in_batch=items, use_cache=False, **packed_kwargs(batch["position_ids"]))  # fmt: skip
    out.loss.backward()

    state = build_parallel_state(ParallelDims(sp=ctx.world_size), ctx.device_type)
    group = state.sp_group
    # The SP padding is a packed segment of its own (positions restart at 0), as the trainer's collate writes it.
    padded_positions = torch.cat(
        [batch["position_ids"], torch.arange(-length % ctx.world_size, device=ctx.device)[None]], dim=1
    )
    with use_parallel_state(state), use_real_length(length if state_real_length else None):
        mine = model(
            input_ids=slice_sequence(batch["input_ids"], 1, group),
            position_ids=slice_sequence(padded_positions, 1, group),
            shift_labels=slice_sequence(shift, 1, group, pad_value=-100).contiguous(),
            num_items_in_batch=items, use_cache=False, **packed_kwargs(padded_positions),
        )  # fmt: skip
        mine.loss.backward()
    aux = mine.aux_loss.detach().clone()
    dist.all_reduce(aux, group=group)
    worst = 0.0
    for name, param in model.named_parameters():
        if "mlp.gate." not in name:
            continue
        got = param.grad.clone()
        dist.all_reduce(got, group=group)  # each SP rank holds its tokens' share of the gradient
        want = dict(reference.named_parameters())[name].grad
        worst = max(worst, float((got - want).abs().max() / want.abs().max()))
    return {"aux": float(aux), "ref_aux": float(out.aux_loss), "worst_router_grad_rel": worst}


@pytest.mark.parametrize("world_size, backend", backend_params(2))
def test_sp_padding_stays_out_of_the_router_statistics(dist_pools, world_size, backend):
    """A row of odd length under SP2: with its real length stated (as the trainer does), the load-balancing loss and
    the router gradients equal one process on the unpadded row; without it, the padding token is counted."""
    pool = dist_pools.get(world_size, backend)
    for result in pool.run(_sp_router_step, True):
        assert result["aux"] == pytest.approx(result["ref_aux"], rel=1e-5)
        assert result["worst_router_grad_rel"] < 1e-4, result
    for result in pool.run(_sp_router_step, False):
        assert result["worst_router_grad_rel"] > 1e-3, result  # what the stated length prevents
