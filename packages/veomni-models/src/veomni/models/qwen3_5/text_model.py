"""The body of Qwen3.5's (and Qwen3.5-MoE's) text-model forward, shared by the two generated modeling files, which
differ only in the output class they return.

It is upstream's forward with one addition (`veomni.models.qwen3_next.gdn.prepare_training_forward`): rows packed by
their text positions alone (HF's ``DataCollatorWithFlattening``) get ``cu_seq_lens_q/k`` derived once per forward, and
a packed or SP forward builds no default cache. HF hands ``position_ids`` to the attention layers only, and with a
cache the Gated DeltaNet layers run upstream's generation code: either way they would run their convolution and
recurrent state across documents.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache

from veomni.models.qwen3_next.decoder import run_decoder_layers
from veomni.models.qwen3_next.gdn import prepare_training_forward

__all__ = ["text_model_layers"]


def text_model_layers(
    model: nn.Module,
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    past_key_values: Cache | None,
    inputs_embeds: torch.Tensor | None,
    use_cache: bool | None,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, Cache | None]:
    """Embeddings, decoder layers and final norm of a ``Qwen3_5TextModel`` / ``Qwen3_5MoeTextModel``.

    Args:
        model: the text model (``embed_tokens``, ``layers``, ``norm``, ``rotary_emb``, ``config``).
        position_ids: None, ``[B, S]`` (all four rope rows), ``[4, B, S]`` (text row, then temporal, height,
            width) or ``[3, B, S]`` (mrope rows only: no text positions, so no packing is read from them).
        kwargs: the forward's remaining kwargs, passed to every decoder layer.
    Returns:
        ``(last hidden state [B, S, D], the cache or None)``.
    """
    if (input_ids is None) ^ (inputs_embeds is not None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    if inputs_embeds is None:
        inputs_embeds = model.embed_tokens(input_ids)
    given = position_ids is not None  # positions made up below (0..S-1 per row) describe no packing
    if position_ids is None:
        past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
        position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
        position_ids = position_ids.view(1, 1, -1).expand(4, inputs_embeds.shape[0], -1)
    elif position_ids.ndim == 2:
        position_ids = position_ids[None, ...].expand(4, position_ids.shape[0], -1)
    if position_ids.ndim == 3 and position_ids.shape[0] == 4:
        text_position_ids, position_ids = position_ids[0], position_ids[1:]
    else:
        text_position_ids = None
    # The packing the attention layers read from the text positions, for the Gated DeltaNet layers too. The default
    # cache comes after it (only for an unpacked forward); a fresh one is empty, so the positions above start at 0.
    kwargs, use_cache = prepare_training_forward(
        model, text_position_ids if given else None, inputs_embeds, past_key_values, use_cache, kwargs
    )
    if use_cache and past_key_values is None:
        past_key_values = DynamicCache(config=model.config)

    hidden_states = run_decoder_layers(
        model,
        inputs_embeds,
        attention_mask,
        past_key_values,
        position_ids,
        text_position_ids,
        use_cache,
        kwargs,
    )
    return model.norm(hidden_states), past_key_values
