"""Patches Qwen3-Next's upstream modeling: Gated DeltaNet, norms, partial RoPE, MLPs and the losses through the
instance's kernels, packed varlen linear attention, and the expert-parallel plan.

- ``Qwen3NextGatedDeltaNet.forward``: training (no cache) runs the ``causal_conv1d`` and ``gated_delta_rule``
  kernels with the packing's ``cu_seq_lens_q``, so the convolution window and the recurrent state restart at
  every document of a packed row (upstream's torch fallback ignores ``cu_seqlens`` and leaks state across
  documents). Under Ulysses SP the projections are exchanged to head-sharded, whole-sequence tensors first
  (`veomni.models.qwen3_next.sp`). With a cache (generation) or without kernels it runs upstream's forward.
- ``Qwen3NextModel.forward``: upstream's, plus rows packed by ``position_ids`` alone (HF's
  ``DataCollatorWithFlattening``) get their ``cu_seq_lens_q/k`` derived once per forward, so the Gated DeltaNet layers
  (which HF never hands the positions) restart per document like the attention layers, and a packed or SP forward
  builds no default cache, which would send them to upstream's generation code
  (`veomni.models.qwen3_next.gdn.prepare_training_forward`; under SP from the gathered shards).
- ``Qwen3NextRMSNorm`` (``1 + weight``, all fp32) via the ``rms_norm/offset`` kernel; the gated output norm via
  ``rms_norm_gated``; attention's partial RoPE (``partial_rotary_factor``) via ``rope/partial``.
- Dense MLP / shared expert via ``swiglu``; routed experts through HF's experts interface (``"veomni"``: the
  ``moe_experts`` kernels and EP dispatch), as for Qwen3-MoE; LM head + loss and the aux loss as Qwen3-MoE.

Regenerate with ``uv run patchgen veomni.models.qwen3_next.patch_config``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from patchgen.config import PatchConfig
from transformers.models.qwen3_next import modeling_qwen3_next as upstream_modeling
from transformers.models.qwen3_next.modeling_qwen3_next import (
    ALL_ATTENTION_FUNCTIONS,
    Cache,
    DynamicCache,
    FlashAttentionKwargs,
    MoeModelOutputWithPast,
    Qwen3NextExperts,
    Qwen3NextGatedDeltaNet,
    Qwen3NextRMSNorm,
    Qwen3NextTopKRouter,
    TransformersKwargs,
    Unpack,
    apply_mask_to_padding_states,
    apply_rotary_pos_emb,
    eager_attention_forward,
    init,
)

from veomni.core.ep import ExpertPlan
from veomni.models.heads.seq_cls import seq_cls_forward
from veomni.models.hf.pretrained import upstream_checkpoint_io
from veomni.models.qwen3.patch_config import (
    SEQ_CLS_FORWARD,
    SEQ_CLS_INIT,
    add_token_heads,
    mlp_forward,
    seq_cls_init,
)
from veomni.models.qwen3_moe.patch_config import moe_causal_lm_forward
from veomni.models.qwen3_next.decoder import run_decoder_layers
from veomni.models.qwen3_next.gdn import (
    check_cached_call,
    gated_delta_net_train,
    init_decay_log,
    prepare_training_forward,
)

config = PatchConfig(
    source_module="transformers.models.qwen3_next.modeling_qwen3_next",
    target_file="patched_modeling_qwen3_next.py",
    description="Qwen3-Next with Gated DeltaNet (varlen, Ulysses SP), norms, partial RoPE, MLPs and losses "
    "dispatched through veomni's kernels, and get_parallel_plan() for expert parallelism",
)
upstream_checkpoint_io(config, "Qwen3NextPreTrainedModel")
config.add_import("from transformers.models.qwen3_next import modeling_qwen3_next as upstream_modeling")
config.add_import("from veomni.models.heads.causal_lm import lm_logits_and_loss, router_aux_loss")
config.add_import(
    "from veomni.models.qwen3_next.gdn import check_cached_call, gated_delta_net_train, init_decay_log, "
    "prepare_training_forward"
)
config.add_import("from veomni.models.qwen3_next.decoder import run_decoder_layers")
config.add_import("from veomni.core.ep import ExpertPlan")


@config.override_method(
    "Qwen3NextPreTrainedModel._init_weights",
    description="upstream's init, with the router initialised on its own module rather than on the sparse block "
    "that holds it, and A_log drawn on its own layout (FSDP2-sharded fresh init)",
)
def init_weights(self, module) -> None:
    super()._init_weights(module)
    # The text config's: a composite VLM's own config (Qwen3.5-MoE, which reuses this) has no initializer_range.
    std = self.config.get_text_config().initializer_range
    if isinstance(module, Qwen3NextGatedDeltaNet):
        init.ones_(module.dt_bias)
        # Lower bound kept away from 0 so that log(A) is finite (upstream's rule).
        init_decay_log(module.A_log)  # upstream's draw, also on an FSDP2-sharded parameter
    elif isinstance(module, Qwen3NextRMSNorm):
        init.zeros_(module.weight)  # the (1 + weight) norm: 0 is the identity scale
    elif isinstance(module, Qwen3NextExperts):
        init.normal_(module.gate_up_proj, mean=0.0, std=std)
        init.normal_(module.down_proj, mean=0.0, std=std)
    elif isinstance(module, Qwen3NextTopKRouter):
        # Upstream draws the router from its SparseMoeBlock branch, but transformers treats classes outside its
        # package as remote code and skips modules without parameters of their own: the block is never visited and
        # the router kept its zeros (uniform routing). Same distribution; drawn before the experts, not after.
        init.normal_(module.weight, mean=0.0, std=std)


config.override_method("Qwen3NextMLP.forward", description="SwiGLU via kernels.get('swiglu', 'standard')")(
    mlp_forward
)
config.override_method(
    "Qwen3NextForCausalLM.forward",
    description="LM head + loss via lm_logits_and_loss; aux loss via router_aux_loss (as Qwen3-MoE)",
)(moe_causal_lm_forward)


@config.override_method(
    "Qwen3NextRMSNorm.forward", description="(1 + weight) RMSNorm via kernels.get('rms_norm', 'offset')"
)
def offset_rms_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    kernels = getattr(self, "veomni_kernels", None)
    if kernels is not None and kernels.config.rms_norm != "eager":
        return kernels.get("rms_norm", "offset")(x, self.weight, self.eps)
    output = self._norm(x.float())
    return (output * (1.0 + self.weight.float())).type_as(x)


@config.override_method(
    "Qwen3NextRMSNormGated.forward", description="RMSNorm(x) * silu(gate) via kernels.get('rms_norm_gated')"
)
def gated_rms_norm_forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    kernels = getattr(self, "veomni_kernels", None)
    if kernels is not None and kernels.config.rms_norm_gated != "eager":
        return kernels.get("rms_norm_gated", "standard")(
            hidden_states, gate, self.weight, self.variance_epsilon
        )
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    hidden_states = self.weight * hidden_states.to(input_dtype)
    return (hidden_states * F.silu(gate.to(torch.float32))).to(input_dtype)


@config.override_method(
    "Qwen3NextAttention.forward", description="partial RoPE via kernels.get('rope', 'partial'), output gate"
)
def gated_attention_forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    past_key_values: Cache | None = None,
    **kwargs: Unpack[FlashAttentionKwargs],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    # q_proj emits each head's query followed by its output gate.
    query_states, gate = torch.chunk(
        self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim * 2), 2, dim=-1
    )
    gate = gate.reshape(*input_shape, -1)
    query_states = self.q_norm(query_states.view(hidden_shape)).transpose(1, 2)
    key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

    cos, sin = position_embeddings  # [B, S, R] with R = head_dim * partial_rotary_factor
    kernels = getattr(self, "veomni_kernels", None)
    if kernels is not None and kernels.config.rope != "eager":
        query_states, key_states = kernels.get("rope", "partial")(
            query_states, key_states, cos, sin, rotary_dim=cos.shape[-1]
        )
    else:
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

    if past_key_values is not None:
        key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)
    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, eager_attention_forward
    )
    attn_output, attn_weights = attention_interface(
        self,
        query_states,
        key_states,
        value_states,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        **kwargs,
    )
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    attn_output = attn_output * torch.sigmoid(gate)
    return self.o_proj(attn_output), attn_weights


@config.override_method(
    "Qwen3NextModel.forward",
    description="upstream's, with cu_seq_lens_q/k derived once from position_ids-only packing (HF's flattening "
    "collator) so that the Gated DeltaNet layers, which never see the positions, restart per document; no default "
    "cache for a packed or SP forward (it would send them to upstream's generation code)",
)
def text_model_forward(
    self,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values: Cache | None = None,
    inputs_embeds: torch.Tensor | None = None,
    use_cache: bool | None = None,
    **kwargs: Unpack[TransformersKwargs],
) -> MoeModelOutputWithPast:
    if (input_ids is None) ^ (inputs_embeds is not None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    if inputs_embeds is None:
        inputs_embeds = self.embed_tokens(input_ids)
    # The caller's positions (made-up ones below describe no packing), before the default cache is built.
    kwargs, use_cache = prepare_training_forward(
        self, position_ids, inputs_embeds, past_key_values, use_cache, kwargs
    )
    if use_cache and past_key_values is None:
        past_key_values = DynamicCache(config=self.config)
    if position_ids is None:
        past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
        position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
        position_ids = position_ids.unsqueeze(0)

    hidden_states = run_decoder_layers(
        self, inputs_embeds, attention_mask, past_key_values, position_ids, position_ids, use_cache, kwargs
    )
    hidden_states = self.norm(hidden_states)
    return MoeModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=past_key_values)


@config.override_method(
    "Qwen3NextGatedDeltaNet.forward",
    description="training: causal_conv1d + gated_delta_rule kernels with cu_seq_lens_q (state reset per "
    "packed document) and Ulysses SP over heads; generation (a cache) or no kernels: upstream's forward",
)
def gated_delta_net_forward(
    self,
    hidden_states: torch.Tensor,
    cache_params: Cache | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Unpack[TransformersKwargs],
) -> torch.Tensor:
    kernels = getattr(self, "veomni_kernels", None)
    if kernels is None or cache_params is not None:
        if kernels is not None:
            check_cached_call(kwargs)  # upstream's cached path reads neither packing nor SP shards
        return upstream_modeling.Qwen3NextGatedDeltaNet.forward(
            self, hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs
        )
    hidden_states = apply_mask_to_padding_states(hidden_states, attention_mask)
    query, key, value, z, b, a = self.fix_query_key_value_ordering(
        self.in_proj_qkvz(hidden_states), self.in_proj_ba(hidden_states)
    )
    # [B, T, conv_dim] in the conv weight's channel order: all q heads, all k heads, all v heads.
    mixed_qkv = torch.cat([x.flatten(2) for x in (query, key, value)], dim=-1)
    return gated_delta_net_train(self, kernels, mixed_qkv, z, b, a, kwargs)


@config.add_method(
    "Qwen3NextForCausalLM.get_parallel_plan",
    description="expert parallelism: shard the fused expert tensors on dim 0 (experts) across the EP group",
)
def get_parallel_plan(self) -> ExpertPlan:
    """FQN globs, relative to this model, of the ``[E, ...]`` expert tensors that EP shards on dim 0."""
    return ExpertPlan(
        patterns=("model.layers.*.mlp.experts.gate_up_proj", "model.layers.*.mlp.experts.down_proj")
    )


# Sequence classification: this module's patched decoder inside the classifier (veomni.models.qwen3.patch_config
# seq_cls_init) and the classification CE through the kernel registry (veomni.models.heads.seq_cls).
config.add_import(
    "from veomni.models.heads.seq_cls import init_sequence_classifier, sequence_classification_forward"
)
config.add_import("from transformers.modeling_outputs import SequenceClassifierOutputWithPast")
config.add_method(
    "Qwen3NextForSequenceClassification.__init__", description=SEQ_CLS_INIT, name_map={"Qwen3": "Qwen3Next"}
)(seq_cls_init)
config.add_method("Qwen3NextForSequenceClassification.forward", description=SEQ_CLS_FORWARD)(seq_cls_forward)
config.add_method(
    "Qwen3NextForSequenceClassification.get_parallel_plan",
    description="expert parallelism as for the causal LM (the classifier's decoder has the same model.* names)",
)(get_parallel_plan)

# Token classification and question answering: this module's patched decoder inside (veomni.models.heads.token_heads).
add_token_heads(config, "Qwen3Next")
