"""Patches Qwen2-VL's upstream modeling for veomni: text layers on veomni's kernels, the vision tower on the encoder
varlen entry without host syncs (ViT Ulysses SP), a dummy tower forward for ranks without media, and the fused LM
loss. Qwen2.5-VL's config (`veomni.models.qwen2_5_vl.patch_config`) reuses these functions through a name map.

* Text model: RMSNorm and SwiGLU are the Qwen3-VL adapter's functions (same maths); the attention is Qwen2-VL's own
  (biased q/k/v, optional sliding window) with the RoPE call dispatched through the instance's kernel set. The
  multimodal rotary (``mrope_section``) is folded into ``cos``/``sin`` by upstream's text rotary embedding (eager,
  unchanged): each frequency band takes the temporal, height or width position, so the attention applies an
  ordinary ``[B, S, D]`` rotation that the ``rope`` kernel covers.
* Vision attention: the Qwen3-VL adapter's function (renamed): ``veomni_*`` implementations and SP go through
  `veomni.models.hf.encoder_attention.encoder_attention` on the packed tokens; HF's own names run upstream's code.
* Vision tower: rotary positions without ``.tolist()`` (`veomni.models.qwen2_vl.vision.vision_position_ids`),
  ``cu_seqlens`` / ``max_seqlen`` taken from the keyword arguments when the collator precomputed them; under SP
  each rank embeds and attends its chunk of the patch rows (padded to ``sp * merge**2``, the padding a segment of
  its own) and the merged tokens are gathered once. ``dummy_forward`` for ranks without an image or video.
* ``Qwen2VLForConditionalGeneration.vision_collate_metadata``: the picklable `FrameSegments` the trainer's collator
  runs per micro-batch (the tower's ``cu_seqlens`` / ``max_seqlen``).
* ``Qwen2VLModel.forward``: one tower pass over all images and clips, the features placed without host syncs, the
  dummy tower pass, the SP scatter (`veomni.models.qwen2_vl.vision.embed_visual`); ``vision_metadata`` carries
  the collator's precomputed segment tables to the tower.

Regenerate with ``uv run patchgen veomni.models.qwen2_vl.patch_config``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from patchgen.config import PatchConfig
from transformers.cache_utils import Cache
from transformers.models.qwen2_vl.modeling_qwen2_vl import (
    ALL_ATTENTION_FUNCTIONS,
    BaseModelOutputWithPast,
    BaseModelOutputWithPooling,
    CausalLMOutputWithPast,
    FlashAttentionKwargs,
    TransformersKwargs,
    Unpack,
    apply_rotary_pos_emb,
    eager_attention_forward,
    get_vision_attention_seqlens,
)

from veomni.models.heads.causal_lm import lm_logits_and_loss
from veomni.models.hf.attention import PREFIX
from veomni.models.hf.encoder_attention import needs_max_seqlen
from veomni.models.hf.kernel_hooks import apply_rope
from veomni.models.hf.masks import use_veomni_masks
from veomni.models.hf.pretrained import upstream_checkpoint_io
from veomni.models.qwen2_vl.vision import FrameSegments, embed_visual, vision_position_ids
from veomni.models.qwen3_vl import patch_config as qwen3_vl
from veomni.models.qwen3_vl.sp import (
    check_sp_inputs,
    gather_merged,
    slice_patches,
    sp_group_or_none,
    sp_world_size,
)
from veomni.models.qwen3_vl.vision import dummy_vision_inputs

config = PatchConfig(
    source_module="transformers.models.qwen2_vl.modeling_qwen2_vl",
    target_file="patched_modeling_qwen2_vl.py",
    description="Qwen2-VL with veomni kernels in the text model, the encoder varlen entry in the vision tower (ViT "
    "Ulysses SP), a dummy tower forward for ranks without media, and the fused LM loss",
)
upstream_checkpoint_io(config, "Qwen2VLPreTrainedModel")
use_veomni_masks(config, "create_causal_mask", "create_sliding_window_causal_mask")
IMPORTS = (
    "from veomni.models.hf.kernel_hooks import apply_rope, apply_rope_vision",
    "from veomni.models.heads.causal_lm import lm_logits_and_loss",
    "from veomni.models.hf.attention import PREFIX",
    "from veomni.models.hf.encoder_attention import encoder_attention, needs_max_seqlen",
    "from veomni.models.qwen2_vl.vision import FrameSegments, embed_visual, permute_rows, vision_position_ids",
    "from veomni.models.qwen3_vl.sp import check_sp_inputs, gather_merged, slice_patches, sp_group_or_none, "
    "sp_world_size",
    "from veomni.models.qwen3_vl.vision import dummy_vision_inputs",
)
"""Imports of every function below (and of Qwen2.5-VL's config, which reuses them)."""
for statement in IMPORTS:
    config.add_import(statement)


config.override_method("Qwen2VLRMSNorm.forward", description="RMSNorm via kernels.get('rms_norm', 'standard') "
                       "(Qwen3-VL adapter)")(qwen3_vl.rms_norm_forward)  # fmt: skip
config.override_method("Qwen2MLP.forward", description="SwiGLU via kernels.get('swiglu', 'standard') (Qwen3-VL "
                       "adapter)")(qwen3_vl.mlp_forward)  # fmt: skip
config.override_method(
    "VisionAttention.forward",
    description="veomni_* implementations and SP: encoder_attention on the packed tokens and the tower's "
    "cu_seqlens (no per-image split, no host sync); HF implementations: upstream code (Qwen3-VL adapter)",
)(qwen3_vl.vision_attention_forward)


@config.override_method(
    "Qwen2VLAttention.forward",
    description="RoPE via kernels.get('rope', 'full') (the mrope sections are already folded into cos/sin)",
)
def text_attention_forward(
    self,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values: Cache | None = None,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs: Unpack[FlashAttentionKwargs],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    bsz, q_len, _ = hidden_states.size()

    query_states = self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
    key_states = self.k_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)

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
        sliding_window=self.sliding_window,
        position_ids=position_ids,  # text positions of packed rows, for HF's flash implementations
        **kwargs,
    )
    attn_output = attn_output.reshape(bsz, q_len, -1).contiguous()
    attn_output = self.o_proj(attn_output)
    return attn_output, attn_weights


@config.override_method(
    "Qwen2VisionTransformerPretrainedModel.forward",
    description="rotary positions without host syncs; cu_seqlens/max_seqlen from the collator when given; "
    "max_seqlen read once per forward, only for veomni backends that need it; under SP each rank embeds and "
    "attends its patch slice and the merged tokens are gathered once",
)
def vision_forward(
    self, hidden_states: torch.Tensor, grid_thw: torch.Tensor, **kwargs: Unpack[TransformersKwargs]
) -> tuple | BaseModelOutputWithPooling:
    r"""
    grid_thw (`torch.LongTensor` of shape `(num_images, 3)`):
        The temporal, height and width dimensions of feature shape for each image. Each row contains [t, h, w] values.
    """
    total = hidden_states.shape[0]
    position_ids = vision_position_ids(grid_thw, self.spatial_merge_size, total)
    cu_seqlens, max_seqlen = get_vision_attention_seqlens(grid_thw, self.config, kwargs=kwargs)
    implementation = self.config._attn_implementation or ""
    needs_max = implementation.startswith(PREFIX) and needs_max_seqlen(implementation)
    if max_seqlen is None and needs_max:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())  # one sync per forward, not per block

    sp_group = sp_group_or_none()
    if sp_group is not None:
        units = self.spatial_merge_size**2
        hidden_states, position_ids = (
            slice_patches(rows, units, sp_group) for rows in (hidden_states, position_ids)
        )
        # The padding attends as a sequence of its own: one more cu_seqlens entry, so no real patch sees it.
        padded = hidden_states.shape[0] * sp_world_size(sp_group)
        if padded > total:
            cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_full((1,), padded)])
            if max_seqlen is not None:
                max_seqlen = max(max_seqlen, padded - total)
        kwargs = {**kwargs, "sp_group": sp_group}

    hidden_states = self.patch_embed(hidden_states)
    position_embeddings = self.rotary_pos_emb(hidden_states, position_ids)

    for blk in self.blocks:
        hidden_states = blk(
            hidden_states,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            position_embeddings=position_embeddings,
            **kwargs,
        )

    merged_hidden_states = self.merger(hidden_states)
    if sp_group is not None:
        merged_hidden_states = gather_merged(
            merged_hidden_states, total // self.spatial_merge_size**2, sp_group
        )

    return BaseModelOutputWithPooling(
        last_hidden_state=hidden_states,
        pooler_output=merged_hidden_states,
    )


@config.override_method(
    "Qwen2VisionTransformerPretrainedModel.dummy_forward",
    description="injected: the tower on one all-zero merged token, for ranks whose micro-batch has no image or "
    "video (FSDP collectives must match across ranks)",
)
def vision_dummy_forward(self) -> torch.Tensor:
    """Run the tower on the smallest valid input and return a 0-d tensor that is 0 but depends on every output,
    so that adding it to the loss graph gives every tower parameter a gradient.

    Shapes come from the config, dtype and device from a live weight; nothing is cached. The segment tables of
    the one-frame grid are laid out on the host (``vision_layout``), so the dummy pass never reads the device.
    """
    pixels, grid = dummy_vision_inputs(self.config, self.patch_embed.proj.weight)
    merge = self.config.spatial_merge_size
    tables = self.vision_layout()(torch.tensor([[1, merge, merge]]))
    tables = {
        k: v.to(pixels.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in tables.items()
    }
    return self(pixels, grid_thw=grid, return_dict=True, **tables).pooler_output.sum() * 0.0


@config.override_method(
    "Qwen2VisionTransformerPretrainedModel.vision_layout",
    description="injected: the tower's picklable host-side segment table (FrameSegments: one segment per frame)",
)
def vision_layout(self) -> FrameSegments:
    """The function laying out this tower's segment tables on the host from ``grid_thw`` (`FrameSegments`)."""
    return FrameSegments()


@config.override_method(
    "Qwen2VLModel.forward",
    description="one tower pass over all images and videos, features placed without host syncs, dummy tower "
    "forward on ranks without media under world > 1, the collator's vision_metadata passed to the tower; under "
    "Ulysses SP the LM inputs are this rank's slice (position_ids required)",
)
def model_forward(
    self,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values: Cache | None = None,
    inputs_embeds: torch.Tensor | None = None,
    use_cache: bool | None = None,
    pixel_values: torch.Tensor | None = None,
    pixel_values_videos: torch.Tensor | None = None,
    image_grid_thw: torch.LongTensor | None = None,
    video_grid_thw: torch.LongTensor | None = None,
    mm_token_type_ids: torch.IntTensor | None = None,
    mm_encoder_outputs: dict[str, BaseModelOutputWithPooling] | None = None,
    vision_metadata: dict | None = None,
    **kwargs: Unpack[TransformersKwargs],
) -> tuple | BaseModelOutputWithPast:
    r"""
    vision_metadata (`dict`, *optional*):
        The vision tower's segment tables for the micro-batch's images then videos, precomputed on the host.
    """
    if (input_ids is None) ^ (inputs_embeds is not None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    if inputs_embeds is None:
        inputs_embeds = self.get_input_embeddings()(input_ids)
    sp_group = sp_group_or_none()
    if sp_group is not None:
        check_sp_inputs(self.config, position_ids, inputs_embeds, sp_group)

    media = {"image": (pixel_values, image_grid_thw), "video": (pixel_values_videos, video_grid_thw)}
    inputs_embeds = embed_visual(self, input_ids, inputs_embeds, media, mm_encoder_outputs, vision_metadata)

    if position_ids is None:
        position_ids = self.compute_3d_position_ids(
            input_ids=input_ids,
            image_grid_thw=image_grid_thw,
            video_grid_thw=video_grid_thw,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            mm_token_type_ids=mm_token_type_ids,
        )

    outputs = self.language_model(
        input_ids=None,
        position_ids=position_ids,
        attention_mask=attention_mask,
        past_key_values=past_key_values,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        **kwargs,
    )
    return outputs


@config.override_method(
    "Qwen2VLForConditionalGeneration.forward",
    description="LM head + loss via lm_logits_and_loss: a fused linear cross-entropy gets the hidden states and "
    "the LM-head weight (no [T, V] logits); eager runs the upstream head and loss; vision_metadata passed on",
)
def conditional_generation_forward(
    self,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values: Cache | None = None,
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.LongTensor | None = None,
    use_cache: bool | None = None,
    pixel_values: torch.Tensor | None = None,
    pixel_values_videos: torch.Tensor | None = None,
    image_grid_thw: torch.LongTensor | None = None,
    video_grid_thw: torch.LongTensor | None = None,
    mm_token_type_ids: torch.IntTensor | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    mm_encoder_outputs: dict[str, BaseModelOutputWithPooling] | None = None,
    vision_metadata: dict | None = None,
    **kwargs: Unpack[TransformersKwargs],
) -> tuple | CausalLMOutputWithPast:
    r"""
    vision_metadata (`dict`, *optional*):
        The vision tower's segment tables for the micro-batch's images then videos, precomputed on the host.
    """
    outputs = self.model(
        input_ids=input_ids,
        pixel_values=pixel_values,
        pixel_values_videos=pixel_values_videos,
        image_grid_thw=image_grid_thw,
        video_grid_thw=video_grid_thw,
        mm_token_type_ids=mm_token_type_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        past_key_values=past_key_values,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        mm_encoder_outputs=mm_encoder_outputs,
        vision_metadata=vision_metadata,
        **kwargs,
    )
    # logits_to_keep is applied before the loss; with a fused loss, logits stay None (never materialised).
    logits, loss = lm_logits_and_loss(self, outputs[0], labels, logits_to_keep, **kwargs)
    return CausalLMOutputWithPast(
        loss=loss,
        logits=logits,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )


@config.override_method(
    "Qwen2VLForConditionalGeneration.vision_collate_metadata",
    description="injected: the tower's picklable layout function (vision_layout) the trainer's collator runs per "
    "micro-batch, so the tower never reads grid_thw back from the device",
)
def vision_collate_metadata(self):
    """The host-side layout function of this model's vision tower (its ``vision_layout()``); called with a
    micro-batch's joint image+video ``grid_thw`` it returns the tower's ``vision_metadata``."""
    return self.model.visual.vision_layout()
