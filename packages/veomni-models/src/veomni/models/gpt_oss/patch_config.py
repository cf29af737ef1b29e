"""Patches GPT-OSS's upstream modeling: RoPE and the LM / aux losses through the instance's kernels, the experts
claimed for veomni's clamped experts kernels, MXFP4 configs refused, and the expert-parallel plan.

What stays upstream, on purpose:

* Attention calls already pass ``sliding_window`` (per ``layer_types``) and ``s_aux`` (the per-head sinks) to the
  attention interface; veomni's ``veomni_*`` implementations hand them to the kernels (``window`` / ``sinks``),
  and `veomni.models.hf.kernel_hooks.apply_ops` refuses a backend lacking either.
* RMSNorm multiplies by the weight in fp32 before casting (the norms are kept in fp32), which is not the
  ``rms_norm`` kernels' rounding, so it is not patched.
* The router (a biased linear, top-k of the logits, softmax over the k) is untouched, so HF records its raw logits
  for the load-balancing loss.
* ``GptOssExperts`` dispatches through HF's experts interface to `veomni.models.hf.experts`, which runs the
  ``moe_experts/clamped_*`` kernels for it because this file claims the class (`veomni.models.gpt_oss.experts`).

RoPE: upstream rotates halves with ``cos``/``sin`` of ``D / 2`` frequencies; the rope kernels take HF's usual
duplicated ``[..., D]`` tables, the same rotation. Regenerate with ``uv run patchgen veomni.models.gpt_oss.patch_config``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from patchgen.config import PatchConfig
from transformers.models.gpt_oss.modeling_gpt_oss import (
    ALL_ATTENTION_FUNCTIONS,
    Cache,
    TransformersKwargs,
    Unpack,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from veomni.core.ep import ExpertPlan
from veomni.models.gpt_oss.experts import reject_quantized
from veomni.models.heads.seq_cls import seq_cls_forward
from veomni.models.hf.kernel_hooks import apply_rope
from veomni.models.hf.masks import use_veomni_masks
from veomni.models.hf.pretrained import upstream_checkpoint_io
from veomni.models.qwen3.patch_config import SEQ_CLS_INIT, add_token_heads, seq_cls_init
from veomni.models.qwen3_moe.patch_config import moe_causal_lm_forward

config = PatchConfig(
    source_module="transformers.models.gpt_oss.modeling_gpt_oss",
    target_file="patched_modeling_gpt_oss.py",
    description="GPT-OSS with RoPE and the LM / load-balancing losses through veomni's kernels, its experts claimed "
    "for the clamped experts kernels, MXFP4 configs refused, and get_parallel_plan() for expert parallelism",
)
upstream_checkpoint_io(config, "GptOssPreTrainedModel")
use_veomni_masks(config, "create_causal_mask", "create_sliding_window_causal_mask")
config.add_import("from veomni.models.hf.kernel_hooks import apply_rope")
config.add_import("from veomni.models.heads.causal_lm import lm_logits_and_loss, router_aux_loss")
config.add_import("from veomni.models.gpt_oss.experts import GPT_OSS_EXPERTS, reject_quantized")
config.add_import("from veomni.models.hf.experts import claim_experts")
config.add_import("from veomni.core.ep import ExpertPlan")
config.add_helper(
    "claim_experts(GptOssExperts, GPT_OSS_EXPERTS)\n",
    description="the moe_experts clamped_* kernels compute GptOssExperts exactly (gate checked numerically)",
    after="GptOssExperts",
)
config.override_method(
    "GptOssForCausalLM.forward",
    description="LM head + loss via lm_logits_and_loss; aux loss via router_aux_loss (the load_balancing_loss "
    "kernel, and None instead of a crash when no router logits were recorded)",
)(moe_causal_lm_forward)


@config.override_method(
    "GptOssPreTrainedModel",
    "__init__",
    description="refuse quantized (MXFP4) configs with the conversion recipe, before any weight is allocated",
)
def __init__(self, config, *inputs, **kwargs) -> None:
    reject_quantized(config)
    super().__init__(config, *inputs, **kwargs)


@config.override_method(
    "GptOssPreTrainedModel",
    "get_correct_attn_implementation",
    description="veomni_* attention names are veomni's functions (sinks and windows checked by apply_ops); HF "
    "reads 'sdpa' in 'veomni_sdpa' as its own SDPA path, which gpt-oss refuses (it would drop the sinks)",
)
def get_correct_attn_implementation(
    self, requested_attention: str | None, is_init_check: bool = False
) -> str:
    if requested_attention is not None and requested_attention.startswith("veomni_"):
        if requested_attention not in ALL_ATTENTION_FUNCTIONS.valid_keys():
            raise ValueError(
                f"attention implementation {requested_attention!r} is not registered; veomni registers its "
                "backends with veomni.models.hf.attention.register_hf_attention (apply_ops does it)"
            )
        return requested_attention
    return super().get_correct_attn_implementation(requested_attention, is_init_check)


@config.override_method(
    "GptOssAttention.forward",
    description="RoPE via kernels.get('rope', 'full') on the duplicated cos/sin tables; window and sinks passed on",
)
def attention_forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    past_key_values: Cache | None = None,
    **kwargs: Unpack[TransformersKwargs],
) -> tuple[torch.Tensor, torch.Tensor]:
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)

    query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

    cos, sin = position_embeddings
    kernels = getattr(self, "veomni_kernels", None)
    if kernels is not None and kernels.config.rope != "eager":
        # Upstream's tables hold D / 2 frequencies; the kernels take them repeated over both halves.
        cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        query_states, key_states = apply_rope(self, query_states, key_states, cos, sin, apply_rotary_pos_emb)
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
        sliding_window=self.sliding_window,
        s_aux=self.sinks,
        **kwargs,
    )

    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    attn_output = self.o_proj(attn_output)
    return attn_output, attn_weights


@config.override_method(
    "GptOssForCausalLM.get_parallel_plan",
    description="expert parallelism: shard the four [E, ...] expert tensors (weights and biases) on dim 0",
)
def get_parallel_plan(self) -> ExpertPlan:
    """FQN globs, relative to this model, of the ``[E, ...]`` expert tensors that EP shards on dim 0."""
    experts = "model.layers.*.mlp.experts"
    return ExpertPlan(
        patterns=tuple(
            f"{experts}.{name}"
            for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
        )
    )


__all__ = ["config", "reject_quantized"]


# Sequence classification: the classification CE through the kernel registry (veomni.models.heads.seq_cls).
config.add_import("from veomni.models.heads.seq_cls import sequence_classification_forward")
config.add_import("from transformers.modeling_outputs import SequenceClassifierOutputWithPast")
config.add_import("from veomni.models.heads.seq_cls import init_sequence_classifier")
config.override_method(
    "GptOssForSequenceClassification.__init__", description=SEQ_CLS_INIT, name_map={"Qwen3": "GptOss"}
)(seq_cls_init)
config.override_method(
    "GptOssForSequenceClassification.forward",
    description="classification CE via kernels.get('cross_entropy', 'seq_cls') on the pooled hidden states",
)(seq_cls_forward)
config.override_method(
    "GptOssForSequenceClassification.get_parallel_plan",
    description="expert parallelism as for the causal LM (the classifier's decoder has the same model.* names)",
)(get_parallel_plan)

# Token classification: this module's patched decoder inside (veomni.models.heads.token_heads).
add_token_heads(config, "GptOss", question_answering=False)
