"""Patches Qwen3-Omni-MoE's upstream modeling for veomni: the thinker only (text, image, video and audio in, text
out) with Qwen3-VL's vision tower, Qwen3-VL-MoE's routed experts and Qwen2.5-Omni's audio handling.

* Excluded from the generated file: the talker (its MoE text model and code predictor), code2wav and the full
  ``Qwen3OmniMoeForConditionalGeneration``. Their checkpoint weights are ignored *and reported* at load (the
  loader's unexpected-key report groups them by top-level prefix); ``enable_talker`` and speech arguments of
  ``generate`` raise.
* Reused from `veomni.models.qwen3_vl.patch_config` (the thinker's text model and vision encoder are Qwen3-VL's,
  class names aside): text RMSNorm / dense MLP / attention on the instance's kernels, the deepstack add without
  host syncs, the vision attention on the encoder varlen entry, the vision forward with ViT Ulysses SP and the
  tower's ``dummy_forward``. From `veomni.models.qwen3_vl_moe.patch_config`: ``get_parallel_plan`` (same FQNs).
  From `veomni.models.qwen2_5_omni.patch_config`: ``enable_talker`` and ``generate`` (they name no class).
* Written here (the audio tower's bodies in `veomni.models.qwen3_omni_moe.audio_patches`): the audio attention (a ``veomni_*`` implementation or SP: the encoder varlen entry on the packed
  frames and the tower's window ``cu_seqlens``; HF names: upstream's forward), the audio encoder's forward (Qwen3's 2-D conv front-end per 100-frame chunk; under SP the
  encoder layers run on this rank's slice of the post-conv frames, gathered before the projection) and its
  ``dummy_forward``; ``Qwen3OmniMoeThinkerModel.__init__`` / ``forward`` (one vision-tower pass, audio and visual
  scatters with counts checked, deepstack features at the visual positions only, dummy tower forwards on ranks
  without a modality, mrope positions also without an attention mask, SP slices); the thinker head's forward
  (fused LM loss + router aux loss weighted by ``text_config.router_aux_loss_coef``).
* Experts (``Qwen3OmniMoeThinkerTextExperts``, HF's fused ``[E, 2I, H]`` / ``[E, H, I]`` layout) are not patched:
  HF's experts interface dispatches them to ``"veomni"`` (`veomni.models.hf.experts`). Full-Omni checkpoints
  store per-expert tensors under ``thinker.model.layers``; transformers' scoped recipes (the thinker's prefix
  renames, then the ``qwen2_moe`` expert merge on ``model.language_model``) load them
  (`veomni.models.convert.recipes`).

Regenerate with ``uv run patchgen veomni.models.qwen3_omni_moe.patch_config``.
"""

from __future__ import annotations

import torch
from patchgen.config import PatchConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    BaseModelOutputWithPooling,
    Cache,
    MoeCausalLMOutputWithPast,
    MoeModelOutputWithPast,
    Qwen3OmniMoeAudioEncoder,
    Qwen3OmniMoeThinkerConfig,
    Qwen3OmniMoeThinkerTextExperts,
    Qwen3OmniMoeThinkerTextModel,
    Qwen3OmniMoeThinkerTextTopKRouter,
    Qwen3OmniMoeVisionEncoder,
    SinusoidsPositionEmbedding,
    TransformersKwargs,
    Unpack,
    init,
    load_balancing_loss_func,
)

from veomni.models.heads.causal_lm import lm_logits_and_loss, router_aux_loss
from veomni.models.hf.masks import use_veomni_masks
from veomni.models.hf.pretrained import upstream_checkpoint_io
from veomni.models.qwen2_5_omni import patch_config as omni25
from veomni.models.qwen2_5_omni.towers import check_placeholder_count
from veomni.models.qwen3_omni_moe import audio_patches
from veomni.models.qwen3_vl import patch_config as vl
from veomni.models.qwen3_vl.sp import (
    check_sp_inputs,
    scatter_visual_sp,
    sp_group_or_none,
)
from veomni.models.qwen3_vl.vision import parallel_world_size, scatter_visual
from veomni.models.qwen3_vl_moe import patch_config as vl_moe

config = PatchConfig(
    source_module="transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe",
    target_file="patched_modeling_qwen3_omni_moe.py",
    description="Qwen3-Omni-MoE thinker only (talker / code2wav excluded): Qwen3-VL's text kernels, vision tower "
    "and ViT SP, routed experts through veomni's experts interface, the audio tower on the encoder varlen entry "
    "with SP and dummy forwards, checked scatters, the fused LM loss and the aux loss from text_config",
)
upstream_checkpoint_io(config, "Qwen3OmniMoePreTrainedModel", "Qwen3OmniMoeThinkerTextPreTrainedModel")
use_veomni_masks(config, "create_causal_mask", "create_sliding_window_causal_mask")
for statement in vl.config.imports:
    config.add_import(statement)
config.add_import("from veomni.models.heads.causal_lm import router_aux_loss")
config.add_import("from veomni.core.ep import ExpertPlan")
config.add_import("from veomni.models.qwen2_5_omni.towers import check_placeholder_count, dummy_audio_inputs")
config.add_import("from veomni.models.qwen3_omni_moe.towers import TALKER_REFUSAL, check_audio_window")
# The HF-named implementations of the audio attention run upstream's own forward, unchanged.
config.add_import("from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as _upstream")

# Speech generation: the talker (MoE text model, code predictor), code2wav, their blocks and the full model.
config.exclude_from_output(
    "Qwen3OmniMoeTalkerResizeMLP",
    "Qwen3OmniMoeTalkerCodePredictorOutputWithPast",
    "Qwen3OmniMoeRMSNorm",
    "Qwen3OmniMoeTalkerCodePredictorAttention",
    "Qwen3OmniMoeMLP",
    "Qwen3OmniMoeTalkerCodePredictorDecoderLayer",
    "Qwen3OmniMoeRotaryEmbedding",
    "Qwen3OmniMoeTalkerCodePredictorModel",
    "Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration",
    "Qwen3OmniMoeTalkerOutputWithPast",
    "Qwen3OmniMoeTalkerRotaryEmbedding",
    "Qwen3OmniMoeTalkerTextMLP",
    "Qwen3OmniMoeTalkerTextTopKRouter",
    "Qwen3OmniMoeTalkerTextExperts",
    "Qwen3OmniMoeTalkerTextSparseMoeBlock",
    "Qwen3OmniMoeTalkerDecoderLayer",
    "Qwen3OmniMoeTalkerModel",
    "Qwen3OmniMoeTalkerForConditionalGeneration",
    "Qwen3OmniMoeCausalConvNet",
    "Qwen3OmniMoeCausalTransConvNet",
    "Qwen3OmniMoeConvNeXtBlock",
    "Qwen3OmniMoeCode2WavAttention",
    "Qwen3OmniMoeCode2WavMlp",
    "Qwen3OmniMoeCode2WavRMSNorm",
    "Qwen3OmniMoeCode2WavLayerScale",
    "Qwen3OmniMoeCode2WavTransformerLayer",
    "Qwen3OmniMoeCode2WavTransformerModel",
    "Qwen3OmniMoeSnakeBeta",
    "SnakeBeta",
    "Qwen3OmniMoeCode2WavDecoderResidualUnit",
    "Qwen3OmniMoeCode2WavDecoderBlock",
    "Qwen3OmniMoeCode2Wav",
    "Qwen3OmniMoeForConditionalGeneration",
)

_REUSED = (
    ("Qwen3OmniMoeThinkerTextRMSNorm.forward", vl.rms_norm_forward, "RMSNorm via kernels.get('rms_norm', 'standard')"),
    ("Qwen3OmniMoeTextRMSNorm.forward", vl.rms_norm_forward, "RMSNorm via kernels.get('rms_norm', 'standard') "
     "(the text model's final norm)"),
    ("Qwen3OmniMoeThinkerTextMLP.forward", vl.mlp_forward, "SwiGLU via kernels.get('swiglu', 'standard') (dense "
     "layers)"),
    ("Qwen3OmniMoeThinkerTextAttention.forward", vl.text_attention_forward, "RoPE via kernels.get('rope', 'full') "
     "(the interleaved mrope is folded into cos/sin; sliding_window is None in this model)"),
    ("Qwen3OmniMoeThinkerTextModel._deepstack_process", vl.deepstack_process, "deepstack add as a gather + where"),
    ("Qwen3OmniMoeVisionAttention.forward", vl.vision_attention_forward,
     "veomni_* implementations: encoder_attention on the packed tokens and the tower's cu_seqlens"),
    ("Qwen3OmniMoeVisionEncoder.forward", vl.vision_forward,
     "rotary positions and position-embedding taps without host syncs; ViT Ulysses SP"),
    ("Qwen3OmniMoeVisionEncoder.dummy_forward", vl.vision_dummy_forward,
     "injected: the tower on one all-zero merged token, for ranks without image or video"),
)  # fmt: skip
for target, function, description in _REUSED:
    config.override_method(target, description=f"{description} (Qwen3-VL adapter)")(function)

_REUSED_OMNI = (
    ("Qwen3OmniMoeThinkerForConditionalGeneration.enable_talker", omni25.enable_talker,
     "injected: a clear error (the talker is not part of veomni's thinker)"),
    ("Qwen3OmniMoeThinkerForConditionalGeneration.generate", omni25.generate,
     "injected: text generation as GenerationMixin.generate; speech arguments raise"),
)  # fmt: skip
for target, function, description in _REUSED_OMNI:
    config.override_method(target, description=f"{description} (Qwen2.5-Omni adapter)")(function)

for target in ("Qwen3OmniMoeThinkerForConditionalGeneration.get_parallel_plan",):
    config.override_method(
        target, description="expert parallelism: the language model's fused expert tensors, sharded on dim 0 "
        "(Qwen3-VL-MoE adapter)",
    )(vl_moe.get_parallel_plan)  # fmt: skip
config.override_method(
    "Qwen3OmniMoeThinkerModel.get_parallel_plan",
    description="expert parallelism for the base model: the language model's expert tensors on dim 0 (Qwen3-VL-MoE "
    "adapter)",
)(vl_moe.model_parallel_plan)


# ------------------------------------------------------------------------------------------------ audio tower


# The bodies live in audio_patches.py (patchgen copies them into the generated file).
config.override_method(
    "Qwen3OmniMoeAudioAttention.forward",
    description="veomni_* implementations or SP: encoder_attention on the packed frames and the tower's window "
    "cu_seqlens (no per-window split, no host sync); HF implementations: upstream's forward",
)(audio_patches.audio_attention_forward)


@config.override_method(
    "Qwen3OmniMoePreTrainedModel._init_weights",
    description="upstream's init without code2wav's code offsets (that class is excluded); the experts and the "
    "router initialised on their own modules, not on the sparse block that holds them",
)
def init_weights(self, module) -> None:
    super()._init_weights(module)
    std = getattr(self.config, "initializer_range", 0.02)
    # transformers treats a module outside its package as remote code and skips modules without parameters of
    # their own (the sparse block upstream initialises its children from): the weights would stay torch.empty.
    # Children are visited before their parent, so this draws the same numbers in the same order as upstream.
    if isinstance(module, Qwen3OmniMoeThinkerTextExperts):
        init.normal_(module.gate_up_proj, mean=0.0, std=std)
        init.normal_(module.down_proj, mean=0.0, std=std)
    elif isinstance(module, Qwen3OmniMoeThinkerTextTopKRouter):
        init.normal_(module.weight, mean=0.0, std=std)
    elif isinstance(module, SinusoidsPositionEmbedding):
        init.copy_(module.positional_embedding, module.compute_default_singular_positional_embedding())


config.override_method(
    "Qwen3OmniMoeAudioEncoder.forward",
    description="upstream's forward (conv front-end per 2*n_window-frame chunk, windowed attention); n_window "
    "checked; under Ulysses SP each rank runs the encoder layers on its slice of the post-conv frames (the padding "
    "a cu_seqlens segment of its own) and the frames are gathered once before the output projection",
)(audio_patches.audio_encoder_forward)
config.override_method(
    "Qwen3OmniMoeAudioEncoder.dummy_forward",
    description="injected: the audio tower on one 4-frame zero clip, for ranks whose micro-batch has no audio",
)(audio_patches.audio_dummy_forward)


# ------------------------------------------------------------------------------------------------ thinker


@config.override_method(
    "Qwen3OmniMoeThinkerModel.__init__",
    description="upstream's init, then the whole towers dropped from _no_split_modules: FSDP2 shards their layers "
    "(Qwen3OmniMoeAudioEncoderLayer, Qwen3OmniMoeVisionBlock) as blocks, and blocks must not nest",
)
def thinker_model_init(self, config: Qwen3OmniMoeThinkerConfig):
    super().__init__(config)
    self.audio_tower = Qwen3OmniMoeAudioEncoder._from_config(config.audio_config)
    self.visual = Qwen3OmniMoeVisionEncoder._from_config(config.vision_config)
    self.language_model = Qwen3OmniMoeThinkerTextModel._from_config(config.text_config)
    self.spatial_merge_size = config.vision_config.spatial_merge_size
    self.rope_deltas = None
    self.post_init()
    # post_init collected the class list (the towers) and the children's (their layers) into this instance set.
    self._no_split_modules = self._no_split_modules - {
        "Qwen3OmniMoeAudioEncoder",
        "Qwen3OmniMoeVisionEncoder",
    }


@config.add_helper(description="the thinker's vision features: one tower pass over all images and videos")
def _vision_features(
    self, pixel_values, pixel_values_videos, image_grid_thw, video_grid_thw, mm_encoder_outputs
):
    """Per visual modality ``(embeds [N, H], deepstack [N, H] per deepstack layer)``: one tower pass over every
    image and clip (frames attend only within themselves, so this equals separate passes), or the given
    encoder outputs (upstream's per-item tuples)."""
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
    for name, _, grid in runs:
        if grid is None:
            raise ValueError(
                f"{name} pixels were given without their grid_thw ([n, 3] (t, h, w) per image/clip)"
            )
    if runs:
        pixels = torch.cat([p for _, p, _ in runs], dim=0).type(self.visual.dtype)
        out = self.visual(pixels, grid_thw=torch.cat([g for _, _, g in runs], dim=0), return_dict=True)
        merge = self.visual.spatial_merge_size**2
        start = 0
        for modality, p, _ in runs:
            stop = start + p.shape[0] // merge
            features[modality] = (
                out.pooler_output[start:stop],
                [f[start:stop] for f in out.deepstack_features],
            )
            start = stop
    return features


@config.override_method(
    "Qwen3OmniMoeThinkerModel.forward",
    description="audio scatter (count checked, upstream lacks it), one vision-tower pass with deepstack features "
    "at the visual positions, dummy tower forwards on ranks without audio or pixels under world > 1, mrope "
    "positions also without an attention mask, and under Ulysses SP this rank's slice of the sequence",
)
def thinker_model_forward(
    self,
    input_ids: torch.LongTensor | None = None,
    input_features: torch.Tensor | None = None,
    pixel_values: torch.Tensor | None = None,
    pixel_values_videos: torch.Tensor | None = None,
    image_grid_thw: torch.LongTensor | None = None,
    video_grid_thw: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    feature_attention_mask: torch.Tensor | None = None,
    audio_feature_lengths: torch.LongTensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values: Cache | None = None,
    inputs_embeds: torch.Tensor | None = None,
    use_cache: bool | None = None,
    output_router_logits: bool | None = None,
    use_audio_in_video: bool | None = None,
    video_second_per_grid: torch.LongTensor | None = None,
    mm_encoder_outputs: dict[str, BaseModelOutputWithPooling] | None = None,
    **kwargs: Unpack[TransformersKwargs],
) -> tuple | MoeModelOutputWithPast:
    r"""
    feature_attention_mask (`torch.Tensor` of shape `(num_audios, frames)`, *optional*):
        1 for the mel frames of each clip in ``input_features`` (`(num_audios, num_mel_bins, frames)`), 0 for padding.
    audio_feature_lengths (`torch.LongTensor` of shape `(num_audios,)`, *optional*):
        Mel frames per clip, when ``feature_attention_mask`` is not given.
    use_audio_in_video (`bool`, *optional*):
        Whether the videos' audio tracks are interleaved with their frames (the processor's setting).
    video_second_per_grid (`torch.LongTensor` of shape `(num_videos,)`, *optional*):
        Seconds per temporal grid step of each video (mrope temporal positions).
    """
    if output_router_logits is None:
        output_router_logits = self.config.text_config.output_router_logits
    if (pixel_values is not None or pixel_values_videos is not None) and mm_encoder_outputs is not None:
        raise ValueError(
            "You cannot specify both pixel_values/pixel_values_videos and mm_encoder_outputs at the same time"
        )
    if input_features is not None and feature_attention_mask is None and audio_feature_lengths is None:
        raise ValueError(
            "input_features ([B, n_mels, frames]) was given without feature_attention_mask ([B, frames]) or "
            "audio_feature_lengths ([B]): the audio tower needs each clip's frame count"
        )
    if inputs_embeds is None:
        inputs_embeds = self.get_input_embeddings()(input_ids)
    distributed = parallel_world_size() > 1
    # Under Ulysses SP the text inputs are this rank's slice; audio and pixels are the whole micro-batch's.
    sp_group = sp_group_or_none()
    if sp_group is not None:
        if input_ids is None:
            raise ValueError("the Qwen3-Omni-MoE thinker under sequence parallelism needs input_ids")
        check_sp_inputs(self.config, position_ids, inputs_embeds, sp_group)

    audio = None
    if input_features is not None:
        audio = self.get_audio_features(
            input_features, feature_attention_mask, audio_feature_lengths, return_dict=True
        ).last_hidden_state
    elif distributed:
        # This rank has no audio but others may: FSDP's gathers of the tower's parameters must still match.
        inputs_embeds = inputs_embeds + self.audio_tower.dummy_forward().to(inputs_embeds.dtype)
    features = _vision_features(
        self, pixel_values, pixel_values_videos, image_grid_thw, video_grid_thw, mm_encoder_outputs
    )
    if not features and distributed:
        inputs_embeds = inputs_embeds + self.visual.dummy_forward().to(inputs_embeds.dtype)

    visual_pos_masks, deepstack_visual_embeds = None, None
    if audio is not None or features:
        image_mask, video_mask, audio_mask = self.get_placeholder_mask(input_ids, inputs_embeds=inputs_embeds)
        masks = {"audio": audio_mask[..., 0], "image": image_mask[..., 0], "video": video_mask[..., 0]}
        if audio is not None and sp_group is None:
            # Upstream's scatter (bitwise upstream), with the count checked first.
            check_placeholder_count("audio", masks["audio"], audio)
            inputs_embeds = inputs_embeds.masked_scatter(
                audio_mask.expand_as(inputs_embeds), audio.to(inputs_embeds.device, inputs_embeds.dtype)
            )
        elif audio is not None:
            inputs_embeds, _, _ = scatter_visual_sp(inputs_embeds, [masks["audio"]], [audio], sp_group)
        order = [m for m in ("image", "video") if m in features]
        if order:
            local_masks, feats = [masks[m] for m in order], [features[m][0] for m in order]
            if sp_group is None:
                for modality, feat in zip(order, feats, strict=True):
                    check_placeholder_count(modality, masks[modality], feat)
                inputs_embeds, visual_pos_masks, index = scatter_visual(inputs_embeds, local_masks, feats)
            else:
                inputs_embeds, visual_pos_masks, index = scatter_visual_sp(
                    inputs_embeds, local_masks, feats, sp_group
                )
            # Deepstack features laid out over every (local) position; _deepstack_process adds them where visual.
            layers = zip(*[features[m][1] for m in order], strict=True)
            deepstack_visual_embeds = [torch.cat(f, dim=0).index_select(0, index) for f in layers]

    if feature_attention_mask is not None:
        audio_feature_lengths = torch.sum(feature_attention_mask, dim=1)
    if position_ids is None:
        # Upstream builds mrope positions only when an attention mask is given and otherwise falls back to 1-D
        # text positions, silently flattening images; a training batch without padding has none, so use ones.
        mask_for_positions = attention_mask
        if mask_for_positions is None and input_ids is not None and past_key_values is None:
            mask_for_positions = torch.ones_like(input_ids)
        position_ids = self.compute_3d_position_ids(
            input_ids=input_ids,
            image_grid_thw=image_grid_thw,
            video_grid_thw=video_grid_thw,
            inputs_embeds=inputs_embeds,
            attention_mask=mask_for_positions,
            past_key_values=past_key_values,
            use_audio_in_video=use_audio_in_video,
            audio_feature_lengths=audio_feature_lengths,
            video_second_per_grid=video_second_per_grid,
        )

    outputs = self.language_model(
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        output_router_logits=output_router_logits,
        deepstack_visual_embeds=deepstack_visual_embeds,
        visual_pos_masks=visual_pos_masks,
        **kwargs,
    )
    return MoeModelOutputWithPast(
        last_hidden_state=outputs.last_hidden_state,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
        past_key_values=outputs.past_key_values,
        router_logits=outputs.router_logits,
    )


@config.override_method(
    "Qwen3OmniMoeThinkerForConditionalGeneration.forward",
    description="LM head + loss via lm_logits_and_loss (fused linear cross-entropy: no [T, V] logits); aux loss "
    "via router_aux_loss (SP-global statistics, None without router logits) scaled by self.router_aux_loss_coef "
    "(text_config's, set by upstream's __init__)",
)
def thinker_forward(
    self,
    input_ids: torch.LongTensor | None = None,
    input_features: torch.Tensor | None = None,
    pixel_values: torch.Tensor | None = None,
    pixel_values_videos: torch.Tensor | None = None,
    image_grid_thw: torch.LongTensor | None = None,
    video_grid_thw: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    feature_attention_mask: torch.Tensor | None = None,
    audio_feature_lengths: torch.LongTensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values: Cache | None = None,
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.LongTensor | None = None,
    use_cache: bool | None = None,
    output_router_logits: bool | None = None,
    use_audio_in_video: bool | None = None,
    video_second_per_grid: torch.LongTensor | None = None,
    mm_encoder_outputs: dict[str, BaseModelOutputWithPooling] | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    **kwargs: Unpack[TransformersKwargs],
) -> tuple | MoeCausalLMOutputWithPast:
    r"""
    feature_attention_mask (`torch.Tensor` of shape `(num_audios, frames)`, *optional*):
        1 for the mel frames of each clip in ``input_features`` (`(num_audios, num_mel_bins, frames)`), 0 for padding.
    audio_feature_lengths (`torch.LongTensor` of shape `(num_audios,)`, *optional*):
        Mel frames per clip, when ``feature_attention_mask`` is not given.
    use_audio_in_video (`bool`, *optional*):
        Whether the videos' audio tracks are interleaved with their frames (the processor's setting).
    video_second_per_grid (`torch.LongTensor` of shape `(num_videos,)`, *optional*):
        Seconds per temporal grid step of each video (mrope temporal positions).
    """
    if output_router_logits is None:
        output_router_logits = self.config.text_config.output_router_logits
    outputs = self.model(
        input_ids=input_ids,
        input_features=input_features,
        pixel_values=pixel_values,
        pixel_values_videos=pixel_values_videos,
        image_grid_thw=image_grid_thw,
        video_grid_thw=video_grid_thw,
        attention_mask=attention_mask,
        feature_attention_mask=feature_attention_mask,
        audio_feature_lengths=audio_feature_lengths,
        position_ids=position_ids,
        past_key_values=past_key_values,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        output_router_logits=output_router_logits,
        use_audio_in_video=use_audio_in_video,
        video_second_per_grid=video_second_per_grid,
        mm_encoder_outputs=mm_encoder_outputs,
        **kwargs,
    )
    logits, loss = lm_logits_and_loss(self, outputs[0], labels, logits_to_keep, **kwargs)

    aux_loss = None
    if output_router_logits:
        aux_loss = router_aux_loss(self, outputs.router_logits, attention_mask, load_balancing_loss_func)
        if loss is not None and aux_loss is not None:
            loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)

    return MoeCausalLMOutputWithPast(
        loss=loss,
        aux_loss=aux_loss,
        logits=logits,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
        router_logits=outputs.router_logits,
    )
