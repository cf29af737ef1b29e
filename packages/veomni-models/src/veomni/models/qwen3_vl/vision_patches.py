"""Replacement bodies for Qwen3-VL's vision tower: attention, tower forward and the injected ``dummy_forward``.

patchgen copies these functions' source into the generated modeling file; `veomni.models.qwen3_vl.patch_config`
registers them (``override_method``), and the Qwen2-VL, Qwen2.5-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3-Omni-MoE configs
reuse them from there. Every name they use must therefore also exist in the generated module: upstream names come
from ``modeling_qwen3_vl`` and veomni helpers from the config's ``add_import`` lines. The imports below only make
this module importable and checkable on its own.

* Vision attention: with a ``veomni_*`` implementation (or under Ulysses SP) it calls
  `veomni.models.hf.encoder_attention.encoder_attention` on the packed tokens and the tower's own ``cu_seqlens``
  (no per-image split); with HF's own names upstream's code runs unchanged.
* Tower forward: rotary positions and learned-position taps without ``.tolist()`` (`vision.vision_geometry`);
  ``max_seqlen`` read once per forward and only for backends that need it; under SP each rank embeds and attends
  its patch slice and the merged and deepstack features are gathered once.
* ``dummy_forward``: the tower on one all-zero merged token for ranks whose micro-batch has no image or video.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.models.qwen3_vl.modeling_qwen3_vl import (
    ALL_ATTENTION_FUNCTIONS,
    BaseModelOutputWithDeepstackFeatures,
    TransformersKwargs,
    Unpack,
    apply_rotary_pos_emb_vision,
    eager_attention_forward,
    get_max_seqlen,
    get_vision_attention_seqlens,
    is_flash_attention_requested,
)

from veomni.models.hf.attention import PREFIX
from veomni.models.hf.encoder_attention import encoder_attention, needs_max_seqlen
from veomni.models.hf.kernel_hooks import apply_rope_vision
from veomni.models.qwen3_vl.sp import gather_merged, slice_patches, sp_group_or_none, sp_world_size
from veomni.models.qwen3_vl.vision import dummy_vision_inputs, vision_geometry


def vision_attention_forward(
    self,
    hidden_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_seqlen: int | None = None,
    sp_group=None,
    sp_unpadded_len: int | None = None,
    **kwargs,
) -> torch.Tensor:
    seq_length = hidden_states.shape[0]
    query_states, key_states, value_states = (
        self.qkv(hidden_states).reshape(seq_length, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    )
    cos, sin = position_embeddings
    query_states, key_states = apply_rope_vision(
        self, query_states, key_states, cos, sin, apply_rotary_pos_emb_vision
    )

    # Under SP (sp_group from the tower's forward) every implementation name goes through the encoder entry:
    # only it runs the Ulysses exchange over this rank's slice of the packed tokens.
    if sp_group is not None or (self.config._attn_implementation or "").startswith(PREFIX):
        attn_output = encoder_attention(
            self,
            query_states,
            key_states,
            value_states,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            scaling=self.scaling,
            dropout=0.0 if not self.training else self.attention_dropout,
            sp_group=sp_group,
            sp_unpadded_len=sp_unpadded_len,
        )
        return self.proj(attn_output.reshape(seq_length, -1).contiguous())

    query_states = query_states.transpose(0, 1).unsqueeze(0)
    key_states = key_states.transpose(0, 1).unsqueeze(0)
    value_states = value_states.transpose(0, 1).unsqueeze(0)

    attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, eager_attention_forward
    )

    if is_flash_attention_requested(self.config):
        max_seqlen = get_max_seqlen(cu_seqlens, self.config, kwargs={"max_seqlen": max_seqlen})
        attn_output, _ = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask=None,
            scaling=self.scaling,
            dropout=0.0 if not self.training else self.attention_dropout,
            cu_seq_lens_q=cu_seqlens,
            cu_seq_lens_k=cu_seqlens,
            max_length_q=max_seqlen,
            max_length_k=max_seqlen,
            is_causal=False,
            **kwargs,
        )
    else:
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        splits = [
            torch.split(tensor, lengths.tolist(), dim=2)
            for tensor in (query_states, key_states, value_states)
        ]
        attn_outputs = [
            attention_interface(
                self,
                q,
                k,
                v,
                attention_mask=None,
                scaling=self.scaling,
                dropout=0.0 if not self.training else self.attention_dropout,
                is_causal=False,
                **kwargs,
            )[0]
            for q, k, v in zip(*splits, strict=True)
        ]
        attn_output = torch.cat(attn_outputs, dim=1)

    attn_output = attn_output.reshape(seq_length, -1).contiguous()
    attn_output = self.proj(attn_output)
    return attn_output


def vision_forward(
    self, hidden_states: torch.Tensor, grid_thw: torch.Tensor, **kwargs: Unpack[TransformersKwargs]
) -> tuple | BaseModelOutputWithDeepstackFeatures:
    """
    Args:
        hidden_states (`torch.Tensor` of shape `(seq_len, C * T_patch * P * P)`): the packed pixel rows (all of
            them on every rank, also under sequence parallelism).
        grid_thw (`torch.Tensor` of shape `(num_images_or_videos, 3)`): (t, h, w) patches per image/clip.

    Under Ulysses SP ``pooler_output`` and ``deepstack_features`` are the full features (gathered, identical on
    every rank) and ``last_hidden_state`` is this rank's zero-padded slice of the patch rows.
    """
    total = hidden_states.shape[0]
    position_ids, interp_indices, interp_weights = vision_geometry(
        grid_thw, self.spatial_merge_size, self.num_grid_per_side, total
    )
    cu_seqlens, max_seqlen = get_vision_attention_seqlens(grid_thw, self.config, kwargs=kwargs)
    implementation = self.config._attn_implementation or ""
    needs_max = implementation.startswith(PREFIX) and needs_max_seqlen(implementation)
    if max_seqlen is None and needs_max:
        # One host sync per tower forward instead of one per block.
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())

    sp_group = sp_group_or_none()
    if sp_group is not None:
        # Every per-patch input is sliced by the same rule, so the slices stay aligned; the padded rows get
        # zero position-embedding weights.
        units = self.spatial_merge_size**2
        hidden_states, position_ids, interp_indices, interp_weights = (
            slice_patches(rows, units, sp_group)
            for rows in (hidden_states, position_ids, interp_indices, interp_weights)
        )
        # The padding (up to sp * merge**2 - 1 rows, more than sp_unpadded_len can cut) attends as a sequence
        # of its own: one more cu_seqlens entry, so no real patch sees it.
        padded = hidden_states.shape[0] * sp_world_size(sp_group)
        if padded > total:
            cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_full((1,), padded)])
            if max_seqlen is not None:
                max_seqlen = max(max_seqlen, padded - total)
        kwargs = {**kwargs, "sp_group": sp_group}

    hidden_states = self.patch_embed(hidden_states)
    pos_embeds = (self.pos_embed(interp_indices) * interp_weights[:, :, None]).sum(1)
    hidden_states = hidden_states + pos_embeds.to(hidden_states.dtype)
    position_embeddings = self.rotary_pos_emb(hidden_states, position_ids)

    seq_len, _ = hidden_states.size()
    hidden_states = hidden_states.reshape(seq_len, -1)

    deepstack_feature_lists = []
    # Qwen3.5's towers (the same tower without deepstack mergers) reuse this forward: they tap no layer.
    deepstack_layers = self.deepstack_visual_indexes if hasattr(self, "deepstack_merger_list") else ()
    for layer_num, blk in enumerate(self.blocks):
        hidden_states = blk(
            hidden_states,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        if layer_num in deepstack_layers:
            deepstack_feature = self.deepstack_merger_list[deepstack_layers.index(layer_num)](hidden_states)
            deepstack_feature_lists.append(deepstack_feature)

    merged_hidden_states = self.merger(hidden_states)
    if sp_group is not None:
        merged_total = total // self.spatial_merge_size**2
        merged_hidden_states = gather_merged(merged_hidden_states, merged_total, sp_group)
        deepstack_feature_lists = [gather_merged(f, merged_total, sp_group) for f in deepstack_feature_lists]

    return BaseModelOutputWithDeepstackFeatures(
        last_hidden_state=hidden_states,
        pooler_output=merged_hidden_states,
        deepstack_features=deepstack_feature_lists,
    )


def vision_dummy_forward(self) -> torch.Tensor:
    """Run the tower on the smallest valid input and return a 0-d tensor that is 0 but depends on every output
    (merger and deepstack mergers), so that adding it to the loss graph gives every tower parameter a gradient.

    Shapes come from the config, dtype and device from a live weight; nothing is cached.
    """
    pixels, grid = dummy_vision_inputs(self.config, self.patch_embed.proj.weight)
    out = self(pixels, grid_thw=grid, return_dict=True)
    total = out.pooler_output.sum()
    for feature in out.deepstack_features:
        total = total + feature.sum()
    return total * 0.0
