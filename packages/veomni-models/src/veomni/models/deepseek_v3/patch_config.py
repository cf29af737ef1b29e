"""Patches DeepSeek-V3's upstream modeling (MLA attention, group-limited sigmoid router, shared + routed experts):
dense ops, RoPE and the LM loss through the instance's kernels, an fp32 router bias, and the expert-parallel plan.

What runs where:

- RMSNorm (every one: the layer norms, ``q_a_layernorm`` and ``kv_a_layernorm`` on the LoRA latents) and the
  SwiGLU MLPs (the ``first_k_dense_replace`` dense layers and the shared experts, both ``DeepseekV3MLP``) reuse
  the Qwen3 config's functions: same maths.
- MLA attention is upstream's forward with the RoPE call swapped for `apply_mla_rope`: the rotary part of q and
  k (``qk_rope_head_dim`` dims) goes through ``kernels.get('rope', 'full')``. With ``rope_interleave`` (DeepSeek's
  published checkpoints) upstream rotates adjacent pairs and writes the results de-interleaved ``[evens, odds]``;
  that is rotate-half RoPE on the de-interleaved input, so the kernel gets the de-interleaved tensors and the
  output is upstream's. Keys are ``qk_nope + qk_rope`` wide, values ``v_head_dim``: veomni's attention backends and
  Ulysses SP take a value head size of its own (varlen / FlashAttention zero-pad the values and slice).
- The router (``DeepseekV3TopkRouter``) keeps upstream's forward: fp32 sigmoid scores, ``e_score_correction_bias``
  added for the choice only, group-limited top-k (``n_group`` groups scored by their top-2 sum, ``topk_group``
  kept), weights from the unbiased scores, ``norm_topk_prob`` and ``routed_scaling_factor``. Its ``__init__`` is
  patched only to create the bias buffer in fp32 whatever the build dtype, as ``from_pretrained`` does through
  ``_keep_in_fp32_modules_strict`` (a bf16 bias would change which experts win close calls).
- ``e_score_correction_bias``: transformers defines no update rule for it (DeepSeek's aux-loss-free balancing
  adjusts it outside the gradient, in their own trainer), so here it is a persistent, non-trained buffer kept
  exactly as loaded: saved by DCP checkpoints and written by the HF export unchanged.
- The routed experts (``DeepseekV3Experts``: fused ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) are not
  patched: they dispatch through HF's experts interface to ``"veomni"`` (`veomni.models.hf.experts`: the
  ``moe_experts`` kernels, EP dispatch/combine when sharded), which checks them against the experts contract.
- The causal-LM forward computes the LM head + loss through `lm_logits_and_loss`. Like upstream it adds no
  auxiliary loss (transformers' DeepSeek-V3 has none; router logits are still recorded on request).

Regenerate with ``uv run patchgen veomni.models.deepseek_v3.patch_config``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from patchgen.config import PatchConfig
from torch import nn
from transformers.cache_utils import Cache
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    ALL_ATTENTION_FUNCTIONS,
    DeepseekV3Config,
    FlashAttentionKwargs,
    MoeCausalLMOutputWithPast,
    MoeModelOutputWithPast,
    TransformersKwargs,
    Unpack,
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_interleave,
    eager_attention_forward,
)

from veomni.core.ep import ExpertPlan
from veomni.models.heads.causal_lm import lm_logits_and_loss
from veomni.models.heads.seq_cls import seq_cls_forward
from veomni.models.hf.masks import use_veomni_masks
from veomni.models.hf.pretrained import upstream_checkpoint_io
from veomni.models.qwen3.patch_config import (
    SEQ_CLS_INIT,
    add_token_heads,
    mlp_forward,
    rms_norm_forward,
    seq_cls_init,
)

config = PatchConfig(
    source_module="transformers.models.deepseek_v3.modeling_deepseek_v3",
    target_file="patched_modeling_deepseek_v3.py",
    description="DeepSeek-V3 (MLA, group-limited sigmoid router, shared experts) with RMSNorm, SwiGLU, RoPE and the "
    "LM loss dispatched through veomni's kernels, an fp32 router bias, and get_parallel_plan() for expert parallelism",
)
upstream_checkpoint_io(config, "DeepseekV3PreTrainedModel")
use_veomni_masks(config, "create_causal_mask")
config.add_import("from veomni.models.heads.causal_lm import lm_logits_and_loss")
config.add_import("from veomni.core.ep import ExpertPlan")
config.override_method(
    "DeepseekV3RMSNorm.forward", description="RMSNorm via kernels.get('rms_norm', 'standard')"
)(rms_norm_forward)
config.override_method(
    "DeepseekV3MLP.forward",
    description="SwiGLU via kernels.get('swiglu', 'standard') (dense layers and shared experts)",
)(mlp_forward)


@config.add_helper(
    description="MLA RoPE on the qk_rope_head_dim sub-dimension through the rope kernel, rope_interleave included",
    after="apply_rotary_pos_emb_interleave",
)
def apply_mla_rope(
    module: nn.Module, q_rot: torch.Tensor, k_rot: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE for MLA's rotary sub-heads, through ``module``'s kernel set or upstream's function when eager.

    Args:
        module: the attention module (its ``config.rope_interleave`` picks the layout).
        q_rot: ``[B, H, S, R]``; k_rot: ``[B, 1, S, R]`` (the shared rotary key); cos, sin: ``[B, S, R]``.
    Returns:
        the rotated ``(q_rot, k_rot)``, same shapes and dtype, in the layout upstream returns: with
        ``rope_interleave`` the rotated pairs come back de-interleaved (``[evens, odds]``), as upstream writes them.
    """
    interleave = module.config.rope_interleave
    kernels = getattr(module, "veomni_kernels", None)
    if kernels is None or kernels.config.rope == "eager":
        upstream = apply_rotary_pos_emb_interleave if interleave else apply_rotary_pos_emb
        return upstream(q_rot, k_rot, cos, sin)
    if interleave:
        # Upstream rotates (x0, x1), (x2, x3), ... by one frequency each and writes [rotated evens, rotated odds]:
        # rotate-half RoPE of [x0, x2, ..., x1, x3, ...]. cos/sin are cat(freqs, freqs), as rotate-half expects.
        q_rot = torch.cat((q_rot[..., 0::2], q_rot[..., 1::2]), dim=-1)
        k_rot = torch.cat((k_rot[..., 0::2], k_rot[..., 1::2]), dim=-1)
    return kernels.get("rope", "full")(q_rot, k_rot, cos, sin)


@config.modify_init(
    "DeepseekV3TopkRouter",
    description="e_score_correction_bias created in fp32 whatever the build dtype (as from_pretrained keeps it via "
    "_keep_in_fp32_modules_strict)",
)
def router_init(self, config: DeepseekV3Config) -> None:
    super().__init__()
    self.top_k = config.num_experts_per_tok
    self.num_experts = config.num_local_experts
    self.hidden_dim = config.hidden_size
    self.weight = nn.Parameter(torch.zeros(self.num_experts, self.hidden_dim))
    self.routed_scaling_factor = config.routed_scaling_factor
    self.num_group = config.n_group
    self.topk_group = config.topk_group
    self.norm_topk_prob = config.norm_topk_prob
    # A persistent, non-trained buffer: transformers defines no update rule for the aux-loss-free bias.
    self.e_score_correction_bias = nn.Buffer(torch.zeros(self.num_experts, dtype=torch.float32))


@config.override_method(
    "DeepseekV3Attention.forward",
    description="RoPE on the rotary sub-dimension via apply_mla_rope (kernels.get('rope', 'full'), rope_interleave "
    "handled); attention through the configured interface with v_head_dim != qk_head_dim",
)
def attention_forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    past_key_values: Cache | None = None,
    **kwargs: Unpack[FlashAttentionKwargs],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    batch_size, seq_length = hidden_states.shape[:-1]
    query_shape = (batch_size, seq_length, -1, self.qk_head_dim)

    if self.q_lora_rank is None:
        q_states = self.q_proj(hidden_states)
    else:
        q_states = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    q_states = q_states.view(query_shape).transpose(1, 2)
    q_pass, q_rot = torch.split(q_states, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)

    compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
    kv_nope, k_rot = torch.split(compressed_kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    kv_nope = self.kv_a_layernorm(kv_nope)
    kv_nope = kv_nope.view(batch_size, 1, seq_length, self.kv_lora_rank)
    k_rot = k_rot.view(batch_size, 1, seq_length, self.qk_rope_head_dim)

    cos, sin = position_embeddings
    q_rot, k_rot = apply_mla_rope(self, q_rot, k_rot, cos, sin)

    if past_key_values is not None:
        kv_nope, k_rot = past_key_values.update(kv_nope, k_rot, self.layer_idx)

    query_states = torch.cat((q_pass, q_rot), dim=-1)
    key_states, value_states = self.expand_kv(kv_nope, k_rot)

    attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
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
    attn_output = attn_output.reshape(batch_size, seq_length, -1).contiguous()
    attn_output = self.o_proj(attn_output)
    return attn_output, attn_weights


@config.override_method(
    "DeepseekV3ForCausalLM.forward",
    description="LM head + loss via lm_logits_and_loss (fused linear cross-entropy gets hidden states + LM-head "
    "weight); no aux loss, as upstream",
)
def causal_lm_forward(
    self,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values: Cache | None = None,
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.LongTensor | None = None,
    use_cache: bool | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    **kwargs: Unpack[TransformersKwargs],
) -> MoeCausalLMOutputWithPast:
    outputs: MoeModelOutputWithPast = self.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        **kwargs,
    )
    logits, loss = lm_logits_and_loss(self, outputs.last_hidden_state, labels, logits_to_keep, **kwargs)
    return MoeCausalLMOutputWithPast(
        loss=loss,
        logits=logits,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
        router_logits=outputs.router_logits,
    )


@config.override_method(
    "DeepseekV3ForCausalLM.get_parallel_plan",
    description="expert parallelism: shard the fused routed-expert tensors on dim 0 (experts) across the EP group; "
    "shared experts, dense layers and the router stay replicated",
)
def get_parallel_plan(self) -> ExpertPlan:
    """FQN globs, relative to this model, of the ``[E, ...]`` routed-expert tensors that EP shards on dim 0."""
    return ExpertPlan(
        patterns=("model.layers.*.mlp.experts.gate_up_proj", "model.layers.*.mlp.experts.down_proj")
    )


# Sequence classification: the classification CE through the kernel registry (veomni.models.heads.seq_cls).
config.add_import("from veomni.models.heads.seq_cls import sequence_classification_forward")
config.add_import("from transformers.modeling_outputs import SequenceClassifierOutputWithPast")
config.add_import("from veomni.models.heads.seq_cls import init_sequence_classifier")
config.override_method(
    "DeepseekV3ForSequenceClassification.__init__", description=SEQ_CLS_INIT, name_map={"Qwen3": "DeepseekV3"}
)(seq_cls_init)
config.override_method(
    "DeepseekV3ForSequenceClassification.forward",
    description="classification CE via kernels.get('cross_entropy', 'seq_cls') on the pooled hidden states",
)(seq_cls_forward)
config.override_method(
    "DeepseekV3ForSequenceClassification.get_parallel_plan",
    description="expert parallelism as for the causal LM (the classifier's decoder has the same model.* names)",
)(get_parallel_plan)

# Token classification: this module's patched decoder inside (veomni.models.heads.token_heads).
add_token_heads(config, "DeepseekV3", question_answering=False)
