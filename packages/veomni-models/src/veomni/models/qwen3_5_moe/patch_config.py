"""Patches Qwen3.5-MoE's upstream modeling (the text model, ``qwen3_5_moe_text``): Qwen3.5's patches (Gated DeltaNet
training path with varlen and Ulysses SP, packing derived from position_ids alone, norms, gated attention with
partial RoPE, SwiGLU) renamed onto the MoE module's classes, plus Qwen3-MoE's LM/aux losses and Qwen3-Next's expert-parallel plan. Routed experts go through
HF's experts interface (``"veomni"``: ``moe_experts`` kernels, EP dispatch).

The vision-language model (``qwen3_5_moe``: ``Qwen3_5MoeForConditionalGeneration``) gets Qwen3.5's vision patches
(`veomni.models.qwen3_5.patch_config.add_vision_patches`: the Qwen3-VL tower, ViT SP, dummy forward) and Qwen3-VL-MoE's
conditional-generation ``__init__`` (MoE settings of ``text_config`` as attributes), ``forward`` (fused LM loss + aux
loss) and expert-parallel plans, renamed. Regenerate with ``uv run patchgen veomni.models.qwen3_5_moe.patch_config``.
"""

from __future__ import annotations

import torch
from patchgen.config import PatchConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
    Cache,
    MoeModelOutputWithPast,
    TransformersKwargs,
    Unpack,
)

from veomni.models.hf.pretrained import upstream_checkpoint_io
from veomni.models.qwen3.patch_config import mlp_forward
from veomni.models.qwen3_5.patch_config import add_vision_patches, gated_delta_net_forward
from veomni.models.qwen3_5.text_model import text_model_layers
from veomni.models.qwen3_moe.patch_config import moe_causal_lm_forward
from veomni.models.qwen3_next.patch_config import (
    gated_attention_forward,
    gated_rms_norm_forward,
    get_parallel_plan,
    init_weights,
    offset_rms_norm_forward,
)
from veomni.models.qwen3_vl_moe import patch_config as qwen3_vl_moe

config = PatchConfig(
    source_module="transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    target_file="patched_modeling_qwen3_5_moe.py",
    description="Qwen3.5-MoE text model with Gated DeltaNet (varlen, Ulysses SP), norms, partial RoPE, MLPs and "
    "losses dispatched through veomni's kernels, and get_parallel_plan() for expert parallelism; the vision-language "
    "model on the Qwen3-VL adapter's tower (encoder varlen attention, ViT Ulysses SP, dummy forward) with the "
    "Qwen3-VL-MoE adapter's losses and expert plan",
)
upstream_checkpoint_io(config, "Qwen3_5MoePreTrainedModel")
config.add_import(
    "from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet as UpstreamGatedDeltaNet"
)
config.add_import("from veomni.models.heads.causal_lm import lm_logits_and_loss, router_aux_loss")
config.add_import(
    "from veomni.models.qwen3_next.gdn import check_cached_call, gated_delta_net_train, init_decay_log"
)
config.add_import("from veomni.models.qwen3_5.text_model import text_model_layers")
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
config.override_method(
    "Qwen3_5MoeAttention.forward", description="partial RoPE via rope/partial, output gate"
)(gated_attention_forward)


@config.override_method(
    "Qwen3_5MoeTextModel.forward",
    description="Qwen3.5's (veomni.models.qwen3_5.text_model): cu_seq_lens_q/k derived once from packing by text "
    "positions alone, for the Gated DeltaNet layers; no default cache for a packed or SP forward",
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
    hidden_states, past_key_values = text_model_layers(
        self, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache, kwargs
    )
    return MoeModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=past_key_values)


config.override_method(
    "Qwen3_5MoeGatedDeltaNet.forward",
    description="Qwen3.5's: gated_delta_net_train for training, upstream's forward with a cache",
)(gated_delta_net_forward)
config.override_method(
    "Qwen3_5MoeForCausalLM.forward",
    description="LM head + loss via lm_logits_and_loss; aux loss via router_aux_loss (as Qwen3-MoE)",
)(moe_causal_lm_forward)
config.override_method(
    "Qwen3_5MoePreTrainedModel._init_weights",
    description="upstream's init, the router drawn on its own module (Qwen3-Next's, renamed: transformers never "
    "visits the parameter-less sparse block upstream draws it from)",
    name_map={"Qwen3Next": "Qwen3_5Moe"},
)(init_weights)
config.add_method(
    "Qwen3_5MoeForCausalLM.get_parallel_plan",
    description="expert parallelism: shard the fused expert tensors on dim 0 (experts) across the EP group",
)(get_parallel_plan)


add_vision_patches(config, "Qwen3_5Moe")
# The reused composite forward's return annotation (upstream's MoE module imports only the MoE output class).
config.add_import("from transformers.modeling_outputs import BaseModelOutputWithPast")
_MOE_HEAD = (
    ("Qwen3_5MoeForConditionalGeneration.__init__", qwen3_vl_moe.conditional_generation_init,
     "the MoE settings of text_config as attributes (router_aux_loss and the trainer read them there)"),
    ("Qwen3_5MoeForConditionalGeneration.forward", qwen3_vl_moe.conditional_generation_forward,
     "LM head + loss via lm_logits_and_loss; aux loss via router_aux_loss scaled by router_aux_loss_coef"),
    ("Qwen3_5MoeForConditionalGeneration.get_parallel_plan", qwen3_vl_moe.get_parallel_plan,
     "expert parallelism: the language model's fused expert tensors, sharded on dim 0 (experts)"),
    ("Qwen3_5MoeModel.get_parallel_plan", qwen3_vl_moe.model_parallel_plan,
     "expert parallelism for the base model: the language model's fused expert tensors on dim 0"),
)  # fmt: skip
# The only renamed call (Qwen3VLMoeModel(config) in __init__) is checked against Qwen3-VL-MoE's module.
config.name_map({}, origin_module="transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe")
for target, function, description in _MOE_HEAD:
    # get_parallel_plan is a method upstream lacks; the rest replace upstream's.
    register = config.add_method if target.endswith(".get_parallel_plan") else config.override_method
    register(
        target,
        description=f"{description} (Qwen3-VL-MoE adapter, renamed)",
        name_map={"Qwen3VLMoe": "Qwen3_5Moe"},
    )(function)
