"""The decoder stack of a hybrid (Gated DeltaNet + attention) text model's forward, shared by Qwen3-Next and
Qwen3.5 / Qwen3.5-MoE: the per-layer-type masks and the layer loop, as upstream runs them, with the Gated DeltaNet
padding mask built by `veomni.models.qwen3_next.gdn.recurrent_padding_mask` (a rank's shard under Ulysses SP).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache

from veomni.models.hf.masks import create_causal_mask
from veomni.models.qwen3_next.gdn import recurrent_padding_mask

__all__ = ["run_decoder_layers"]


def run_decoder_layers(
    model: nn.Module,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | dict | None,
    past_key_values: Cache | None,
    rope_positions: torch.Tensor,
    text_positions: torch.Tensor | None,
    use_cache: bool | None,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """Every decoder layer of ``model`` (``layers``, ``rotary_emb``, ``config.layer_types``) over ``inputs_embeds``
    ``[B, S, D]``; returns the hidden states before the final norm, ``[B, S, D]``.

    Args:
        attention_mask: the caller's 2-D mask (or None), or a ready ``{layer type: mask}`` mapping.
        rope_positions: what ``rotary_emb`` takes (``[B, S]``; Qwen3.5's mrope rows ``[3, B, S]``).
        text_positions: the positions the masks and the layers see (``[B, S]``; None where there are none).
        kwargs: the forward's remaining kwargs (packing offsets included), passed to every layer.
    """
    masks = attention_mask
    if not isinstance(masks, dict):
        mask_kwargs = {
            "config": model.config,
            "inputs_embeds": inputs_embeds,
            "attention_mask": attention_mask,
            "past_key_values": past_key_values,
            "position_ids": text_positions,
        }
        masks = {
            "full_attention": create_causal_mask(**mask_kwargs),
            # HF's, but under SP the 2-D mask must be this rank's shard (HF would trim a full one to the last shard).
            "linear_attention": recurrent_padding_mask(**mask_kwargs),
        }
    hidden_states = inputs_embeds
    position_embeddings = model.rotary_emb(hidden_states, rope_positions)
    for i, decoder_layer in enumerate(model.layers[: model.config.num_hidden_layers]):
        hidden_states = decoder_layer(
            hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=masks[model.config.layer_types[i]],
            position_ids=text_positions,
            past_key_values=past_key_values,
            use_cache=use_cache,
            **kwargs,
        )
    return hidden_states
