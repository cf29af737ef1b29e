"""Patches Qwen3-VL's upstream modeling for veomni: text layers on veomni's kernels, the vision tower on the encoder
varlen entry without host syncs, a dummy tower forward for ranks without images, and the fused LM loss.

* Text model: RMSNorm, SwiGLU and RoPE dispatch through the instance's kernel set as in the Qwen3 adapter. Qwen3-VL's
  interleaved mrope is folded into ``cos``/``sin`` by the text rotary embedding (eager, unchanged), so the
  attention applies an ordinary ``[B, S, D]`` rotation and the ``rope`` kernel covers it.
* Vision attention (body in `veomni.models.qwen3_vl.vision_patches`, as the tower's, registered here): with a
  ``veomni_*`` implementation it calls `veomni.models.hf.encoder_attention.encoder_attention` on the packed tokens and the tower's own ``cu_seqlens`` (no per-image split); with HF's own names (``eager``,
  ``sdpa``, ``flash_attention_*``) upstream's code runs unchanged, so no-kernel models equal transformers bitwise.
* Vision tower: rotary positions and learned-position taps computed without ``.tolist()`` (`vision.vision_geometry`);
  ``max_seqlen`` read once per forward and only for backends that need it; ``dummy_forward`` for ranks whose
  micro-batch has no image or video.
* ``Qwen3VLModel`` builds these patched sub-models (upstream's ``AutoModel.from_config`` would build transformers'
  own classes), runs the tower once over all images and videos of the micro-batch and scatters the features
  without per-image splits; under a parallel state with world > 1 a rank without any runs the dummy forward so
  that FSDP's collectives match across ranks.
* Ulysses SP (`veomni.models.qwen3_vl.sp`): every SP rank gets the full pixel rows and slices them itself (pad to a
  multiple of ``sp * merge**2``, the padding a ``cu_seqlens`` segment of its own), the tower attends through
  ``encoder_attention`` with the SP group and gathers its
  merged and deepstack features once; the language model runs on this rank's slice of ``input_ids`` /
  ``position_ids`` (required, 3 or 4 mrope rows) / labels, and each rank keeps its token range of the scatter.

Regenerate with ``uv run patchgen veomni.models.qwen3_vl.patch_config``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from patchgen.config import PatchConfig
from transformers.cache_utils import Cache
from transformers.models.qwen3_vl.modeling_qwen3_vl import (
    ALL_ATTENTION_FUNCTIONS,
    BaseModelOutputWithPast,
    BaseModelOutputWithPooling,
    CausalLMOutputWithPast,
    FlashAttentionKwargs,
    Qwen3VLConfig,
    Qwen3VLTextModel,
    Qwen3VLVisionModel,
    TransformersKwargs,
    Unpack,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from veomni.models.heads.causal_lm import lm_logits_and_loss
from veomni.models.hf.kernel_hooks import apply_rope
from veomni.models.hf.masks import use_veomni_masks
from veomni.models.hf.pretrained import upstream_checkpoint_io
from veomni.models.qwen3_vl.sp import check_sp_inputs, scatter_visual_sp, sp_group_or_none
from veomni.models.qwen3_vl.vision import parallel_world_size, scatter_visual
from veomni.models.qwen3_vl.vision_patches import (
    vision_attention_forward,
    vision_dummy_forward,
    vision_forward,
)

config = PatchConfig(
    source_module="transformers.models.qwen3_vl.modeling_qwen3_vl",
    target_file="patched_modeling_qwen3_vl.py",
    description="Qwen3-VL with veomni kernels in the text model, the encoder varlen entry in the vision tower, "
    "a dummy tower forward for ranks without images, and the fused LM loss",
)
upstream_checkpoint_io(config, "Qwen3VLPreTrainedModel")
use_veomni_masks(config, "create_causal_mask")
config.add_import("from veomni.models.hf.kernel_hooks import apply_rope, apply_rope_vision")
config.add_import("from veomni.models.heads.causal_lm import lm_logits_and_loss")
config.add_import("from veomni.models.hf.attention import PREFIX")
config.add_import("from veomni.models.hf.encoder_attention import encoder_attention, needs_max_seqlen")
config.add_import(
    "from veomni.models.qwen3_vl.vision import dummy_vision_inputs, parallel_world_size, "
    "scatter_visual, vision_geometry"
)
config.add_import(
    "from veomni.models.qwen3_vl.sp import check_sp_inputs, gather_merged, scatter_visual_sp, slice_patches, "
    "sp_group_or_none, sp_world_size"
)


# ------------------------------------------------------------------------------------------------ text model


@config.override_method(
    "Qwen3VLTextRMSNorm.forward", description="RMSNorm via kernels.get('rms_norm', 'standard')"
)
def rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    kernels = getattr(self, "veomni_kernels", None)
    if kernels is not None and kernels.config.rms_norm != "eager":
        # Same maths as below: normalise in fp32, cast to the input dtype, then scale by the weight.
        return kernels.get("rms_norm", "standard")(hidden_states, self.weight, self.variance_epsilon)
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)


@config.override_method("Qwen3VLTextMLP.forward", description="SwiGLU via kernels.get('swiglu', 'standard')")
def mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    kernels = getattr(self, "veomni_kernels", None)
    if kernels is not None and kernels.config.swiglu != "eager":
        if self.config.hidden_act != "silu":
            raise ValueError(
                f"OpsConfig.swiglu={kernels.config.swiglu!r} computes silu(gate) * up, but this model's "
                f"hidden_act is {self.config.hidden_act!r}; set swiglu='eager'"
            )
        return self.down_proj(kernels.get("swiglu", "standard")(self.gate_proj(x), self.up_proj(x)))
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@config.override_method(
    "Qwen3VLTextAttention.forward",
    description="RoPE via kernels.get('rope', 'full') (the interleaved mrope is already folded into cos/sin)",
)
def text_attention_forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    past_key_values: Cache | None = None,
    **kwargs: Unpack[FlashAttentionKwargs],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)

    query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
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


@config.override_method(
    "Qwen3VLTextModel._deepstack_process",
    description="deepstack add as a gather + where (no boolean indexing: no host sync); also takes features "
    "already laid out over all B*S positions",
)
def deepstack_process(
    self, hidden_states: torch.Tensor, visual_pos_masks: torch.Tensor, visual_embeds: torch.Tensor
) -> torch.Tensor:
    # visual_embeds: [N_visual, H] in sequence order (upstream's contract), or [B*S, H] over every position.
    # The two coincide when every position is visual, so the row count tells them apart.
    mask = visual_pos_masks.to(hidden_states.device)
    visual_embeds = visual_embeds.to(hidden_states.device, hidden_states.dtype)
    if visual_embeds.shape[0] != mask.numel():
        index = (mask.reshape(-1).long().cumsum(0) - 1).clamp(min=0)
        visual_embeds = visual_embeds.index_select(0, index)
    visual_embeds = visual_embeds.reshape(hidden_states.shape)
    return torch.where(mask[..., None], hidden_states + visual_embeds, hidden_states)


# ------------------------------------------------------------------------------------------------ vision tower
# The bodies live in vision_patches.py; registered here, between the text and composite patches, so the
# generated header lists the patches in the same order.

config.override_method(
    "Qwen3VLVisionAttention.forward",
    description="veomni_* implementations: encoder_attention on the packed tokens and the tower's cu_seqlens "
    "(no per-image split, no host sync, no outer kwargs); HF implementations: upstream code",
)(vision_attention_forward)
config.override_method(
    "Qwen3VLVisionModel.forward",
    description="rotary positions and position-embedding taps without host syncs (vision_geometry); max_seqlen "
    "read once per forward, only for veomni backends that need it; under SP each rank embeds and attends its "
    "patch slice and the merged and deepstack features are gathered once",
)(vision_forward)
config.override_method(
    "Qwen3VLVisionModel.dummy_forward",
    description="injected: the tower on one all-zero merged token, for ranks whose micro-batch has no image or "
    "video (FSDP collectives must match across ranks)",
)(vision_dummy_forward)


# ------------------------------------------------------------------------------------------------ composite model


@config.override_method(
    "Qwen3VLModel.__init__",
    description="build the patched vision and text sub-models (upstream's AutoModel.from_config would build "
    "transformers' own, unpatched classes)",
)
def model_init(self, config: Qwen3VLConfig):
    super().__init__(config)
    self.visual = Qwen3VLVisionModel._from_config(config.vision_config)
    self.language_model = Qwen3VLTextModel._from_config(config.text_config)
    self.rope_deltas = None  # cache rope_deltas here

    # Initialize weights and apply final processing
    self.post_init()


@config.override_method(
    "Qwen3VLModel.forward",
    description="one tower pass over all images and videos (no per-image split), features scattered without "
    "host syncs, dummy tower forward on ranks without visual input under world > 1; under Ulysses SP the LM "
    "inputs are this rank's slice (position_ids required) and the visual features land in its token range",
)
def model_forward(
    self,
    input_ids: torch.LongTensor = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values: Cache | None = None,
    inputs_embeds: torch.Tensor | None = None,
    pixel_values: torch.Tensor | None = None,
    pixel_values_videos: torch.Tensor | None = None,
    image_grid_thw: torch.LongTensor | None = None,
    video_grid_thw: torch.LongTensor | None = None,
    mm_token_type_ids: torch.IntTensor | None = None,
    mm_encoder_outputs: dict[str, BaseModelOutputWithPooling] | None = None,
    **kwargs: Unpack[TransformersKwargs],
) -> tuple | BaseModelOutputWithPast:
    if (input_ids is None) ^ (inputs_embeds is not None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    if (pixel_values is not None or pixel_values_videos is not None) and mm_encoder_outputs is not None:
        raise ValueError(
            "You cannot specify both pixel_values/pixel_values_videos and mm_encoder_outputs at the same time"
        )
    for name, pixels, grid in (
        ("pixel_values", pixel_values, image_grid_thw),
        ("pixel_values_videos", pixel_values_videos, video_grid_thw),
    ):
        if pixels is not None and grid is None:
            raise ValueError(f"{name} was given without its grid_thw ([n, 3] (t, h, w) per image/clip)")

    if inputs_embeds is None:
        inputs_embeds = self.get_input_embeddings()(input_ids)
    # Under SP the text inputs are this rank's slice of the sequence; the pixels are the whole micro-batch's.
    sp_group = sp_group_or_none()
    if sp_group is not None:
        check_sp_inputs(self.config, position_ids, inputs_embeds, sp_group)

    # Per modality: (embeds [N, H], deepstack [N, H] per deepstack layer). Precomputed encoder outputs come in
    # upstream's per-image tuples.
    features = {}
    for modality in ("image", "video"):
        given = (mm_encoder_outputs or {}).get(modality)
        if given is not None:
            features[modality] = (
                torch.cat(given.pooler_output, dim=0),
                [torch.cat(feat, dim=0) for feat in given.deepstack_features],
            )
    runs = [(m, p, g) for m, p, g in (("image", pixel_values, image_grid_thw), ("video", pixel_values_videos,
            video_grid_thw)) if p is not None]  # fmt: skip
    if runs:
        # One tower pass over every image and clip: frames attend only within themselves, so this equals
        # separate passes, and every rank runs the tower exactly once per step.
        pixels = torch.cat([p for _, p, _ in runs], dim=0).type(self.visual.dtype)
        grids = torch.cat([g for _, _, g in runs], dim=0)
        out = self.visual(pixels, grid_thw=grids, return_dict=True)
        merge = self.visual.spatial_merge_size**2
        start = 0
        for modality, p, _ in runs:
            stop = start + p.shape[0] // merge
            features[modality] = (
                out.pooler_output[start:stop],
                [feat[start:stop] for feat in out.deepstack_features],
            )
            start = stop
    elif not features and parallel_world_size() > 1:
        # This rank has no visual input but others may: run the tower anyway so FSDP's all-gathers and
        # reduce-scatters of its parameters match across ranks; the 0-valued result keeps it in the graph.
        inputs_embeds = inputs_embeds + self.visual.dummy_forward().to(inputs_embeds.dtype)

    visual_pos_masks = None
    deepstack_visual_embeds = None
    if features:
        # Under SP the counts are checked over the full sequence, inside scatter_visual_sp.
        checked = sp_group is None
        image_mask, video_mask = self.get_placeholder_mask(
            input_ids,
            inputs_embeds=inputs_embeds,
            image_features=features["image"][0] if checked and "image" in features else None,
            video_features=features["video"][0] if checked and "video" in features else None,
        )
        masks = {"image": image_mask[..., 0], "video": video_mask[..., 0]}
        order = [m for m in ("image", "video") if m in features]
        local_masks, feats = [masks[m] for m in order], [features[m][0] for m in order]
        if sp_group is None:
            inputs_embeds, visual_pos_masks, index = scatter_visual(inputs_embeds, local_masks, feats)
        else:
            inputs_embeds, visual_pos_masks, index = scatter_visual_sp(
                inputs_embeds, local_masks, feats, sp_group
            )
        layers = zip(*[features[m][1] for m in order], strict=True)
        if len(order) == 1 and sp_group is None:
            deepstack_visual_embeds = [feat for (feat,) in layers]
        else:
            # Both modalities, or this rank's slice of the sequence: lay the features out over every (local)
            # position, which also cuts them to this rank's token range (no data-dependent sizes).
            deepstack_visual_embeds = [torch.cat(feats, dim=0).index_select(0, index) for feats in layers]

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
        visual_pos_masks=visual_pos_masks,
        deepstack_visual_embeds=deepstack_visual_embeds,
        **kwargs,
    )

    return outputs


@config.override_method(
    "Qwen3VLForConditionalGeneration.forward",
    description="LM head + loss via lm_logits_and_loss: a fused linear cross-entropy gets the hidden states and "
    "the LM-head weight (no [T, V] logits); eager runs the upstream head and loss",
)
def conditional_generation_forward(
    self,
    input_ids: torch.LongTensor = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values: Cache | None = None,
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.LongTensor | None = None,
    pixel_values: torch.Tensor | None = None,
    pixel_values_videos: torch.Tensor | None = None,
    image_grid_thw: torch.LongTensor | None = None,
    video_grid_thw: torch.LongTensor | None = None,
    mm_token_type_ids: torch.IntTensor | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    mm_encoder_outputs: dict[str, BaseModelOutputWithPooling] | None = None,
    **kwargs: Unpack[TransformersKwargs],
) -> tuple | CausalLMOutputWithPast:
    outputs = self.model(
        input_ids=input_ids,
        pixel_values=pixel_values,
        pixel_values_videos=pixel_values_videos,
        image_grid_thw=image_grid_thw,
        video_grid_thw=video_grid_thw,
        position_ids=position_ids,
        attention_mask=attention_mask,
        past_key_values=past_key_values,
        inputs_embeds=inputs_embeds,
        mm_token_type_ids=mm_token_type_ids,
        mm_encoder_outputs=mm_encoder_outputs,
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
