"""Async Ulysses inside HF attention modules (``parallel.async_ulysses``): the projections overlap the exchange.

HF's attention function receives Q, K and V already projected, too late to overlap anything. So an adapter's
patched attention ``forward`` (Qwen3's, see its patch config) asks `async_ulysses_active` and, when true, hands
this module a generator that projects V, then Q and K (norms, RoPE on local positions) and yields each as
soon as it exists (`veomni.core.sp.async_ulysses_attention` starts its all-to-all at once). Everything else is
what the synchronous path does (`veomni.models.hf.attention.veomni_attention_forward`): the same kernel, packing,
features and checks. A family declares which of its attention classes have the branch
(`veomni.models.family.ModelTypeSpec.async_ulysses`), or why it has none (``no_async_ulysses``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from veomni.core.sp import async_ulysses_attention
from veomni.models.families import async_ulysses_classes
from veomni.models.hf.attention import PREFIX
from veomni.models.hf.attention_inputs import (
    attention_features,
    check_padding_mask,
    current_sp_state,
    run_kernel,
    sp_kernel_kwargs,
)

__all__ = ["async_sp_attention", "async_ulysses_active", "check_async_ulysses", "enable_async_ulysses"]

ATTR = "veomni_async_ulysses"


def check_async_ulysses(model_type: str) -> tuple[type, ...]:
    """The attention classes of ``model_type`` with the async path, as its family declares them
    (`veomni.models.family.ModelTypeSpec.async_ulysses`); callable before the model is built.

    Raises:
        ValueError: ``model_type`` has no async path; the message gives its family's reason.
    """
    try:
        return async_ulysses_classes(model_type)
    except ValueError as err:
        raise ValueError(f"parallel.async_ulysses: {err}; set parallel.async_ulysses=false") from None


def enable_async_ulysses(model: nn.Module, model_type: str) -> int:
    """Turn the async path on for every attention module of ``model`` that has it (`check_async_ulysses` of
    ``model_type`` says which classes); returns how many.

    Raises:
        ValueError: ``model_type`` has no async path (the message gives its family's reason), or ``model`` holds
            none of the declared classes.
    """
    classes = check_async_ulysses(model_type)
    count = 0
    for module in model.modules():
        if isinstance(module, classes):
            object.__setattr__(module, ATTR, True)
            count += 1
    if not count:
        names = sorted(f"{c.__module__}.{c.__qualname__}" for c in classes)
        raise ValueError(
            f"parallel.async_ulysses: {type(model).__name__} (model_type {model_type!r}) holds none of the attention "
            f"classes its family declares with the async path ({names}); set parallel.async_ulysses=false"
        )
    return count


def async_ulysses_active(module: nn.Module, past_key_values: Any = None) -> bool:
    """Whether ``module``'s forward should take the async path: enabled, SP on, training-style (no cache)."""
    return bool(getattr(module, ATTR, False)) and past_key_values is None and current_sp_state() is not None


def async_sp_attention(
    module: nn.Module,
    hidden_states: torch.Tensor,
    project: Callable[[torch.Tensor], Iterator[tuple[str, torch.Tensor]]],
    attention_mask: torch.Tensor | None,
    *,
    query_heads: int,
    scaling: float | None,
    **kwargs: Any,
) -> torch.Tensor:
    """Ulysses attention for one HF module, projections overlapped with the exchanges.

    Args:
        hidden_states: ``[B, S/P, hidden]`` this rank's shard.
        project: generator ``hidden -> ("q"|"k"|"v", [B, S/P, H, D])`` (see `async_ulysses_attention`).
        attention_mask, scaling, kwargs: what the module would pass to its attention function.
    Returns:
        ``[B, S/P, Hq, Dv]`` in the projections' dtype.
    """
    implementation = module.config._attn_implementation
    function = ALL_ATTENTION_FUNCTIONS.get(implementation) if implementation.startswith(PREFIX) else None
    if function is None or not hasattr(function, "resolve_kernel"):
        raise ValueError(
            f"parallel.async_ulysses runs veomni attention kernels; this model uses {implementation!r}"
        )
    if kwargs.get("dropout"):
        raise ValueError(f"{implementation} has no attention dropout (got dropout={kwargs['dropout']})")
    causal = bool(
        getattr(module, "is_causal", True) if kwargs.get("is_causal") is None else kwargs["is_causal"]
    )
    if attention_mask is not None:
        check_padding_mask(attention_mask, causal, implementation)
    state = current_sp_state()
    assert state is not None, "async_sp_attention runs only under SP (check async_ulysses_active first)"
    batch, local_len = hidden_states.shape[:2]
    sp = sp_kernel_kwargs(
        state, kwargs, attention_features(kwargs), batch=batch, local_len=local_len, query_heads=query_heads
    )
    return async_ulysses_attention(
        hidden_states, project, run_kernel, state.sp_group, seq_dim=1, head_dim=2, query_heads=query_heads,
        unpadded_len=sp.pop("unpadded_len"), kernel=function.resolve_kernel(), causal=causal, scale=scaling,
        **sp,
    )  # fmt: skip
