"""Patches Gemma 3's upstream modeling (the text model, ``model_type: gemma3_text``): norms, RoPE and the LM loss
through the instance's kernels.

What is Gemma-specific, and how each piece is routed (transformers 5.23's ``modeling_gemma3``):

- ``Gemma3RMSNorm`` scales by ``1 + weight`` in fp32 (weights zero-initialised): the ``rms_norm/offset`` kernel,
  whose eager oracle is exactly upstream's maths (never the ``standard`` ``weight * x`` variant). The same forward
  serves the four per-layer norms, the final norm and the q/k norms.
- ``Gemma3Attention``: upstream's forward (q/k norms after the head transpose, softmax scale
  ``query_pre_attn_scalar**-0.5``, the per-layer ``sliding_window`` handed to the attention function) with its
  RoPE call through ``rope/full`` on the tables of the layer's type (``rope_parameters["sliding_attention"]`` /
  ``["full_attention"]``, the local and global bases, which upstream's rotary module already selects per layer).
  Under ``parallel.async_ulysses`` it takes Qwen3's async branch (`veomni.models.qwen3.patch_config.qwen3_attention`:
  V, then normed and rotated Q and K, each exchanged as soon as it exists; the norms act on the head dim, so
  norming before the transpose is upstream's maths). A config setting ``attn_logit_softcapping`` is refused at
  construction (`veomni.models.gemma3.guards.check_attention_softcap`): upstream ignores the field, so no backend
  choice could be both faithful to it and to upstream.
- ``Gemma3MLP`` is GELU-tanh gated (``hidden_activation``), not SwiGLU: it runs upstream's maths; an explicitly
  chosen ``swiglu`` kernel is refused (`veomni.models.gemma3.guards.check_swiglu_choice`), a defaulted one unused.
- The embedding's ``sqrt(hidden_size)`` scale is upstream's ``Gemma3TextScaledWordEmbedding`` (a non-persistent
  buffer, recomputed by the model's init on a meta build like the rotary tables).
- ``Gemma3ForCausalLM.forward``: Qwen3's, through `veomni.models.heads.causal_lm.lm_logits_and_loss`, which applies
  ``final_logit_softcapping`` on both paths (the fused cross-entropy kernels take it as ``logit_softcap``).
- ``Gemma3TextForSequenceClassification``: the patched ``Gemma3TextModel`` inside and the classification CE
  through the kernel registry, as every family. transformers has no token-classification or QA head for Gemma 3.

The multimodal classes of the same upstream module (``Gemma3ForConditionalGeneration`` ...) are carried along
unpatched and not registered. Regenerate with ``uv run patchgen veomni.models.gemma3.patch_config``.
"""

from __future__ import annotations

import torch
from patchgen.config import PatchConfig

from veomni.models.gemma3.guards import check_attention_softcap, check_swiglu_choice
from veomni.models.heads.seq_cls import seq_cls_forward
from veomni.models.hf.masks import use_veomni_masks
from veomni.models.hf.pretrained import upstream_checkpoint_io
from veomni.models.qwen3.patch_config import (
    SEQ_CLS_FORWARD,
    SEQ_CLS_INIT,
    causal_lm_forward,
    qwen3_attention,
    seq_cls_init,
)
from veomni.models.qwen3_next.patch_config import offset_rms_norm_forward

config = PatchConfig(
    source_module="transformers.models.gemma3.modeling_gemma3",
    target_file="patched_modeling_gemma3.py",
    description="Gemma 3 (text) with its (1 + weight) RMSNorm, RoPE and LM loss dispatched through veomni's "
    "per-instance kernel set",
)
upstream_checkpoint_io(config, "Gemma3PreTrainedModel")
use_veomni_masks(config, "create_causal_mask", "create_sliding_window_causal_mask")
config.add_import("from veomni.models.hf.kernel_hooks import apply_rope")
config.add_import("from veomni.models.heads.causal_lm import lm_logits_and_loss")
config.add_import("from veomni.models.gemma3.guards import check_attention_softcap, check_swiglu_choice")


@config.add_method(
    "Gemma3PreTrainedModel",
    "__init__",
    description="refuse a config setting attn_logit_softcapping (upstream never applies it), before any weight "
    "is allocated",
)
def __init__(self, config, *inputs, **kwargs) -> None:
    check_attention_softcap(config)
    super().__init__(config, *inputs, **kwargs)


config.override_method(
    "Gemma3RMSNorm.forward", description="(1 + weight) RMSNorm via kernels.get('rms_norm', 'offset')"
)(offset_rms_norm_forward)


@config.override_method(
    "Gemma3MLP.forward",
    description="upstream's GELU-tanh gated MLP; an explicitly chosen swiglu kernel (silu) is refused",
)
def mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    kernels = getattr(self, "veomni_kernels", None)
    if kernels is not None:
        check_swiglu_choice(kernels, self.config.hidden_activation)
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj


qwen3_attention(
    config,
    "Gemma3Attention",
    anchor="query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)",
    rope="RoPE via kernels.get('rope', 'full') on the layer type's tables",
)


config.override_method(
    "Gemma3ForCausalLM.forward",
    description="LM head, final logit soft-cap and loss via lm_logits_and_loss (a fused linear cross-entropy gets "
    "the hidden states, the LM-head weight and the soft-cap; no [T, V] logits)",
)(causal_lm_forward)

# Sequence classification: this module's patched Gemma3TextModel inside, the CE through the kernel registry.
config.add_import(
    "from veomni.models.heads.seq_cls import init_sequence_classifier, sequence_classification_forward"
)
config.add_import("from transformers.modeling_outputs import SequenceClassifierOutputWithPast")
config.add_method(
    "Gemma3TextForSequenceClassification.__init__", description=SEQ_CLS_INIT, name_map={"Qwen3": "Gemma3Text"}
)(seq_cls_init)
config.add_method("Gemma3TextForSequenceClassification.forward", description=SEQ_CLS_FORWARD)(seq_cls_forward)
