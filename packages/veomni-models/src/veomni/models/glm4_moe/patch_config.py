"""Patches GLM-4.5's upstream MoE modeling (``glm4_moe``): dense ops, partial RoPE and the LM loss through the
instance's kernels, and the expert-parallel plan.

What runs where:

- RMSNorm (the layer norms and, with ``use_qk_norm``, the per-head q/k norms) and the SwiGLU MLPs (the
  ``first_k_dense_replace`` dense layers and the shared experts, both ``Glm4MoeMLP``) reuse the Qwen3 config's
  functions: same maths.
- Attention is upstream's forward (GQA, ``attention_bias`` on q/k/v, optional q/k norm before the transpose) with
  the RoPE call through ``kernels.get('rope', 'partial')``: GLM rotates only the first
  ``head_dim * partial_rotary_factor`` dims of each head in the rotate-half layout (the config defaults the factor
  to 0.5) and passes the rest through, which is the partial kernel's contract with ``rotary_dim = cos.shape[-1]``.
- The router (``Glm4MoeTopkRouter``) is upstream's, untouched: fp32 sigmoid scores, ``e_score_correction_bias``
  added for the choice only, group-limited top-k (``n_group`` groups scored by their top-2 sum, ``topk_group``
  kept), weights from the unbiased scores, ``norm_topk_prob`` and ``routed_scaling_factor``. Upstream already
  creates the bias as an fp32 buffer. transformers defines no update rule for it: aux-loss-free balancing is
  `veomni.models.moe.aux_free_balance` (DeepSeek-V3's sign rule), which the trainer applies outside the gradient
  through the family's ``TrainingHooks.balanced_routers`` when ``optim.moe_bias_update_speed`` > 0.
- The routed experts (``Glm4MoeExperts``: fused ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) are not
  patched: they dispatch through HF's experts interface to ``"veomni"`` (`veomni.models.hf.experts`: the
  ``moe_experts`` kernels, EP dispatch/combine when sharded).
- The causal-LM forward computes the LM head + loss through `lm_logits_and_loss` (DeepSeek-V3's function: the
  same output type and no auxiliary loss, as upstream; router logits are still recorded on request).

transformers has no sequence / token classification or QA head for glm4_moe, so none is generated here.
Regenerate with ``uv run patchgen veomni.models.glm4_moe.patch_config``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from patchgen.config import PatchConfig
from transformers.cache_utils import Cache
from transformers.models.glm4_moe.modeling_glm4_moe import (
    ALL_ATTENTION_FUNCTIONS,
    FlashAttentionKwargs,
    Unpack,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from veomni.models.deepseek_v3.patch_config import causal_lm_forward, get_parallel_plan
from veomni.models.hf.masks import use_veomni_masks
from veomni.models.hf.pretrained import upstream_checkpoint_io
from veomni.models.qwen3.patch_config import mlp_forward, rms_norm_forward

config = PatchConfig(
    source_module="transformers.models.glm4_moe.modeling_glm4_moe",
    target_file="patched_modeling_glm4_moe.py",
    description="GLM-4.5 MoE (partial RoPE, optional q/k norm, group-limited sigmoid router, shared experts) with "
    "RMSNorm, SwiGLU, RoPE and the LM loss dispatched through veomni's kernels, and get_parallel_plan() for expert "
    "parallelism",
)
upstream_checkpoint_io(config, "Glm4MoePreTrainedModel")
use_veomni_masks(config, "create_causal_mask")
config.add_import("from veomni.models.heads.causal_lm import lm_logits_and_loss")
config.add_import("from veomni.core.ep import ExpertPlan")
config.override_method(
    "Glm4MoeRMSNorm.forward", description="RMSNorm via kernels.get('rms_norm', 'standard')"
)(rms_norm_forward)
config.override_method(
    "Glm4MoeMLP.forward",
    description="SwiGLU via kernels.get('swiglu', 'standard') (dense layers and shared experts)",
)(mlp_forward)


@config.override_method(
    "Glm4MoeAttention.forward",
    description="partial RoPE (partial_rotary_factor) via kernels.get('rope', 'partial'); q/k norm and biases as "
    "upstream",
)
def attention_forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    past_key_values: Cache | None = None,
    **kwargs: Unpack[FlashAttentionKwargs],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)

    query_states = self.q_proj(hidden_states).view(hidden_shape)
    key_states = self.k_proj(hidden_states).view(hidden_shape)
    value_states = self.v_proj(hidden_states).view(hidden_shape)

    if self.use_qk_norm:  # per head, before the transpose, as upstream
        query_states = self.q_norm(query_states)
        key_states = self.k_norm(key_states)

    query_states = query_states.transpose(1, 2)
    key_states = key_states.transpose(1, 2)
    value_states = value_states.transpose(1, 2)

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

    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    attn_output = self.o_proj(attn_output)
    return attn_output, attn_weights


config.override_method(
    "Glm4MoeForCausalLM.forward",
    description="LM head + loss via lm_logits_and_loss (fused linear cross-entropy gets hidden states + LM-head "
    "weight); no aux loss, as upstream",
)(causal_lm_forward)
config.override_method(
    "Glm4MoeForCausalLM.get_parallel_plan",
    description="expert parallelism: shard the fused routed-expert tensors on dim 0 (experts) across the EP group; "
    "shared experts, dense layers and the router stay replicated",
)(get_parallel_plan)
