"""Replacement bodies for the Qwen3-Omni-MoE thinker's audio tower: the audio attention, the encoder forward (SP
over the post-conv frames) and the injected ``dummy_forward``.

patchgen copies these functions' source into the generated modeling file; `veomni.models.qwen3_omni_moe.patch_config`
registers them. Every name they use must therefore also exist in the generated module: upstream names come from
``modeling_qwen3_omni_moe`` and veomni helpers from the config's ``add_import`` lines. The imports below only make
this module importable and checkable on its own.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as _upstream
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    BaseModelOutputWithPooling,
    TransformersKwargs,
    Unpack,
    chunk_and_pad_features,
    get_audio_cu_seqlens,
    get_max_seqlen,
    get_valid_indices,
)

from veomni.models.hf.attention import PREFIX
from veomni.models.hf.encoder_attention import encoder_attention, needs_max_seqlen
from veomni.models.qwen2_5_omni.towers import dummy_audio_inputs
from veomni.models.qwen3_omni_moe.towers import check_audio_window
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
        return _upstream.Qwen3OmniMoeAudioAttention.forward(
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


def audio_encoder_forward(self, input_features=None, feature_lens=None, **kwargs: Unpack[TransformersKwargs]):
    r"""
    input_features (`torch.Tensor` of shape `(num_mel_bins, total_frames)`):
        every clip's mel frames, concatenated (all of them on every rank, also under sequence parallelism).
    feature_lens (`torch.LongTensor` of shape `(num_clips,)`):
        mel frames per clip.
    """
    check_audio_window(self.n_window)
    padded_feature, chunk_lengths = chunk_and_pad_features(
        input_features, feature_lens, self.n_window, kwargs=kwargs
    )
    valid_indices = get_valid_indices(chunk_lengths, self.n_window, kwargs=kwargs)
    cu_seqlens = get_audio_cu_seqlens(
        chunk_lengths, feature_lens, self.n_window_infer, self.n_window, kwargs=kwargs
    )
    max_seqlen = get_max_seqlen(cu_seqlens, self.config, kwargs=kwargs)
    implementation = self.config._attn_implementation or ""
    if max_seqlen is None and implementation.startswith(PREFIX) and needs_max_seqlen(implementation):
        # Read once per forward, not once per layer (each read is a host sync).
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())

    padded_feature = padded_feature.unsqueeze(1).to(dtype=self.conv2d1.weight.dtype)
    # Chunks of conv_chunksize bound the convolutions' activation memory, as upstream.
    padded_embeds = []
    for chunk in padded_feature.split(self.conv_chunksize, dim=0):
        padded_embed = F.gelu(self.conv2d1(chunk))
        padded_embed = F.gelu(self.conv2d2(padded_embed))
        padded_embeds.append(F.gelu(self.conv2d3(padded_embed)))
    padded_embed = torch.cat(padded_embeds, dim=0)
    b, c, f, t = padded_embed.size()
    padded_embed = self.conv_out(padded_embed.permute(0, 3, 1, 2).contiguous().view(b, t, c * f))
    positions = self.positional_embedding.positional_embedding[: padded_embed.shape[1], :]
    padded_embed = padded_embed + positions.unsqueeze(0).to(padded_embed.dtype)
    hidden_states = torch.index_select(padded_embed.reshape(-1, padded_embed.shape[-1]), 0, valid_indices)

    total = hidden_states.shape[0]
    sp_group = sp_group_or_none()
    layer_kwargs = {}
    if sp_group is not None:
        # The conv front-end ran on every chunk (cheap); the encoder layers, where the time goes, run on this
        # rank's slice. The padding attends as a segment of its own.
        hidden_states = slice_patches(hidden_states, 1, sp_group)
        padded = hidden_states.shape[0] * sp_world_size(sp_group)
        if padded > total:
            cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_full((1,), padded)])
            if max_seqlen is not None:
                max_seqlen = max(max_seqlen, padded - total)
        layer_kwargs["sp_group"] = sp_group

    # Upstream passes no outer kwargs to the layers (the language model's packing kwargs must not reach them).
    for encoder_layer in self.layers:
        hidden_states = encoder_layer(hidden_states, cu_seqlens, max_seqlen=max_seqlen, **layer_kwargs)[0]

    if sp_group is not None:
        hidden_states = gather_merged(hidden_states, total, sp_group)
    hidden_states = self.ln_post(hidden_states)
    hidden_states = self.proj2(self.act(self.proj1(hidden_states)))
    return BaseModelOutputWithPooling(last_hidden_state=hidden_states, pooler_output=hidden_states)


def audio_dummy_forward(self) -> torch.Tensor:
    """Run the tower on its smallest valid input and return a 0-d zero that depends on every output row, so
    adding it to the loss graph gives every tower parameter a (zero) gradient. dtype/device from ``conv2d1``."""
    features, lens = dummy_audio_inputs(self.num_mel_bins, self.conv2d1.weight)
    out = self(features, feature_lens=lens, return_dict=True)
    return out.last_hidden_state.sum() * 0.0
