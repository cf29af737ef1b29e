"""Patches GLM-4.5's upstream MoE modeling (``glm4_moe``): dense ops, partial RoPE and the LM loss through the
instance's kernels, and the expert-parallel plan.

What runs where:

- RMSNorm (the layer norms and, with ``use_qk_norm``, the per-head q/k norms) and the SwiGLU MLPs (the
  ``first_k_dense_replace`` dense layers and the shared experts, both ``Glm4MoeMLP``) reuse the Qwen3 config's
  functions: same maths.
- Attention is upstream's forward (GQA, ``attention_bias`` on q/k/v, optional q/k norm before the transpose) with
  the RoPE call through ``kernels.get('rope', 'partial')`` (`veomni.models.hf.kernel_hooks.apply_rope`):
  GLM rotates only the first ``head_dim * partial_rotary_factor`` dims of each head in the rotate-half layout (the
  config defaults the factor to 0.5) and passes the rest through, which is the partial kernel's contract with
  ``rotary_dim = cos.shape[-1]``. Under ``parallel.async_ulysses`` it branches off to Qwen3's async path
  (`veomni.models.qwen3.patch_config.async_ulysses_branch`) with GLM's own Q/K projections.
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

from patchgen.config import PatchConfig

from veomni.models.deepseek_v3.patch_config import causal_lm_forward, get_parallel_plan
from veomni.models.hf.masks import use_veomni_masks
from veomni.models.hf.pretrained import upstream_checkpoint_io
from veomni.models.qwen3.patch_config import async_ulysses_branch, mlp_forward, rms_norm_forward

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


config.add_import("from veomni.models.hf.kernel_hooks import apply_rope")
config.replace_call(
    "Glm4MoeAttention.forward",
    "apply_rotary_pos_emb",
    "apply_rope(self, __args__, apply_rotary_pos_emb, 'partial')",
    description="partial RoPE (partial_rotary_factor) via kernels.get('rope', 'partial')",
)
# Under parallel.async_ulysses: Q and K as upstream makes them (optional per-head norm before the transpose), each
# exchanged as soon as it is rotated. GLM's attention has no sliding window.
PROJECT_QK = """
q, k = self.q_proj(x).view(hidden_shape), self.k_proj(x).view(hidden_shape)
if self.use_qk_norm:
    q, k = self.q_norm(q), self.k_norm(k)
cos, sin = position_embeddings
q, k = apply_rope(self, q.transpose(1, 2), k.transpose(1, 2), cos, sin, apply_rotary_pos_emb, "partial")
"""
async_ulysses_branch(
    config,
    "Glm4MoeAttention",
    "query_states = self.q_proj(hidden_states).view(hidden_shape)",
    project_qk=PROJECT_QK,
    sliding_window=False,
)

config.override_method(
    "Glm4MoeForCausalLM.forward",
    description="LM head + loss via lm_logits_and_loss (fused linear cross-entropy gets hidden states + LM-head "
    "weight); no aux loss, as upstream",
)(causal_lm_forward)
config.add_method(
    "Glm4MoeForCausalLM.get_parallel_plan",
    description="expert parallelism: shard the fused routed-expert tensors on dim 0 (experts) across the EP group; "
    "shared experts, dense layers and the router stay replicated",
)(get_parallel_plan)
