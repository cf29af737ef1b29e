"""The calls veomni's attention kernels do not take, handed to transformers' own attention for that one call.

veomni's ``veomni_*`` implementations run causal or packed attention with, at most, a right-padding mask: the
training shape. Evaluation and generation bring more: left or gapped padding (batched generation pads on the
left), a static cache (every preallocated slot handed over, the unwritten ones too), pre-built 4-D masks and
``output_attentions=True``. Rather than refuse them, a model built by ``build_model`` runs those calls through
transformers' ``sdpa`` (``eager`` for ``output_attentions``, sinks or a soft-cap, which transformers' sdpa does not
implement: the model's own ``eager_attention_forward``), exactly as upstream would:

* the mask builder (`veomni.models.hf.attention.padding_mask_passthrough`, and the host-sync-free builders of
  `veomni.models.hf.masks`) builds transformers' 4-D ``sdpa`` mask instead of passing the 2-D padding mask on
  when `needs_hf_attention` (or the cache is static, `hf_mask`);
* the attention function, given a 4-D mask or asked for weights, calls `hf_attention` instead of a kernel.

The training shape (no mask or a right-padded one, a dynamic cache or none, no weights) is unchanged; a 2-D mask
now costs one host sync per mask built (reading whether it is right-padded), as transformers' own sdpa mask does.
Under Ulysses SP each rank holds a sequence shard, which transformers' attention cannot see whole: nothing is
routed there, and the refusals of the kernel path stand.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    bidirectional_mask_function,
    causal_mask_function,
    sdpa_mask,
    sliding_window_causal_mask_function,
)

from veomni.models.hf.attention_inputs import current_sp_state
from veomni.models.hf.output_capture import attention_weights_requested

__all__ = ["hf_attention", "hf_mask", "is_right_padded", "needs_hf_attention"]


def is_right_padded(mask: torch.Tensor) -> bool:
    """Whether every row of the 2-D padding ``mask`` ``[B, S]`` is real tokens then padding (one host sync)."""
    mask = mask.bool()
    return not bool((mask[:, 1:] & ~mask[:, :-1]).any())


def needs_hf_attention(attention_mask: torch.Tensor | None) -> bool:
    """Whether this forward's attention must run transformers' implementation (outside Ulysses SP only):
    ``output_attentions`` was asked for, or the 2-D padding mask is not right-padding (left or gapped)."""
    if current_sp_state() is not None:
        return False
    if attention_weights_requested():
        return True
    return attention_mask is not None and attention_mask.dim() == 2 and not is_right_padded(attention_mask)


def hf_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor,
    kv_offset: int | torch.Tensor,
    mask_function: Callable | None,
    attention_mask: torch.Tensor | None,
    device: torch.device | str,
    use_vmap: bool = False,
) -> torch.Tensor:
    """transformers' 4-D bool ``sdpa`` mask ``[B, 1, q_length, kv_length]``, always materialised (never None), so
    the attention function sees that this forward is routed to transformers' attention."""
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=causal_mask_function if mask_function is None else mask_function,
        attention_mask=attention_mask,
        allow_is_causal_skip=False,
        use_vmap=use_vmap,
        device=device,
    )


def _dense_mask(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    causal: bool,
    window: int | None,
) -> torch.Tensor:
    # A 4-D mask for a call that reached the attention function without one (a mask builder other than HF's):
    # the queries are the last positions of the keys, as in the kernel path's decoding.
    q_len, kv_len = query.shape[2], key.shape[2]
    if not causal:
        function = bidirectional_mask_function
    elif window is not None:
        function = sliding_window_causal_mask_function(window)
    else:
        function = causal_mask_function
    if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.shape[-1] != kv_len):
        raise ValueError(
            f"attention needs a [B, {kv_len}] padding mask or a 4-D mask, got {tuple(attention_mask.shape)}"
        )
    return hf_mask(
        query.shape[0], q_len, kv_len, kv_len - q_len, 0, function,
        None if attention_mask is None else attention_mask.bool(), query.device,
    )  # fmt: skip


def _eager_function(module: nn.Module, name: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    # The modeling module's own eager attention (what upstream's attention forward falls back to): it knows the
    # module's quirks (gpt-oss's sinks, soft-capping).
    modeling = sys.modules.get(type(module).__module__)
    eager = getattr(modeling, "eager_attention_forward", None)
    if eager is None:
        raise NotImplementedError(
            f"{name}: this call needs eager attention (attention weights, sinks or a soft-cap), but "
            f"{type(module).__module__} defines no eager_attention_forward for {type(module).__name__}; "
            "use model.set_attn_implementation('eager')"
        )
    return eager


def hf_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float | None,
    dropout: float,
    name: str,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention for one call: its ``sdpa``, or the module's ``eager`` one when weights are asked
    for or the call carries sinks (``s_aux``) or a soft-cap.

    Args:
        query: ``[B, Hq, S_q, D]``; key, value: ``[B, Hkv, S_kv, D]`` (HF layout, whole sequences).
        attention_mask: a 4-D mask (bool, or additive float), or None / a 2-D padding mask, from which the
            causal (or sliding-window, or bidirectional, from ``module.is_causal``) 4-D mask is built with the
            queries as the last key positions.
        name: the veomni implementation name, for errors.
        kwargs: HF's attention kwargs, passed on.
    Returns:
        ``(out [B, S_q, Hq, Dv], weights [B, Hq, S_q, S_kv] or None)`` as transformers' functions return them.
    Raises:
        NotImplementedError: under Ulysses SP (the call holds a sequence shard).
    """
    state = current_sp_state()
    if state is not None:
        raise NotImplementedError(
            f"{name} under Ulysses SP (sp={state.dims.sp}) takes no 4-D masks, left or gapped padding, static "
            "caches or output_attentions: each rank holds a shard of the sequence, which transformers' attention "
            "cannot see whole. Pack the sequences (position_ids / cu_seq_lens_q) or pad on the right"
        )
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    if attention_mask is None or attention_mask.dim() != 4:
        attention_mask = _dense_mask(query, key, attention_mask, causal, kwargs.get("sliding_window"))
    if attention_weights_requested() or kwargs.get("s_aux") is not None or kwargs.get("softcap") is not None:
        if attention_mask.dtype == torch.bool:
            # transformers' eager mask: 0 where attended, the dtype's minimum elsewhere (added to the scores).
            zero = torch.zeros((), device=attention_mask.device, dtype=query.dtype)
            attention_mask = torch.where(attention_mask, zero, torch.finfo(query.dtype).min)
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        return _eager_function(module, name)(
            module, query, key, value, attention_mask, scaling=scale, dropout=dropout, **kwargs
        )
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )
