"""Patches Llama's upstream modeling: RMSNorm, SwiGLU, RoPE and the LM loss through the instance's kernels.

RMSNorm, the MLP and the causal-LM forward reuse the Qwen3 config's functions (same maths); the attention forward is Llama's own with
the RoPE call dispatched. Regenerate with ``uv run patchgen veomni.models.llama.patch_config``.
"""

from __future__ import annotations

from patchgen.config import PatchConfig

from veomni.models.heads.seq_cls import seq_cls_forward
from veomni.models.hf.masks import use_veomni_masks
from veomni.models.hf.pretrained import upstream_checkpoint_io
from veomni.models.qwen3.patch_config import (
    SEQ_CLS_INIT,
    add_token_heads,
    causal_lm_forward,
    mlp_forward,
    rms_norm_forward,
    rope_via_kernels,
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


rope_via_kernels(config, "LlamaAttention")


# Sequence classification: the classification CE through the kernel registry (veomni.models.heads.seq_cls).
config.add_import("from veomni.models.heads.seq_cls import sequence_classification_forward")
config.add_import("from transformers.modeling_outputs import SequenceClassifierOutputWithPast")
config.add_import("from veomni.models.heads.seq_cls import init_sequence_classifier")
config.add_method(
    "LlamaForSequenceClassification.__init__", description=SEQ_CLS_INIT, name_map={"Qwen3": "Llama"}
)(seq_cls_init)
config.add_method(
    "LlamaForSequenceClassification.forward",
    description="classification CE via kernels.get('cross_entropy', 'seq_cls') on the pooled hidden states",
)(seq_cls_forward)

# Token classification and question answering: this module's patched decoder inside (veomni.models.heads.token_heads).
add_token_heads(config, "Llama")
