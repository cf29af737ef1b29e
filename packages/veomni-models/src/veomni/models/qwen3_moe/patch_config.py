"""Patches Qwen3-MoE's upstream modeling: dense ops and the LM loss through the instance's kernels, a safe aux
loss, and the expert-parallel plan.

RMSNorm, the dense MLP (layers listed in ``mlp_only_layers``), the attention forward (identical to Qwen3's) and
the LM head + loss reuse the Qwen3 config's functions. The experts themselves are not patched: upstream's
``Qwen3MoeExperts`` (fused ``gate_up_proj [E, 2I, H]``, gate rows then up rows, and ``down_proj [E, H, I]``)
dispatches through HF's experts interface, where `veomni.models.hf.experts` registers ``"veomni"`` (the
``moe_experts`` kernels, and EP dispatch/combine when the experts are sharded). The router is untouched, so its
raw logits are what HF records for the load-balancing loss. Regenerate with
``uv run patchgen veomni.models.qwen3_moe.patch_config``.
"""

from __future__ import annotations

import torch
from patchgen.config import PatchConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Cache,
    MoeCausalLMOutputWithPast,
    MoeModelOutputWithPast,
    TransformersKwargs,
    Unpack,
    load_balancing_loss_func,
)

from veomni.core.ep import ExpertPlan
from veomni.models.heads.causal_lm import lm_logits_and_loss, router_aux_loss
from veomni.models.heads.seq_cls import seq_cls_forward
from veomni.models.hf.masks import use_veomni_masks
from veomni.models.hf.pretrained import upstream_checkpoint_io
from veomni.models.qwen3.patch_config import (
    SEQ_CLS_INIT,
    add_token_heads,
    attention_forward,
    mlp_forward,
    rms_norm_forward,
    seq_cls_init,
)

config = PatchConfig(
    source_module="transformers.models.qwen3_moe.modeling_qwen3_moe",
    target_file="patched_modeling_qwen3_moe.py",
    description="Qwen3-MoE with dense ops, LM loss and load-balancing loss dispatched through veomni's kernels, "
    "an aux loss that tolerates missing router logits, and get_parallel_plan() for expert parallelism",
)
upstream_checkpoint_io(config, "Qwen3MoePreTrainedModel")
use_veomni_masks(config, "create_causal_mask", "create_sliding_window_causal_mask")
config.add_import("from veomni.models.hf.kernel_hooks import apply_rope")
config.add_import("from veomni.models.hf.async_sp import async_sp_attention, async_ulysses_active")
config.add_import("from veomni.models.heads.causal_lm import lm_logits_and_loss, router_aux_loss")
config.add_import("from veomni.core.ep import ExpertPlan")
config.override_method(
    "Qwen3MoeRMSNorm.forward", description="RMSNorm via kernels.get('rms_norm', 'standard')"
)(rms_norm_forward)
config.override_method("Qwen3MoeMLP.forward", description="SwiGLU via kernels.get('swiglu', 'standard')")(
    mlp_forward
)
config.override_method("Qwen3MoeAttention.forward", description="RoPE via kernels.get('rope', 'full')")(
    attention_forward
)


@config.override_method(
    "Qwen3MoeForCausalLM.forward",
    description="LM head + loss via lm_logits_and_loss (fused linear cross-entropy gets hidden states + LM-head "
    "weight); aux loss via router_aux_loss: the load_balancing_loss kernel, and None instead of a crash when "
    "no router logits were recorded",
)
def moe_causal_lm_forward(
    self,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values: Cache | None = None,
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.LongTensor | None = None,
    use_cache: bool | None = None,
    output_router_logits: bool | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    **kwargs: Unpack[TransformersKwargs],
) -> MoeCausalLMOutputWithPast:
    output_router_logits = (
        output_router_logits if output_router_logits is not None else self.config.output_router_logits
    )
    outputs: MoeModelOutputWithPast = self.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        output_router_logits=output_router_logits,
        **kwargs,
    )
    logits, loss = lm_logits_and_loss(self, outputs.last_hidden_state, labels, logits_to_keep, **kwargs)

    aux_loss = None
    if output_router_logits:
        aux_loss = router_aux_loss(self, outputs.router_logits, attention_mask, load_balancing_loss_func)
        if loss is not None and aux_loss is not None:
            loss += self.router_aux_loss_coef * aux_loss.to(loss.device)

    return MoeCausalLMOutputWithPast(
        loss=loss,
        aux_loss=aux_loss,
        logits=logits,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
        router_logits=outputs.router_logits,
    )


@config.override_method(
    "Qwen3MoeForCausalLM.get_parallel_plan",
    description="expert parallelism: shard the fused expert tensors on dim 0 (experts) across the EP group",
)
def get_parallel_plan(self) -> ExpertPlan:
    """FQN globs, relative to this model, of the ``[E, ...]`` expert tensors that EP shards on dim 0."""
    return ExpertPlan(
        patterns=("model.layers.*.mlp.experts.gate_up_proj", "model.layers.*.mlp.experts.down_proj")
    )


# Sequence classification: the classification CE through the kernel registry (veomni.models.heads.seq_cls).
config.add_import("from veomni.models.heads.seq_cls import sequence_classification_forward")
config.add_import("from transformers.modeling_outputs import SequenceClassifierOutputWithPast")
config.add_import("from veomni.models.heads.seq_cls import init_sequence_classifier")
config.override_method(
    "Qwen3MoeForSequenceClassification.__init__", description=SEQ_CLS_INIT, name_map={"Qwen3": "Qwen3Moe"}
)(seq_cls_init)
config.override_method(
    "Qwen3MoeForSequenceClassification.forward",
    description="classification CE via kernels.get('cross_entropy', 'seq_cls') on the pooled hidden states",
)(seq_cls_forward)
config.override_method(
    "Qwen3MoeForSequenceClassification.get_parallel_plan",
    description="expert parallelism as for the causal LM (the classifier's decoder has the same model.* names)",
)(get_parallel_plan)

# Token classification and question answering: this module's patched decoder inside (veomni.models.heads.token_heads).
add_token_heads(config, "Qwen3Moe")
