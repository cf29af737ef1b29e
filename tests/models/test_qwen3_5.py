"""The generated Qwen3.5 text adapter (``qwen3_5_text``) against upstream transformers, and packed varlen against
per-document runs. It reuses Qwen3-Next's patches and Gated DeltaNet training path (`test_qwen3_next` covers SP,
checkpoints and the kernels); this file proves Qwen3.5's own projections and layer wiring.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_qwen3_next import (
    EAGER_OPS,
    _sp_padding_mask_case,
    assert_fresh_init_like_upstream,
    assert_match,
    batch,
    run,
)
from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5 as upstream_modeling
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as upstream_moe_modeling

from veomni.core.ep import apply_expert_plan
from veomni.kernels import OpsConfig
from veomni.models.hf.attention import packed_kwargs
from veomni.models.hf.kernel_hooks import apply_ops
from veomni.models.qwen3_5.generated.patched_modeling_qwen3_5 import Qwen3_5ForCausalLM
from veomni.models.qwen3_5_moe.generated.patched_modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM
from veomni.models.registry import MODELS


@pytest.fixture(autouse=True)
def torch_fallback(monkeypatch):
    # As in test_qwen3_next: upstream sends its Gated DeltaNet to fla (CUDA-only) whenever fla is installed, and the
    # upstream models here run on CPU tensors.
    for module in (upstream_modeling, upstream_moe_modeling):
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                     "causal_conv1d_update"):  # fmt: skip
            fn = getattr(module, name)
            monkeypatch.setattr(module, name, getattr(fn, "__wrapped__", fn))


def build_pair(moe: bool = False):
    config_class = Qwen3_5MoeTextConfig if moe else Qwen3_5TextConfig
    extra = dict(moe_intermediate_size=16, shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                 output_router_logits=True, router_aux_loss_coef=0.05) if moe else {}  # fmt: skip
    config = config_class(
        **extra,
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, max_position_embeddings=256, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [1, 1, 0], "mrope_interleaved": True},
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    if moe:
        config._experts_implementation = "eager"
    torch.manual_seed(0)
    upstream_class = (
        upstream_moe_modeling.Qwen3_5MoeForCausalLM if moe else upstream_modeling.Qwen3_5ForCausalLM
    )
    upstream = upstream_class(copy.deepcopy(config))
    with torch.no_grad():  # zero-initialised offset norms would hide the (1 + w) path
        for name, p in upstream.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0, 0.1)
    ours = (Qwen3_5MoeForCausalLM if moe else Qwen3_5ForCausalLM)(config)
    missing, unexpected = ours.load_state_dict(upstream.state_dict(), strict=True)
    assert not missing and not unexpected
    return upstream, ours


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_registered_for_causal_lm(moe):
    upstream, _ = build_pair(moe)
    want = Qwen3_5MoeForCausalLM if moe else Qwen3_5ForCausalLM
    assert MODELS.model_class(upstream.config, "causal_lm").cls is want


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_without_kernels_is_bitwise_upstream_and_eager_kernels_match(moe):
    upstream, ours = build_pair(moe)
    inputs = {k: v for k, v in batch(rows=2).items() if k != "position_ids"}
    want = run(upstream, inputs)
    got = run(ours, inputs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    apply_ops(ours, OpsConfig(**EAGER_OPS))
    assert_match(run(ours, inputs), want, 2e-5)


@pytest.mark.parametrize("packing", ["cu_seq_lens_q", "position_ids"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_packed_row_equals_documents_run_alone(moe, packing):
    # position_ids alone is HF's DataCollatorWithFlattening packing: every layer, Gated DeltaNet too, must honour it.
    _, ours = build_pair(moe)
    apply_ops(ours, OpsConfig(**EAGER_OPS))
    inputs = batch(lengths=(7, 12, 5))
    no_aux = {"output_router_logits": False} if moe else {}  # the aux loss is a statistic of the whole row
    extra = packed_kwargs(inputs["position_ids"]) if packing == "cu_seq_lens_q" else {}
    packed = run(ours, inputs, **extra, **no_aux)
    ours.zero_grad(set_to_none=True)
    bounds = [(0, 7), (7, 19), (19, 24)]
    logits = torch.cat(
        [ours(input_ids=inputs["input_ids"][:, a:b], use_cache=False, **no_aux).logits for a, b in bounds], 1
    )
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], inputs["labels"][0, 1:], ignore_index=-100)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in ours.named_parameters() if p.grad is not None}
    assert_match(packed, (logits.detach(), loss.detach(), grads), 2e-5)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_packed_forward_with_the_default_use_cache_runs_the_training_path(moe):
    # The config's use_cache=True builds a cache unless the caller says otherwise (HF's Trainer does not), and a cache
    # sends Gated DeltaNet to upstream's generation code, which ignores the packing.
    _, ours = build_pair(moe)
    apply_ops(ours, OpsConfig(**EAGER_OPS))
    assert ours.config.use_cache
    inputs = batch(lengths=(7, 12, 5))
    no_aux = {"output_router_logits": False} if moe else {}
    with torch.no_grad():
        default = ours(**inputs, **no_aux).logits
        training = ours(**inputs, use_cache=False, **no_aux).logits
    torch.testing.assert_close(default, training, rtol=0, atol=0)


@pytest.mark.parametrize("mask_form", ["local", "full"])
def test_sp_takes_the_padding_mask_of_the_ranks_shard(dist_pools, mask_form):
    # The shared text-model body (veomni.models.qwen3_5.text_model) builds the Gated DeltaNet mask as Qwen3-Next's
    # forward does: a per-rank mask equals one process; a full [B, S] one (HF would cut it to the last shard on
    # every rank, zeroing rank 0's real tokens) is refused.
    for worst in dist_pools.get(2).run(_sp_padding_mask_case, "qwen3_5", 15, mask_form):
        if mask_form == "local":
            assert worst["error"] is None and worst["rel"] < 1e-5, worst
        else:
            assert worst["error"] is not None and "[2, 8]" in worst["error"], worst


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_fresh_init_draws_every_weight_as_upstream_does(moe):
    # Both override _init_weights (A_log drawn on its own layout, for FSDP2-sharded fresh inits): on plain tensors
    # the draws stay upstream's.
    upstream, ours = build_pair(moe=moe)
    assert_fresh_init_like_upstream(type(upstream), type(ours), ours.config)


def test_moe_parallel_plan_shards_the_fused_experts():
    _, ours = build_pair(moe=True)
    shards = apply_expert_plan(ours, ours.get_parallel_plan(), ep_size=4, ep_rank=1)
    assert sorted(shards) == sorted(
        f"model.layers.{i}.mlp.experts.{name}" for i in range(4) for name in ("gate_up_proj", "down_proj")
    )
    assert all(s.start == 2 and s.stop == 4 for s in shards.values())


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_released_vlm_checkpoint_trains_text_only_as_a_causal_lm(tmp_path, moe):
    # Qwen3.5 checkpoints carry the VLM model_type; transformers' AutoModelForCausalLM builds the text model from
    # them (the tower's weights left out), and so does build_model(task="causal_lm"), with the same logits.
    from transformers import AutoModelForCausalLM, Qwen3_5Config, Qwen3_5MoeConfig

    from veomni.models.build import build_model

    text = dict(vocab_size=128, hidden_size=48, intermediate_size=72, num_hidden_layers=4, num_attention_heads=6,
                num_key_value_heads=2, head_dim=12, linear_num_key_heads=2, linear_num_value_heads=6,
                linear_key_head_dim=10, linear_value_head_dim=6)  # fmt: skip
    if moe:
        del text["intermediate_size"]
        text.update(
            moe_intermediate_size=20, shared_expert_intermediate_size=28, num_experts=4, num_experts_per_tok=2
        )
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48)
    config = (Qwen3_5MoeConfig if moe else Qwen3_5Config)(text_config=text, vision_config=vision)
    vlm_class = (
        upstream_moe_modeling.Qwen3_5MoeForConditionalGeneration
        if moe
        else upstream_modeling.Qwen3_5ForConditionalGeneration
    )
    torch.manual_seed(0)
    vlm_class(config).save_pretrained(tmp_path)
    upstream = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ours = build_model(
        str(tmp_path), weights=str(tmp_path), ops=OpsConfig(**EAGER_OPS), task="causal_lm"
    ).eval()
    assert type(ours) is (Qwen3_5MoeForCausalLM if moe else Qwen3_5ForCausalLM)
    # The trainer's meta probe (block patterns, FLOPs) takes the same text config.
    from veomni.train.model_setup import meta_instance

    assert type(meta_instance(str(tmp_path), "causal_lm")) is type(ours)
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, upstream(ids).logits, rtol=2e-5, atol=2e-5)
