"""Patches Qwen3.5's upstream modeling (the text model, ``qwen3_5_text``) onto veomni's kernels, reusing Qwen3-Next's
patches: the two share the gated attention, the ``1 + weight`` RMSNorm, the gated output norm and the Gated DeltaNet
recurrence; Qwen3.5's DeltaNet projects q/k/v, z, beta and the decay logits with four separate linears.

The training path of ``Qwen3_5GatedDeltaNet`` is `veomni.models.qwen3_next.gdn.gated_delta_net_train` (varlen
state reset, Ulysses SP over heads); with a cache or without kernels it runs upstream's forward. The text model's
forward (`veomni.models.qwen3_5.text_model`) derives ``cu_seq_lens_q/k`` once from rows packed by their text
positions alone, which HF never hands to the Gated DeltaNet layers, and builds no default cache for a packed or SP
forward (with a cache those layers run upstream's generation code).

The vision-language model (``qwen3_5``: ``Qwen3_5ForConditionalGeneration``) is Qwen3-VL's tower without deepstack
mergers in front of this hybrid language model, with Qwen3-VL's mrope rule (``get_rope_index`` is the same), so
`add_vision_patches` reuses the Qwen3-VL adapter's functions through a name map: the vision attention on the encoder
varlen entry, the tower forward (no host syncs, ViT Ulysses SP), its ``dummy_forward``, the composite ``__init__``
building the patched sub-models and the fused LM loss; the composite forward is Qwen2-VL's (one tower pass, features
placed by `veomni.models.qwen2_vl.vision.embed_visual`, dummy tower pass, SP scatter: no deepstack to feed).
Qwen3.5-MoE's config calls it too. Regenerate with ``uv run patchgen veomni.models.qwen3_5.patch_config``.
"""

from __future__ import annotations

import torch
from patchgen.config import PatchConfig
from transformers import initialization as init
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    BaseModelOutputWithPast,
    Cache,
    Qwen3_5GatedDeltaNet,
    Qwen3_5RMSNorm,
    TransformersKwargs,
    Unpack,
    apply_mask_to_padding_states,
)
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5GatedDeltaNet as UpstreamGatedDeltaNet,
)

from veomni.models.heads.seq_cls import seq_cls_forward
from veomni.models.hf.pretrained import upstream_checkpoint_io
from veomni.models.qwen2_vl import patch_config as qwen2_vl
from veomni.models.qwen3.patch_config import (
    SEQ_CLS_FORWARD,
    SEQ_CLS_INIT,
    causal_lm_forward,
    mlp_forward,
    seq_cls_init,
)
from veomni.models.qwen3_5.text_model import text_model_layers
from veomni.models.qwen3_next.gdn import check_cached_call, gated_delta_net_train, init_decay_log
from veomni.models.qwen3_next.patch_config import (
    gated_attention_forward,
    gated_rms_norm_forward,
    offset_rms_norm_forward,
)
from veomni.models.qwen3_vl import patch_config as qwen3_vl

config = PatchConfig(
    source_module="transformers.models.qwen3_5.modeling_qwen3_5",
    target_file="patched_modeling_qwen3_5.py",
    description="Qwen3.5 text model with Gated DeltaNet (varlen, Ulysses SP), norms, partial RoPE, MLP and LM loss "
    "dispatched through veomni's kernels; the vision-language model on the Qwen3-VL adapter's tower (encoder varlen "
    "attention, ViT Ulysses SP, dummy forward) and fused LM loss",
)
upstream_checkpoint_io(config, "Qwen3_5PreTrainedModel")
# The upstream layer under a family-neutral name, so Qwen3.5-MoE reuses this override with its own class.
config.add_import(
    "from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet as UpstreamGatedDeltaNet"
)
config.add_import("from veomni.models.heads.causal_lm import lm_logits_and_loss")
config.add_import(
    "from veomni.models.qwen3_next.gdn import check_cached_call, gated_delta_net_train, init_decay_log"
)
config.add_import("from veomni.models.qwen3_5.text_model import text_model_layers")
config.override_method("Qwen3_5RMSNorm.forward", description="(1 + weight) RMSNorm via rms_norm/offset")(
    offset_rms_norm_forward
)
config.override_method(
    "Qwen3_5RMSNormGated.forward", description="RMSNorm(x) * silu(gate) via rms_norm_gated"
)(gated_rms_norm_forward)
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
    "Qwen3_5PreTrainedModel._init_weights",
    description="upstream's init with A_log drawn on its own layout (an FSDP2-sharded fresh init is a DTensor)",
)
def init_weights(self, module) -> None:
    super()._init_weights(module)
    if isinstance(module, Qwen3_5GatedDeltaNet):
        init.ones_(module.dt_bias)
        init_decay_log(module.A_log)  # upstream's draw, also on an FSDP2-sharded parameter
    elif isinstance(module, Qwen3_5RMSNorm):
        init.zeros_(module.weight)  # the (1 + weight) norm: 0 is the identity scale


@config.override_method(
    "Qwen3_5TextModel.forward",
    description="upstream's (veomni.models.qwen3_5.text_model), with cu_seq_lens_q/k derived once from packing by "
    "text positions alone (HF's flattening collator): the Gated DeltaNet layers never see the positions; no default "
    "cache for a packed or SP forward",
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
) -> BaseModelOutputWithPast:
    hidden_states, past_key_values = text_model_layers(
        self, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache, kwargs
    )
    return BaseModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=past_key_values)


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
        if kernels is not None:
            check_cached_call(kwargs)  # upstream's cached path reads neither packing nor SP shards
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


VISION_IMPORTS = (
    "from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures",
    "from veomni.models.hf.kernel_hooks import apply_rope_vision",
    "from veomni.models.hf.attention import PREFIX",
    "from veomni.models.hf.encoder_attention import encoder_attention, needs_max_seqlen",
    "from veomni.models.qwen2_vl.vision import embed_visual",
    "from veomni.models.qwen3_vl.vision import dummy_vision_inputs, vision_geometry",
    "from veomni.models.qwen3_vl.sp import check_sp_inputs, gather_merged, slice_patches, sp_group_or_none, "
    "sp_world_size",
)
"""Imports of the reused vision functions (the tower's forward returns Qwen3-VL's output class, deepstack list
empty, so that the reused ``dummy_forward`` reads it unchanged)."""


def add_vision_patches(config: PatchConfig, prefix: str) -> None:
    """Register the vision-language patches on ``config`` for upstream classes named ``{prefix}...``
    (``"Qwen3_5"`` or ``"Qwen3_5Moe"``): the Qwen3-VL adapter's tower, attention, dummy forward and composite
    ``__init__`` renamed from ``Qwen3VL``, and Qwen2-VL's composite forward (no deepstack).

    The conditional-generation head is the caller's (dense: Qwen3-VL's fused LM loss; MoE: Qwen3-VL-MoE's, with
    the aux loss).
    """
    for statement in VISION_IMPORTS:
        config.add_import(statement)
    renamed = {"Qwen3VL": prefix}
    reused = (
        ("VisionAttention.forward", qwen3_vl.vision_attention_forward,
         "veomni_* implementations and SP: encoder_attention on the packed tokens and the tower's cu_seqlens; HF "
         "implementations: upstream code"),
        ("VisionModel.forward", qwen3_vl.vision_forward,
         "rotary positions and position-embedding taps without host syncs, ViT Ulysses SP (no deepstack taps)"),
        ("VisionModel.dummy_forward", qwen3_vl.vision_dummy_forward,
         "injected: the tower on one all-zero merged token, for ranks without image or video"),
        ("Model.__init__", qwen3_vl.model_init, "build the patched vision and text sub-models"),
    )  # fmt: skip
    for target, function, description in reused:
        # The dummy forward is a method upstream lacks; the rest replace upstream's.
        register = config.add_method if target == "VisionModel.dummy_forward" else config.override_method
        register(
            f"{prefix}{target}", description=f"{description} (Qwen3-VL adapter, renamed)", name_map=renamed
        )(function)
    config.override_method(
        f"{prefix}Model.forward",
        description="one tower pass over all images and videos, features placed without host syncs, dummy tower "
        "forward on ranks without media under world > 1; under Ulysses SP the LM inputs are this rank's slice "
        "(position_ids required) and the features land in its token range (Qwen2-VL adapter: no deepstack)",
    )(qwen2_vl.model_forward)


add_vision_patches(config, "Qwen3_5")
config.override_method(
    "Qwen3_5ForConditionalGeneration.forward",
    description="LM head + loss via lm_logits_and_loss (fused linear cross-entropy: no [T, V] logits) (Qwen3-VL "
    "adapter, renamed)",
    name_map={"Qwen3VL": "Qwen3_5"},
)(qwen3_vl.conditional_generation_forward)


# Sequence classification: this module's patched decoder inside the classifier (veomni.models.qwen3.patch_config
# seq_cls_init) and the classification CE through the kernel registry (veomni.models.heads.seq_cls).
config.add_import(
    "from veomni.models.heads.seq_cls import init_sequence_classifier, sequence_classification_forward"
)
config.add_import("from transformers.modeling_outputs import SequenceClassifierOutputWithPast")
config.add_method(
    "Qwen3_5TextForSequenceClassification.__init__",
    description=SEQ_CLS_INIT,
    name_map={"Qwen3Model": "Qwen3_5TextModel", "Qwen3Config": "Qwen3_5TextConfig"},
)(seq_cls_init)
config.add_method("Qwen3_5TextForSequenceClassification.forward", description=SEQ_CLS_FORWARD)(
    seq_cls_forward
)
