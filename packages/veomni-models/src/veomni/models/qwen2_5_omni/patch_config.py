"""Patches Qwen2.5-Omni's upstream modeling for veomni: the thinker only (text, image, video and audio in, text
out), with dummy tower forwards for ranks without a modality, a checked audio scatter and the fused LM loss.

* Excluded from the generated file: the talker, token2wav (DiT + BigVGAN vocoder) and the full
  ``Qwen2_5OmniForConditionalGeneration`` that wires them. Nobody trains speech generation here; their checkpoint
  weights are ignored *and reported* at load (`veomni.models.qwen2_5_omni.checkpoint`), and ``enable_talker`` /
  ``generate(return_audio=True)`` on the thinker raise instead of doing nothing.
* Host-side layouts: the collator's ``vision_metadata`` (`veomni.models.qwen2_5_vl.window.WindowIndex`) and
  ``audio_metadata`` (`veomni.models.qwen2_5_omni.audio_layout.AudioChunks`) feed the towers their segment tables,
  so a training forward reads nothing back from the device; without them the tables are derived once per forward.
* Audio and vision attention: with a ``veomni_*`` implementation they call
  `veomni.models.hf.encoder_attention.encoder_attention` on the packed tokens and the tower's own ``cu_seqlens``
  (audio chunks; vision windows or images), no per-chunk split or host sync; HF names run upstream's forwards.
* ``Qwen2_5OmniAudioEncoder.dummy_forward`` / ``Qwen2_5OmniVisionEncoder.dummy_forward`` (injected): the tower on
  its smallest valid input (dtype and device from a live weight), returned as a 0-valued scalar depending on every
  output, so a rank whose micro-batch lacks audio or pixels still runs the tower and FSDP's collectives match.
* ``Qwen2_5OmniThinkerModel.forward``: upstream's order (audio, image, video scatter; mrope positions with audio
  lengths and seconds-per-grid from the model's own ``get_rope_index``), plus the audio token/feature count check
  upstream lacks (its ``masked_scatter`` silently uses a prefix), the towers called without the language
  model's kwargs (packing ``cu_seq_lens_*`` of the text must never reach them), one vision tower pass over the
  micro-batch's images and videos together (equal to upstream's two; every rank runs the tower once per step),
  mrope positions also without an attention mask
  (upstream silently falls back to 1-D positions) and the dummy forwards under world > 1. Host-side positions
  for the data loader: `veomni.models.qwen2_5_omni.positions`.
* ``Qwen2_5OmniThinkerForConditionalGeneration.forward``: LM head + loss through `lm_logits_and_loss` (a fused
  linear cross-entropy never materialises ``[T, V]`` logits; eager equals upstream).

Ulysses SP: the language model runs on this rank's slice of ``input_ids`` / ``position_ids`` (required, ``[3, B,
S_local]``, e.g. from `veomni.models.qwen2_5_omni.positions`) / labels; the audio tower slices its post-conv
frames across the SP ranks and gathers them before pooling; the vision tower (Qwen2.5-VL's windowed forward, reused)
embeds and attends each rank's slice of the window-ordered patches and gathers the merged tokens; every rank scatters its token range of the features
(`veomni.models.qwen3_vl.sp.scatter_visual_sp`, counts checked over the full sequence). Regenerate with ``uv run patchgen veomni.models.qwen2_5_omni.patch_config``.
"""

from __future__ import annotations

import torch
from patchgen.config import PatchConfig
from transformers.activations import SiLUActivation
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    BaseModelOutputWithPast,
    BaseModelOutputWithPooling,
    Cache,
    CausalLMOutputWithPast,
    Qwen2_5OmniAudioEncoder,
    Qwen2_5OmniThinkerConfig,
    Qwen2_5OmniThinkerTextModel,
    Qwen2_5OmniVisionEncoder,
    SinusoidsPositionEmbedding,
    TransformersKwargs,
    Unpack,
    init,
    nn,
)

from veomni.models.heads.causal_lm import lm_logits_and_loss
from veomni.models.hf.masks import use_veomni_masks
from veomni.models.hf.pretrained import upstream_checkpoint_io
from veomni.models.qwen2_5_omni import tower_patches
from veomni.models.qwen2_5_omni.towers import (
    TALKER_REFUSAL,
    check_placeholder_counts,
    check_thinker_sp_inputs,
)
from veomni.models.qwen2_5_vl import patch_config as qwen2_5_vl
from veomni.models.qwen2_vl import patch_config as qwen2_vl
from veomni.models.qwen3_vl import patch_config as qwen3_vl
from veomni.models.qwen3_vl.sp import (
    check_sp_inputs,
    scatter_visual_sp,
    sp_group_or_none,
    sp_world_size,
)
from veomni.models.qwen3_vl.vision import parallel_world_size, scatter_visual

config = PatchConfig(
    source_module="transformers.models.qwen2_5_omni.modeling_qwen2_5_omni",
    target_file="patched_modeling_qwen2_5_omni.py",
    description="Qwen2.5-Omni thinker only (talker / token2wav excluded), dummy audio and vision tower forwards "
    "for ranks without a modality, a checked audio scatter and the fused LM loss",
)
upstream_checkpoint_io(config, "Qwen2_5OmniPreTrainedModel")
use_veomni_masks(config, "create_causal_mask", "create_sliding_window_causal_mask")
config.add_import("from veomni.models.heads.causal_lm import lm_logits_and_loss")
config.add_import(
    "from veomni.models.qwen2_5_omni.towers import TALKER_REFUSAL, check_placeholder_counts, "
    "check_thinker_sp_inputs, dummy_audio_inputs"
)
config.add_import(
    "from veomni.models.qwen3_vl.vision import dummy_vision_inputs, parallel_world_size, scatter_visual"
)
config.add_import("from veomni.models.qwen2_5_vl.window import WindowIndex")
config.add_import("from veomni.models.qwen2_vl.vision import permute_rows, vision_position_ids")
config.add_import(
    "from veomni.models.qwen3_vl.sp import check_sp_inputs, gather_merged, scatter_visual_sp, slice_patches, "
    "sp_group_or_none, sp_world_size"
)
config.add_import("from veomni.models.hf.attention import PREFIX")
config.add_import("from veomni.models.hf.encoder_attention import encoder_attention, needs_max_seqlen")
# The HF-named implementations run upstream's own attention forwards, unchanged.
config.add_import("from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as _upstream")

# Speech generation: the talker, the token2wav DiT and BigVGAN vocoder, their building blocks, and the full model.
config.exclude_from_output(
    "Qwen2_5OmniForConditionalGeneration",
    "Qwen2_5OmniTalkerCausalLMOutputWithPast",
    "Qwen2_5OmniTalkerModel",
    "Qwen2_5OmniTalkerForConditionalGeneration",
    "Qwen2_5OmniToken2WavModel",
    "Qwen2_5OmniToken2WavDiTModel",
    "Qwen2_5OmniToken2WavBigVGANModel",
    "Qwen2_5OmniDiTRotaryEmbedding",
    "TimeDelayNetBlock",
    "Res2NetBlock",
    "SqueezeExcitationBlock",
    "AttentiveStatisticsPooling",
    "SqueezeExcitationRes2NetBlock",
    "ECAPA_TimeDelayNet",
    "DiTInputEmbedding",
    "DiTCodecEmbedding",
    "Qwen2_5_OmniAdaLayerNormZero",
    "Qwen2_5_OmniAdaLayerNormZero_Final",
    "DiTMLP",
    "deinterleave_head_dim",
    "DiTAttention",
    "SinusPositionEmbedding",
    "DiTTimestepEmbedding",
    "DiTDecoderLayer",
    "Qwen2_5OmniSnakeBeta",
    "Qwen2_5OmniUpSample1d",
    "Qwen2_5OmniDownSample1d",
    "Qwen2_5OmniAntiAliasedActivation1d",
    "Qwen2_5OmniAMPBlock",
    "Activation1d",
    "UpSample1d",
    "DownSample1d",
    "SnakeBeta",
    "AMPBlock",
    "RungeKutta4ODESolver",
    "kaiser_sinc_filter1d",
)


# ------------------------------------------------------------------------------------------------ kernels

config.add_import("from veomni.models.hf.kernel_hooks import apply_rope")
config.add_import("from transformers.activations import SiLUActivation")
config.override_method(
    "Qwen2_5OmniRMSNorm.forward",
    description="RMSNorm via kernels.get('rms_norm', 'standard') (Qwen3-VL adapter; text and vision blocks)",
)(qwen3_vl.rms_norm_forward)
config.override_method(
    "Qwen2_5OmniAttention.forward",
    description="RoPE via kernels.get('rope', 'full') (the mrope sections are already folded into cos/sin; "
    "Qwen2-VL adapter)",
)(qwen2_vl.text_attention_forward)


@config.override_method(
    "Qwen2MLP.forward", description="SwiGLU via kernels.get('swiglu', 'standard') (the text MLP)"
)
@config.override_method(
    "Qwen2_5OmniMLP.forward",
    description="SwiGLU via kernels.get('swiglu', 'standard') (the vision MLP, biased)",
)
def mlp_forward(self, hidden_state: torch.Tensor) -> torch.Tensor:
    kernels = getattr(self, "veomni_kernels", None)
    if kernels is not None and kernels.config.swiglu != "eager":
        # These MLPs keep no config: the activation module says whether silu(gate) * up is the maths.
        if not isinstance(self.act_fn, SiLUActivation | nn.SiLU):
            raise ValueError(
                f"OpsConfig.swiglu={kernels.config.swiglu!r} computes silu(gate) * up, but {type(self).__name__}'s "
                f"activation is {type(self.act_fn).__name__}; set swiglu='eager'"
            )
        swiglu = kernels.get("swiglu", "standard")
        return self.down_proj(swiglu(self.gate_proj(hidden_state), self.up_proj(hidden_state)))
    return self.down_proj(self.act_fn(self.gate_proj(hidden_state)) * self.up_proj(hidden_state))


# ------------------------------------------------------------------------------------------------ towers


@config.override_method(
    "Qwen2_5OmniPreTrainedModel._init_weights",
    description="upstream's init without the vocoder's up/down-sampling filters (those classes are excluded)",
)
def init_weights(self, module) -> None:
    super()._init_weights(module)
    if isinstance(module, SinusoidsPositionEmbedding):
        position_embeddings = module.compute_default_singular_positional_embedding()
        init.copy_(module.positional_embedding, position_embeddings)


# The bodies live in tower_patches.py (patchgen copies them into the generated file).
config.override_method(
    "Qwen2_5OmniAudioAttention.forward",
    description="veomni_* implementations: encoder_attention on the packed frames and the tower's chunk "
    "cu_seqlens (no per-chunk split, no host sync, no outer kwargs); HF implementations: upstream's forward",
)(tower_patches.audio_attention_forward)

config.override_method(
    "Qwen2_5OmniVisionAttention.forward",
    description="veomni_* implementations and SP: encoder_attention on the packed patches and the tower's (window "
    "or full) cu_seqlens; HF implementations: upstream's forward",
)(tower_patches.vision_attention_forward)

config.override_method(
    "Qwen2_5OmniAudioEncoder.forward",
    description="upstream's forward; under Ulysses SP each rank runs the encoder layers on its slice of the "
    "post-conv frames (padding a cu_seqlens segment of its own) and the frames are gathered once before pooling",
)(tower_patches.audio_encoder_forward)

config.override_method(
    "Qwen2_5OmniAudioEncoder.dummy_forward",
    description="injected: the audio tower on one 4-frame zero clip, for ranks whose micro-batch has no audio",
)(tower_patches.audio_dummy_forward)


_VISION_REUSED = (
    ("Qwen2_5OmniVisionEncoder.forward", qwen2_5_vl.vision_forward,
     "Qwen2.5-VL's windowed tower forward (the same tower): window layout and segment tables from the collator's "
     "vision_metadata (host fallback), max_seqlen read once per forward, SP slicing of the patches"),
    ("Qwen2_5OmniVisionEncoder.vision_layout", qwen2_5_vl.vision_layout,
     "injected: the tower's picklable host-side layout (WindowIndex)"),
    ("Qwen2_5OmniVisionEncoder.dummy_forward", qwen2_vl.vision_dummy_forward,
     "injected: the tower on one all-zero merged token (tables laid out on the host), for ranks without media"),
    ("Qwen2_5OmniThinkerForConditionalGeneration.vision_collate_metadata", qwen2_vl.vision_collate_metadata,
     "injected: the tower's layout function (WindowIndex) the trainer's collator runs per micro-batch"),
)  # fmt: skip
for _target, _function, _description in _VISION_REUSED:
    config.override_method(_target, description=f"{_description} (reused)")(_function)


# ------------------------------------------------------------------------------------------------ thinker


@config.override_method(
    "Qwen2_5OmniThinkerModel.__init__",
    description="upstream's init, then the whole towers dropped from _no_split_modules: FSDP2 shards their layers "
    "(Qwen2_5OmniAudioEncoderLayer, Qwen2_5OmniVisionBlock) as blocks, and blocks must not nest",
)
def thinker_model_init(self, config: Qwen2_5OmniThinkerConfig):
    super().__init__(config)
    self.audio_tower = Qwen2_5OmniAudioEncoder._from_config(config.audio_config)
    self.visual = Qwen2_5OmniVisionEncoder._from_config(config.vision_config)
    self.language_model = Qwen2_5OmniThinkerTextModel._from_config(config.text_config)
    self.spatial_merge_size = config.vision_config.spatial_merge_size
    self.rope_deltas = None
    self.post_init()
    # post_init collected the class list (the towers) and the children's (their layers) into this instance set.
    self._no_split_modules = self._no_split_modules - {"Qwen2_5OmniAudioEncoder", "Qwen2_5OmniVisionEncoder"}


@config.override_method(
    "Qwen2_5OmniThinkerModel.forward",
    description="upstream's audio / image / video scatter and mrope positions, plus the audio token count check "
    "upstream lacks, one vision tower pass over images and videos together, and dummy tower forwards on ranks "
    "without audio or pixels under world > 1",
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
    use_audio_in_video: bool | None = None,
    video_second_per_grid: torch.LongTensor | None = None,
    mm_encoder_outputs: dict[str, BaseModelOutputWithPooling] | None = None,
    vision_metadata: dict | None = None,
    audio_metadata: dict | None = None,
    **kwargs: Unpack[TransformersKwargs],
) -> tuple | BaseModelOutputWithPast:
    r"""
    feature_attention_mask (`torch.Tensor` of shape `(num_audios, frames)`, *optional*):
        1 for the mel frames of each clip in ``input_features`` (`(num_audios, num_mel_bins, frames)`), 0 for padding.
    audio_feature_lengths (`torch.LongTensor` of shape `(num_audios,)`, *optional*):
        Mel frames per clip, when ``feature_attention_mask`` is not given.
    use_audio_in_video (`bool`, *optional*):
        Whether the videos' audio tracks are interleaved with their frames (the processor's setting).
    video_second_per_grid (`torch.LongTensor` of shape `(num_videos,)`, *optional*):
        Seconds per temporal grid step of each video (mrope temporal positions).
    vision_metadata (`dict`, *optional*):
        The vision tower's window layout and segment tables for the micro-batch's images then videos
        (`veomni.models.qwen2_5_vl.window.WindowIndex`, the trainer's collator runs it).
    audio_metadata (`dict`, *optional*):
        The audio tower's chunk layout of the micro-batch's clips
        (`veomni.models.qwen2_5_omni.audio_layout.AudioChunks`); without it the layout is derived on the device.
    """
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
        check_thinker_sp_inputs(input_ids, position_ids, sp_world_size(sp_group))
        # HF's attention functions would attend over this rank's slice only: the LM must run veomni's.
        check_sp_inputs(self.config, position_ids, inputs_embeds, sp_group)

    # Every modality's features in sequence order, all of the micro-batch's (the towers run once per step).
    features: dict[str, torch.Tensor] = {}
    if input_features is not None and audio_metadata is not None:
        # The host's layout: frames gathered by index and the tower's tables given, no host sync.
        tables = dict(audio_metadata)
        frame_index, tokens = tables.pop("frame_index"), tables.pop("audio_tokens")
        frames = (
            input_features.permute(0, 2, 1).reshape(-1, input_features.shape[1]).index_select(0, frame_index)
        )
        audio = self.audio_tower(frames.T, feature_lens=None, return_dict=True, **tables).last_hidden_state
        if audio.shape[0] != tokens:
            raise ValueError(f"the audio tower gave {audio.shape[0]} rows, audio_metadata expects {tokens}")
        features["audio"] = audio
    elif input_features is not None:
        features["audio"] = self.get_audio_features(
            input_features, feature_attention_mask, audio_feature_lengths, return_dict=True
        ).last_hidden_state
    elif distributed:
        # This rank has no audio but others may: FSDP's gathers of the tower's parameters must still match.
        inputs_embeds = inputs_embeds + self.audio_tower.dummy_forward().to(inputs_embeds.dtype)

    mm_encoder_outputs = dict(mm_encoder_outputs) if mm_encoder_outputs is not None else {}
    runs = [(m, p, g) for m, p, g in (("image", pixel_values, image_grid_thw), ("video", pixel_values_videos,
            video_grid_thw)) if p is not None and mm_encoder_outputs.get(m) is None]  # fmt: skip
    for modality, _, grid in runs:
        if grid is None:
            raise ValueError(
                f"{modality} pixels were given without their grid_thw ([n, 3] (t, h, w) per item)"
            )
    if runs:
        # One tower pass over every image and video (upstream makes one per modality): items attend only within
        # themselves (per-item windows and full attention), so this equals two passes, and every rank runs the
        # tower exactly once per step whatever mix it holds (FSDP's collectives must match across ranks).
        # The tower directly (get_image_features splits per item with a host sync), with the collator's tables.
        pixels = torch.cat([p for _, p, _ in runs], dim=0).type(self.visual.dtype)
        grids = torch.cat([g for _, _, g in runs], dim=0)
        pooled = self.visual(
            pixels, grid_thw=grids, return_dict=True, **dict(vision_metadata or {})
        ).pooler_output
        start, merge = 0, self.visual.spatial_merge_size**2
        for modality, rows, _ in runs:
            features[modality] = pooled[start : start + rows.shape[0] // merge]
            start += rows.shape[0] // merge
    for modality in ("image", "video"):
        if modality not in features and mm_encoder_outputs.get(modality) is not None:
            features[modality] = torch.cat(mm_encoder_outputs[modality].pooler_output, dim=0)
    if pixel_values is None and pixel_values_videos is None and not mm_encoder_outputs and distributed:
        inputs_embeds = inputs_embeds + self.visual.dummy_forward().to(inputs_embeds.dtype)

    if features:
        image_mask, video_mask, audio_mask = self.get_placeholder_mask(input_ids, inputs_embeds=inputs_embeds)
        masks = {"audio": audio_mask[..., 0], "image": image_mask[..., 0], "video": video_mask[..., 0]}
        order = [m for m in ("audio", "image", "video") if m in features]
        if sp_group is None:
            # Counts checked first (one read-back for all modalities), then a gather + where: upstream's
            # masked_scatter values, but its backward (masked_select) would sync the host mid-backward.
            check_placeholder_counts({m: masks[m] for m in order}, features)
            inputs_embeds, _, _ = scatter_visual(
                inputs_embeds, [masks[m] for m in order], [features[m] for m in order]
            )
        else:
            # Counts are checked over the full sequence; each rank keeps its token range of the features.
            inputs_embeds, _, _ = scatter_visual_sp(
                inputs_embeds, [masks[m] for m in order], [features[m] for m in order], sp_group
            )

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
        return_dict=True,
        **kwargs,
    )
    return BaseModelOutputWithPast(
        last_hidden_state=outputs.last_hidden_state,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )


@config.override_method(
    "Qwen2_5OmniThinkerForConditionalGeneration.forward",
    description="LM head + loss via lm_logits_and_loss (fused linear cross-entropy: no [T, V] logits); eager runs "
    "the upstream head and loss; the collator's vision_metadata / audio_metadata passed on",
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
    use_audio_in_video: bool | None = None,
    video_second_per_grid: torch.LongTensor | None = None,
    mm_encoder_outputs: dict[str, BaseModelOutputWithPooling] | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    vision_metadata: dict | None = None,
    audio_metadata: dict | None = None,
    **kwargs: Unpack[TransformersKwargs],
) -> tuple | CausalLMOutputWithPast:
    r"""
    feature_attention_mask (`torch.Tensor` of shape `(num_audios, frames)`, *optional*):
        1 for the mel frames of each clip in ``input_features`` (`(num_audios, num_mel_bins, frames)`), 0 for padding.
    audio_feature_lengths (`torch.LongTensor` of shape `(num_audios,)`, *optional*):
        Mel frames per clip, when ``feature_attention_mask`` is not given.
    use_audio_in_video (`bool`, *optional*):
        Whether the videos' audio tracks are interleaved with their frames (the processor's setting).
    video_second_per_grid (`torch.LongTensor` of shape `(num_videos,)`, *optional*):
        Seconds per temporal grid step of each video (mrope temporal positions).
    vision_metadata (`dict`, *optional*):
        The vision tower's window layout and segment tables for the micro-batch's images then videos.
    audio_metadata (`dict`, *optional*):
        The audio tower's chunk layout of the micro-batch's clips (`AudioChunks`).
    """
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
        use_audio_in_video=use_audio_in_video,
        video_second_per_grid=video_second_per_grid,
        mm_encoder_outputs=mm_encoder_outputs,
        vision_metadata=vision_metadata,
        audio_metadata=audio_metadata,
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
    "Qwen2_5OmniThinkerForConditionalGeneration.enable_talker",
    description="injected: a clear error (the talker is not part of veomni's thinker)",
)
def enable_talker(self) -> None:
    """Always raises: speech generation needs the talker and token2wav, which veomni does not build."""
    raise NotImplementedError(TALKER_REFUSAL)


@config.override_method(
    "Qwen2_5OmniThinkerForConditionalGeneration.generate",
    description="injected: text generation as GenerationMixin.generate; speech arguments (return_audio, speaker, "
    "talker_*) raise instead of being ignored",
)
def generate(self, *args, **kwargs):
    """Text generation (``GenerationMixin.generate``); speech-generation arguments raise ``NotImplementedError``."""
    speech = sorted(k for k in kwargs if k in ("return_audio", "speaker") or k.startswith("talker_"))
    if speech and not (speech == ["return_audio"] and not kwargs["return_audio"]):
        raise NotImplementedError(f"{TALKER_REFUSAL} (got speech arguments {speech})")
    kwargs.pop("return_audio", None)
    return super().generate(*args, **kwargs)
