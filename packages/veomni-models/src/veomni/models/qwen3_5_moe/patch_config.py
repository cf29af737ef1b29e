"""Patches Qwen3.5-MoE's upstream modeling (the text model, ``qwen3_5_moe_text``): Qwen3.5's patches (Gated DeltaNet
training path with varlen and Ulysses SP, norms, gated attention with partial RoPE, SwiGLU) renamed onto the MoE
module's classes, plus Qwen3-MoE's LM/aux losses and Qwen3-Next's expert-parallel plan. Routed experts go through
HF's experts interface (``"veomni"``: ``moe_experts`` kernels, EP dispatch). The vision tower is not adapted yet.
Regenerate with ``uv run patchgen veomni.models.qwen3_5_moe.patch_config``.
"""

from __future__ import annotations

from patchgen.config import PatchConfig

from veomni.models.hf_masks import use_veomni_masks
from veomni.models.qwen3.patch_config import mlp_forward
from veomni.models.qwen3_5.patch_config import gated_delta_net_forward
from veomni.models.qwen3_moe.patch_config import moe_causal_lm_forward
from veomni.models.qwen3_next.patch_config import (
    gated_attention_forward,
    gated_rms_norm_forward,
    get_parallel_plan,
    offset_rms_norm_forward,
)

config = PatchConfig(
    source_module="transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    target_file="patched_modeling_qwen3_5_moe.py",
    description="Qwen3.5-MoE text model with Gated DeltaNet (varlen, Ulysses SP), norms, partial RoPE, MLPs and "
    "losses dispatched through veomni's kernels, and get_parallel_plan() for expert parallelism",
)
use_veomni_masks(config, "create_causal_mask")
config.add_import(
    "from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet as UpstreamGatedDeltaNet"
)
config.add_import("from veomni.models.causal_lm import lm_logits_and_loss, router_aux_loss")
config.add_import("from veomni.models.qwen3_next.gdn import gated_delta_net_train")
config.add_import("from veomni.core.ep import ExpertPlan")
config.override_method("Qwen3_5MoeRMSNorm.forward", description="(1 + weight) RMSNorm via rms_norm/offset")(
    offset_rms_norm_forward
)
config.override_method(
    "Qwen3_5MoeRMSNormGated.forward", description="RMSNorm(x) * silu(gate) via rms_norm_gated"
)(gated_rms_norm_forward)
config.override_method("Qwen3_5MoeMLP.forward", description="SwiGLU via kernels.get('swiglu', 'standard')")(
    mlp_forward
)
config.override_method("Qwen3_5MoeAttention.forward", description="partial RoPE via rope/partial, output gate")(
    gated_attention_forward
)
config.override_method(
    "Qwen3_5MoeGatedDeltaNet.forward",
    description="Qwen3.5's: gated_delta_net_train for training, upstream's forward with a cache",
)(gated_delta_net_forward)
config.override_method(
    "Qwen3_5MoeForCausalLM.forward",
    description="LM head + loss via lm_logits_and_loss; aux loss via router_aux_loss (as Qwen3-MoE)",
)(moe_causal_lm_forward)
config.override_method(
    "Qwen3_5MoeForCausalLM.get_parallel_plan",
    description="expert parallelism: shard the fused expert tensors on dim 0 (experts) across the EP group",
)(get_parallel_plan)
