"""Patches Qwen2.5-VL's upstream modeling: everything Qwen2-VL's adapter does (reused from
`veomni.models.qwen2_vl.patch_config`), plus the windowed vision tower fed by a window layout precomputed on the host.

* Reused unchanged: text RMSNorm / SwiGLU (Qwen3-VL adapter), the text attention with the RoPE kernel (the
  ``mrope_section`` rotation folded into cos/sin upstream), the vision attention on the encoder varlen entry, the
  tower's ``dummy_forward``.
* Vision tower (written here): most blocks attend inside windows (`veomni.models.qwen2_5_vl.window`); the window
  order, ``cu_window_seqlens``, ``cu_seqlens`` and their maxima come as keyword arguments from the collator
  (``vision_metadata``), so the forward has no host sync; without them (plain inference calls) the tower computes
  them on the host once per forward. Under Ulysses SP the patch rows are put in window order first, then each
  rank embeds and attends its chunk (padded to ``sp * merge**2``, the padding a segment of its own in both
  tables), the merged tokens are gathered and put back in image order.
* ``Qwen2_5_VLModel.forward`` / ``Qwen2_5_VLForConditionalGeneration.forward``: as Qwen2-VL's (one tower pass,
  features placed without host syncs, dummy pass, SP scatter, fused loss) plus upstream's ``second_per_grid_ts``.
* ``Qwen2_5_VisionTransformerPretrainedModel.vision_layout``: the picklable `WindowIndex`, which the trainer's
  collator runs per micro-batch (through ``vision_collate_metadata``) and the dummy forward on its one-frame grid.

Regenerate with ``uv run patchgen veomni.models.qwen2_5_vl.patch_config``.
"""

from __future__ import annotations

import torch
from patchgen.config import PatchConfig
from transformers.cache_utils import Cache
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    BaseModelOutputWithPast,
    BaseModelOutputWithPooling,
    CausalLMOutputWithPast,
    TransformersKwargs,
    Unpack,
)

from veomni.models.heads.causal_lm import lm_logits_and_loss
from veomni.models.hf.attention import PREFIX
from veomni.models.hf.encoder_attention import needs_max_seqlen
from veomni.models.hf.masks import use_veomni_masks
from veomni.models.hf.pretrained import upstream_checkpoint_io
from veomni.models.qwen2_5_vl.window import WindowIndex
from veomni.models.qwen2_vl import patch_config as qwen2_vl
from veomni.models.qwen2_vl.vision import embed_visual, permute_rows, vision_position_ids
from veomni.models.qwen3_vl import patch_config as qwen3_vl
from veomni.models.qwen3_vl.sp import (
    check_sp_inputs,
    gather_merged,
    slice_patches,
    sp_group_or_none,
    sp_world_size,
)

config = PatchConfig(
    source_module="transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
    target_file="patched_modeling_qwen2_5_vl.py",
    description="Qwen2.5-VL: the Qwen2-VL adapter's text kernels, encoder varlen vision attention, ViT SP and dummy "
    "forward, plus the windowed tower fed by a host-precomputed window layout",
)
upstream_checkpoint_io(config, "Qwen2_5_VLPreTrainedModel")
use_veomni_masks(config, "create_causal_mask", "create_sliding_window_causal_mask")
for statement in qwen2_vl.IMPORTS:
    config.add_import(statement)
config.add_import("from veomni.models.qwen2_5_vl.window import WindowIndex")

_VISION = {"Qwen2Vision": "Qwen2_5_Vision", "Qwen2VL": "Qwen2_5_VL"}
_REUSED = (
    ("Qwen2_5_VLRMSNorm.forward", qwen3_vl.rms_norm_forward, "RMSNorm via kernels.get('rms_norm', 'standard')"),
    ("Qwen2MLP.forward", qwen3_vl.mlp_forward, "SwiGLU via kernels.get('swiglu', 'standard')"),
    ("Qwen2_5_VLAttention.forward", qwen2_vl.text_attention_forward,
     "RoPE via kernels.get('rope', 'full') (the mrope sections are already folded into cos/sin)"),
    ("Qwen2_5_VLVisionAttention.forward", qwen3_vl.vision_attention_forward,
     "veomni_* implementations and SP: encoder_attention on the packed tokens and cu_seqlens"),
    ("Qwen2_5_VisionTransformerPretrainedModel.dummy_forward", qwen2_vl.vision_dummy_forward,
     "injected: the tower on one all-zero merged token (tables laid out on the host), for ranks without media"),
    ("Qwen2_5_VLForConditionalGeneration.vision_collate_metadata", qwen2_vl.vision_collate_metadata,
     "injected: the tower's picklable layout function (WindowIndex) the trainer's collator runs per micro-batch"),
)  # fmt: skip
for target, function, description in _REUSED:
    config.override_method(target, description=f"{description} (reused)", name_map=_VISION)(function)


@config.override_method(
    "Qwen2_5_VisionTransformerPretrainedModel.forward",
    description="window layout and segment tables from the collator's keywords (host fallback without them, no "
    "per-forward tolist loop on the device); rotary positions without host syncs; under SP the rows are put in "
    "window order, each rank embeds and attends its chunk, and the merged tokens are gathered once",
)
def vision_forward(
    self, hidden_states: torch.Tensor, grid_thw: torch.Tensor, **kwargs: Unpack[TransformersKwargs]
) -> tuple | BaseModelOutputWithPooling:
    """
    Args:
        hidden_states (`torch.Tensor` of shape `(seq_len, C * T_patch * P * P)`): the packed pixel rows (all of
            them on every rank, also under sequence parallelism).
        grid_thw (`torch.Tensor` of shape `(num_images_or_videos, 3)`): (t, h, w) patches per image/clip.
    """
    layout = WindowIndex.from_config(self.config)  # refuses a window_size that splits merged tokens
    names = ("window_index", "cu_window_seqlens", "max_window_seqlen", "cu_seqlens", "max_seqlen")
    if kwargs.get("window_index") is None or kwargs.get("cu_window_seqlens") is None:
        # Not precomputed (a direct inference call): lay the windows out on the host, once for all blocks.
        kwargs = {**layout(grid_thw), **{k: v for k, v in kwargs.items() if v is not None}}
    tables = {name: kwargs.pop(name, None) for name in names}
    device = hidden_states.device
    window_index = tables["window_index"].to(device)
    cu_window = tables["cu_window_seqlens"].to(device)
    cu_seqlens = tables["cu_seqlens"]
    cu_seqlens = (cu_seqlens if cu_seqlens is not None else layout(grid_thw)["cu_seqlens"]).to(device)
    max_seqlen, max_window = tables["max_seqlen"], tables["max_window_seqlen"]
    implementation = self.config._attn_implementation or ""
    # HF's flash names read the maxima themselves when given None; veomni's varlen backends get them here.
    needs_max = implementation.startswith(PREFIX) and needs_max_seqlen(implementation)
    if needs_max and (max_seqlen is None or max_window is None):
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        max_window = int((cu_window[1:] - cu_window[:-1]).max())

    total = hidden_states.shape[0]
    units = self.spatial_merge_unit
    position_ids = vision_position_ids(grid_thw, self.spatial_merge_size, total)
    sp_group = sp_group_or_none()
    if sp_group is None:
        # Upstream's order: embed, then reorder by window (rotary rows reordered the same way).
        hidden_states = permute_rows(self.patch_embed(hidden_states), window_index, units)
        position_ids = permute_rows(position_ids, window_index, units)
    else:
        # Reorder the pixel rows (embedding is per row), then keep this rank's chunk of whole merged tokens.
        hidden_states, position_ids = (
            slice_patches(permute_rows(rows, window_index, units), units, sp_group)
            for rows in (hidden_states, position_ids)
        )
        padded = hidden_states.shape[0] * sp_world_size(sp_group)
        if padded > total:
            # The padding attends as a segment of its own in both tables, so no real patch sees it.
            pad = cu_seqlens.new_full((1,), padded)
            cu_seqlens, cu_window = torch.cat([cu_seqlens, pad]), torch.cat([cu_window, pad])
            if max_seqlen is not None:
                max_seqlen, max_window = max(max_seqlen, padded - total), max(max_window, padded - total)
        kwargs = {**kwargs, "sp_group": sp_group}
        hidden_states = self.patch_embed(hidden_states)
    position_embeddings = self.rotary_pos_emb(hidden_states, position_ids)

    for layer_num, blk in enumerate(self.blocks):
        full = layer_num in self.fullatt_block_indexes
        hidden_states = blk(
            hidden_states,
            cu_seqlens=cu_seqlens if full else cu_window,
            max_seqlen=max_seqlen if full else max_window,
            position_embeddings=position_embeddings,
            **kwargs,
        )

    merged_hidden_states = self.merger(hidden_states)
    if sp_group is not None:
        merged_hidden_states = gather_merged(merged_hidden_states, total // units, sp_group)
    merged_hidden_states = merged_hidden_states[torch.argsort(window_index)]

    return BaseModelOutputWithPooling(
        last_hidden_state=hidden_states,
        pooler_output=merged_hidden_states,
    )


@config.override_method(
    "Qwen2_5_VLModel.forward",
    description="one tower pass over all images and videos, features placed without host syncs, dummy tower "
    "forward on ranks without media under world > 1, the collator's vision_metadata (window layout) passed to the "
    "tower; under Ulysses SP the LM inputs are this rank's slice (position_ids required)",
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
    second_per_grid_ts: torch.Tensor | None = None,
    mm_encoder_outputs: dict[str, BaseModelOutputWithPooling] | None = None,
    vision_metadata: dict | None = None,
    **kwargs: Unpack[TransformersKwargs],
) -> tuple | BaseModelOutputWithPast:
    r"""
    second_per_grid_ts (`torch.Tensor` of shape `(num_videos)`, *optional*):
        The time interval (in seconds) for each grid along the temporal dimension in the 3D position IDs.
    vision_metadata (`dict`, *optional*):
        The vision tower's window layout and segment tables for the micro-batch's images then videos.
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
            second_per_grid_ts=second_per_grid_ts,
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
    "Qwen2_5_VLForConditionalGeneration.forward",
    description="LM head + loss via lm_logits_and_loss (fused linear cross-entropy: no [T, V] logits); "
    "vision_metadata passed on",
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
    second_per_grid_ts: torch.Tensor | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    mm_encoder_outputs: dict[str, BaseModelOutputWithPooling] | None = None,
    vision_metadata: dict | None = None,
    **kwargs: Unpack[TransformersKwargs],
) -> tuple | CausalLMOutputWithPast:
    r"""
    second_per_grid_ts (`torch.Tensor` of shape `(num_videos)`, *optional*):
        The time interval (in seconds) for each grid along the temporal dimension in the 3D position IDs.
    vision_metadata (`dict`, *optional*):
        The vision tower's window layout and segment tables for the micro-batch's images then videos.
    """
    outputs = self.model(
        input_ids=input_ids,
        pixel_values=pixel_values,
        pixel_values_videos=pixel_values_videos,
        image_grid_thw=image_grid_thw,
        video_grid_thw=video_grid_thw,
        second_per_grid_ts=second_per_grid_ts,
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
    logits, loss = lm_logits_and_loss(self, outputs[0], labels, logits_to_keep, **kwargs)
    return CausalLMOutputWithPast(
        loss=loss,
        logits=logits,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )


@config.override_method(
    "Qwen2_5_VisionTransformerPretrainedModel.vision_layout",
    description="injected: the tower's picklable host-side layout (WindowIndex: windows and per-frame segments)",
)
def vision_layout(self) -> WindowIndex:
    """The function laying out this tower's window order and segment tables on the host from ``grid_thw``."""
    return WindowIndex.from_config(self.config)
