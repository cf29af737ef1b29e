"""Replacement bodies for the Qwen2.5-Omni thinker's towers: the audio and vision attention, the audio encoder
forward and the audio tower's injected ``dummy_forward``.

patchgen copies these functions' source into the generated modeling file; `veomni.models.qwen2_5_omni.patch_config`
registers them. Every name they use must therefore also exist in the generated module: upstream names come from
``modeling_qwen2_5_omni`` and veomni helpers from the config's ``add_import`` lines. The imports below only make
this module importable and checkable on its own.
"""

from __future__ import annotations

import torch
from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as _upstream
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    BaseModelOutputWithPooling,
    TransformersKwargs,
    Unpack,
    apply_rotary_pos_emb_vision,
    chunk_and_pad_features,
    get_audio_cu_seqlens,
    get_max_seqlen,
    get_pool_indices,
    get_valid_indices,
    nn,
)

from veomni.models.hf.attention import PREFIX
from veomni.models.hf.encoder_attention import encoder_attention, needs_max_seqlen
from veomni.models.qwen2_5_omni.towers import dummy_audio_inputs
from veomni.models.qwen3_vl.sp import gather_merged, slice_patches, sp_group_or_none, sp_world_size


def audio_attention_forward(
    self,
    hidden_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None = None,
    sp_group=None,
    **kwargs,
) -> torch.Tensor:
    # Under SP (sp_group from the tower's forward) every implementation goes through the encoder entry: only it
    # runs the Ulysses exchange over this rank's slice of the frames.
    if sp_group is None and not (self.config._attn_implementation or "").startswith(PREFIX):
        return _upstream.Qwen2_5OmniAudioAttention.forward(
            self, hidden_states, cu_seqlens, max_seqlen, **kwargs
        )
    rows = hidden_states.shape[0]
    query, key, value = (proj(hidden_states).reshape(rows, self.num_heads, -1)
                         for proj in (self.q_proj, self.k_proj, self.v_proj))  # fmt: skip
    out = encoder_attention(
        self, query, key, value, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, scaling=self.scaling,
        dropout=0.0 if not self.training else self.attention_dropout, sp_group=sp_group,
    )  # fmt: skip
    return self.out_proj(out.reshape(rows, -1).contiguous())


def vision_attention_forward(
    self,
    hidden_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    position_embeddings: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    sp_group=None,
    **kwargs,
) -> torch.Tensor:
    # Under SP (sp_group from the tower's forward) every implementation goes through the encoder entry: only it
    # runs the Ulysses exchange over this rank's slice of the patches.
    if sp_group is None and not (self.config._attn_implementation or "").startswith(PREFIX):
        return _upstream.Qwen2_5OmniVisionAttention.forward(
            self, hidden_states, cu_seqlens, position_embeddings, max_seqlen, **kwargs
        )
    rows = hidden_states.shape[0]
    query, key, value = (
        proj(hidden_states).reshape(rows, self.num_heads, -1) for proj in (self.q, self.k, self.v)
    )
    cos, sin = position_embeddings
    query, key = apply_rotary_pos_emb_vision(query, key, cos, sin)
    out = encoder_attention(
        self, query, key, value, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, scaling=self.scaling,
        dropout=0.0 if not self.training else self.attention_dropout, sp_group=sp_group,
    )  # fmt: skip
    return self.proj(out.reshape(rows, -1).contiguous())


def audio_encoder_forward(
    self, input_features=None, feature_lens=None, aftercnn_lens=None, **kwargs: Unpack[TransformersKwargs]
):
    r"""
    input_features (`torch.Tensor` of shape `(num_mel_bins, total_frames)`):
        every clip's mel frames, concatenated (all of them on every rank, also under sequence parallelism).
    feature_lens (`torch.LongTensor` of shape `(num_clips,)`):
        mel frames per clip.
    aftercnn_lens (`torch.LongTensor` of shape `(num_clips,)`, *optional*):
        frames per clip after the convolutions (unused, as upstream).
    """
    chunk_rows = kwargs.pop("chunk_rows", None)
    if chunk_rows is not None:
        # The host's layout (`veomni.models.qwen2_5_omni.audio_layout.AudioChunks`): the padded chunks gathered
        # by index, every shape known on the host (upstream splits by chunk_lengths.tolist(): a host sync).
        chunk_lengths = kwargs.pop("chunk_lengths")
        frames = torch.cat([input_features.T, input_features.new_zeros(1, input_features.shape[0])])
        padded_feature = frames[chunk_rows].view(chunk_lengths.shape[0], -1, frames.shape[1]).transpose(1, 2)
    else:
        padded_feature, chunk_lengths = chunk_and_pad_features(
            input_features, feature_lens, self.n_window, kwargs=kwargs
        )
    valid_indices = get_valid_indices(chunk_lengths, kwargs=kwargs)
    pool_indices = get_pool_indices(feature_lens, kwargs=kwargs)
    cu_seqlens = get_audio_cu_seqlens(chunk_lengths, kwargs=kwargs)
    max_seqlen = get_max_seqlen(cu_seqlens, self.config, kwargs=kwargs)
    implementation = self.config._attn_implementation or ""
    if max_seqlen is None and implementation.startswith(PREFIX) and needs_max_seqlen(implementation):
        # Read once per forward, not once per layer (each read is a host sync).
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())

    padded_feature = padded_feature.to(self.conv1.weight.dtype)
    frame_mask = torch.arange(padded_feature.shape[2], device=padded_feature.device) < chunk_lengths[:, None]
    embed = nn.functional.gelu(self.conv1(padded_feature)) * frame_mask[:, None].long()
    embed = nn.functional.gelu(self.conv2(embed)).transpose(1, 2)
    embed = embed + self.positional_embedding.positional_embedding[: embed.shape[1]][None].to(embed.dtype)
    hidden_states = torch.index_select(embed.reshape(-1, embed.shape[-1]), 0, valid_indices)

    total = hidden_states.shape[0]
    sp_group = sp_group_or_none()
    if sp_group is not None:
        # The conv front-end ran on every frame (cheap, and its chunks overlap no slice boundary); the encoder
        # layers, where the time goes, run on this rank's slice. The padding attends as a segment of its own.
        hidden_states = slice_patches(hidden_states, 1, sp_group)
        padded = hidden_states.shape[0] * sp_world_size(sp_group)
        if padded > total:
            cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_full((1,), padded)])
            if max_seqlen is not None:
                max_seqlen = max(max_seqlen, padded - total)
        kwargs = {**kwargs, "sp_group": sp_group}

    for encoder_layer in self.layers:
        hidden_states = encoder_layer(hidden_states, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, **kwargs)[
            0
        ]

    if sp_group is not None:
        # Stride-2 pooling pairs frames that may sit on two ranks: gather once, pool and project everywhere.
        hidden_states = gather_merged(hidden_states, total, sp_group)
    hidden_states = (hidden_states[pool_indices] + hidden_states[pool_indices + 1]) / 2
    hidden_states = self.proj(self.ln_post(hidden_states))
    return BaseModelOutputWithPooling(last_hidden_state=hidden_states, pooler_output=hidden_states)


def audio_dummy_forward(self) -> torch.Tensor:
    """Run the tower on its smallest valid input and return a 0-d zero that depends on every output row, so
    adding it to the loss graph gives every tower parameter a (zero) gradient. dtype/device from ``conv1``."""
    features, lens = dummy_audio_inputs(self.num_mel_bins, self.conv1.weight)
    out = self(features, feature_lens=lens, return_dict=True)
    return out.last_hidden_state.sum() * 0.0
