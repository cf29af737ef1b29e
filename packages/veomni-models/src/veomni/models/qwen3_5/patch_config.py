"""Patches Qwen3.5's upstream modeling (the text model, ``qwen3_5_text``) onto veomni's kernels, reusing Qwen3-Next's
patches: the two share the gated attention, the ``1 + weight`` RMSNorm, the gated output norm and the Gated DeltaNet
recurrence; Qwen3.5's DeltaNet projects q/k/v, z, beta and the decay logits with four separate linears.

The training path of ``Qwen3_5GatedDeltaNet`` is `veomni.models.qwen3_next.gdn.gated_delta_net_train` (varlen
state reset, Ulysses SP over heads); with a cache or without kernels it runs upstream's forward. The vision tower
(``Qwen3_5ForConditionalGeneration``) is not adapted yet. Regenerate with
``uv run patchgen veomni.models.qwen3_5.patch_config``.
"""

from __future__ import annotations

import torch
from patchgen.config import PatchConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Cache,
    TransformersKwargs,
    Unpack,
    apply_mask_to_padding_states,
)
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5GatedDeltaNet as UpstreamGatedDeltaNet,
)

from veomni.models.hf_masks import use_veomni_masks
from veomni.models.qwen3.patch_config import (
    SEQ_CLS_FORWARD,
    SEQ_CLS_INIT,
    causal_lm_forward,
    mlp_forward,
    seq_cls_init,
)
from veomni.models.qwen3_next.gdn import gated_delta_net_train
from veomni.models.qwen3_next.patch_config import (
    gated_attention_forward,
    gated_rms_norm_forward,
    offset_rms_norm_forward,
)
from veomni.models.seq_cls import seq_cls_forward

config = PatchConfig(
    source_module="transformers.models.qwen3_5.modeling_qwen3_5",
    target_file="patched_modeling_qwen3_5.py",
    description="Qwen3.5 text model with Gated DeltaNet (varlen, Ulysses SP), norms, partial RoPE, MLP and LM loss "
    "dispatched through veomni's kernels",
)
use_veomni_masks(config, "create_causal_mask")
# The upstream layer under a family-neutral name, so Qwen3.5-MoE reuses this override with its own class.
config.add_import(
    "from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet as UpstreamGatedDeltaNet"
)
config.add_import("from veomni.models.causal_lm import lm_logits_and_loss")
config.add_import("from veomni.models.qwen3_next.gdn import gated_delta_net_train")
config.override_method("Qwen3_5RMSNorm.forward", description="(1 + weight) RMSNorm via rms_norm/offset")(
    offset_rms_norm_forward
)
config.override_method("Qwen3_5RMSNormGated.forward", description="RMSNorm(x) * silu(gate) via rms_norm_gated")(
    gated_rms_norm_forward
)
config.override_method("Qwen3_5MLP.forward", description="SwiGLU via kernels.get('swiglu', 'standard')")(
    mlp_forward
)
config.override_method("Qwen3_5Attention.forward", description="partial RoPE via rope/partial, output gate")(
    gated_attention_forward
)
config.override_method(
    "Qwen3_5ForCausalLM.forward", description="LM head + loss via lm_logits_and_loss (as Qwen3)"
)(causal_lm_forward)


@config.override_method(
    "Qwen3_5GatedDeltaNet.forward",
    description="training: gated_delta_net_train (conv + delta-rule kernels with cu_seq_lens_q, Ulysses SP over "
    "heads); generation (a cache) or no kernels: upstream's forward",
)
def gated_delta_net_forward(
    self,
    hidden_states: torch.Tensor,
    cache_params: Cache | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Unpack[TransformersKwargs],
) -> torch.Tensor:
    kernels = getattr(self, "veomni_kernels", None)
    if kernels is None or cache_params is not None:
        return UpstreamGatedDeltaNet.forward(
            self, hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs
        )
    hidden_states = apply_mask_to_padding_states(hidden_states, attention_mask)
    batch, length = hidden_states.shape[:2]
    z = self.in_proj_z(hidden_states).reshape(batch, length, -1, self.head_v_dim)
    return gated_delta_net_train(
        self, kernels, self.in_proj_qkv(hidden_states), z, self.in_proj_b(hidden_states),
        self.in_proj_a(hidden_states), kwargs,
    )  # fmt: skip


# Sequence classification: this module's patched decoder inside the classifier (veomni.models.qwen3.patch_config
# seq_cls_init) and the classification CE through the kernel registry (veomni.models.seq_cls).
config.add_import("from veomni.models.seq_cls import init_sequence_classifier, sequence_classification_forward")
config.add_import("from transformers.modeling_outputs import SequenceClassifierOutputWithPast")
config.override_method(
    "Qwen3_5TextForSequenceClassification.__init__", description=SEQ_CLS_INIT, name_map={"Qwen3Model": "Qwen3_5TextModel", "Qwen3Config": "Qwen3_5TextConfig"}
)(seq_cls_init)
config.override_method("Qwen3_5TextForSequenceClassification.forward", description=SEQ_CLS_FORWARD)(seq_cls_forward)
