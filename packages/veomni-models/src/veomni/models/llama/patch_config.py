"""Patches Llama's upstream modeling: RMSNorm, SwiGLU, RoPE and the LM loss through the instance's kernels.

RMSNorm, the MLP and the causal-LM forward reuse the Qwen3 config's functions (same maths); the attention forward is Llama's own with
the RoPE call dispatched. Regenerate with ``uv run patchgen veomni.models.llama.patch_config``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from patchgen.config import PatchConfig
from transformers.cache_utils import Cache
from transformers.models.llama.modeling_llama import (
    ALL_ATTENTION_FUNCTIONS,
    TransformersKwargs,
    Unpack,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from veomni.models.heads.seq_cls import seq_cls_forward
from veomni.models.hf.kernel_hooks import apply_rope
from veomni.models.hf.masks import use_veomni_masks
from veomni.models.hf.pretrained import upstream_checkpoint_io
from veomni.models.qwen3.patch_config import (
    SEQ_CLS_INIT,
    add_token_heads,
    causal_lm_forward,
    mlp_forward,
    rms_norm_forward,
    seq_cls_init,
)

config = PatchConfig(
    source_module="transformers.models.llama.modeling_llama",
    target_file="patched_modeling_llama.py",
    description="Llama with RMSNorm, SwiGLU and RoPE dispatched through veomni's per-instance kernel set",
)
upstream_checkpoint_io(config, "LlamaPreTrainedModel")
use_veomni_masks(config, "create_causal_mask")
config.add_import("from veomni.models.hf.kernel_hooks import apply_rope")
config.add_import("from veomni.models.heads.causal_lm import lm_logits_and_loss")
config.override_method("LlamaRMSNorm.forward", description="RMSNorm via kernels.get('rms_norm', 'standard')")(
    rms_norm_forward
)
config.override_method("LlamaMLP.forward", description="SwiGLU via kernels.get('swiglu', 'standard')")(
    mlp_forward
)
config.override_method(
    "LlamaForCausalLM.forward",
    description="LM head + loss via lm_logits_and_loss (fused linear cross-entropy gets hidden states + LM-head weight)",
)(causal_lm_forward)


@config.override_method("LlamaAttention.forward", description="RoPE via kernels.get('rope', 'full')")
def attention_forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    past_key_values: Cache | None = None,
    **kwargs: Unpack[TransformersKwargs],
) -> tuple[torch.Tensor, torch.Tensor]:
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)

    query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

    cos, sin = position_embeddings
    query_states, key_states = apply_rope(self, query_states, key_states, cos, sin, apply_rotary_pos_emb)

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


# Sequence classification: the classification CE through the kernel registry (veomni.models.heads.seq_cls).
config.add_import("from veomni.models.heads.seq_cls import sequence_classification_forward")
config.add_import("from transformers.modeling_outputs import SequenceClassifierOutputWithPast")
config.add_import("from veomni.models.heads.seq_cls import init_sequence_classifier")
config.override_method(
    "LlamaForSequenceClassification.__init__", description=SEQ_CLS_INIT, name_map={"Qwen3": "Llama"}
)(seq_cls_init)
config.override_method(
    "LlamaForSequenceClassification.forward",
    description="classification CE via kernels.get('cross_entropy', 'seq_cls') on the pooled hidden states",
)(seq_cls_forward)

# Token classification and question answering: this module's patched decoder inside (veomni.models.heads.token_heads).
add_token_heads(config, "Llama")
