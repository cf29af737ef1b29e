"""HF's mask builders, minus the host sync, for models running veomni attention.

transformers' ``create_causal_mask`` / ``create_sliding_window_causal_mask`` look for packed sequences in
``position_ids`` whenever no padding mask is given (``find_packed_sequence_indices`` ends in ``.all()`` on a
device tensor: one host sync per forward). With a ``veomni_*`` implementation the mask they build is thrown away:
the registered mask function (`veomni.models.hf.attention.padding_mask_passthrough`) returns only the 2-D
padding mask, and the kernels read causality, windows and packing from the module and the packing kwargs. So
the patched modeling files import these two functions instead (patchgen: `use_veomni_masks`); for any other
implementation, a KV cache, a prepared 4-D mask, a left- or gap-padded mask or ``output_attentions`` they call HF's
unchanged (the last two then get transformers' attention: `veomni.models.hf.attention_fallback`).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import masking_utils
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from veomni.models.hf.attention import padding_mask_passthrough
from veomni.models.hf.attention_fallback import needs_hf_attention

__all__ = ["create_causal_mask", "create_sliding_window_causal_mask", "use_veomni_masks"]


def _veomni_padding_mask(
    config: Any, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None, past_key_values: Any
) -> tuple[bool, torch.Tensor | None]:
    """``(handled, mask)``: handled when the attention is veomni's and no cache or 4-D mask needs HF's rules."""
    implementation = getattr(config, "_attn_implementation", None)
    if ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(implementation) is not padding_mask_passthrough:
        return False, None
    if past_key_values is not None or (attention_mask is not None and attention_mask.dim() != 2):
        return False, None
    # Left / gapped padding, output_attentions: HF's mask, then HF's attention.
    if needs_hf_attention(attention_mask):
        return False, None
    if attention_mask is None:
        return True, None
    # What HF's preprocessing hands the mask function (bool, on the activations' device), which returns it whole.
    return True, attention_mask.to(device=inputs_embeds.device, dtype=torch.bool)


def create_causal_mask(
    config: Any,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    past_key_values: Any = None,
    position_ids: torch.Tensor | None = None,
    **kwargs: Any,
) -> Any:
    """HF's ``create_causal_mask``; for veomni attention without a cache, the ``[B, S]`` bool padding mask or None.

    Args:
        inputs_embeds: ``[B, S, D]`` (read for its device only on the fast path).
        attention_mask: None, a ``[B, S]`` padding mask (any dtype) or a prepared 4-D mask (HF's rules).
    """
    handled, mask = _veomni_padding_mask(config, inputs_embeds, attention_mask, past_key_values)
    if handled:
        return mask
    return masking_utils.create_causal_mask(
        config, inputs_embeds, attention_mask, past_key_values, position_ids, **kwargs
    )


def create_sliding_window_causal_mask(
    config: Any,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    past_key_values: Any = None,
    position_ids: torch.Tensor | None = None,
    **kwargs: Any,
) -> Any:
    """HF's ``create_sliding_window_causal_mask``; the fast path as `create_causal_mask` (the window is the kernel's
    business: it reads ``module.sliding_window``)."""
    handled, mask = _veomni_padding_mask(config, inputs_embeds, attention_mask, past_key_values)
    if handled:
        return mask
    return masking_utils.create_sliding_window_causal_mask(
        config, inputs_embeds, attention_mask, past_key_values, position_ids, **kwargs
    )


def use_veomni_masks(patch_config: Any, *names: str) -> None:
    """Make a patchgen config's generated module build its masks with these functions instead of HF's.

    Args:
        patch_config: a ``patchgen.config.PatchConfig``.
        names: the mask builders the upstream module imports (``"create_causal_mask"``, and
            ``"create_sliding_window_causal_mask"`` where it uses one).
    """
    unknown = sorted(set(names) - set(__all__[:2]))
    if unknown or not names:
        raise ValueError(f"use_veomni_masks: expected names among {__all__[:2]}, got {list(names)}")
    patch_config.drop_import_names(*names)
    patch_config.add_import(f"from veomni.models.hf.masks import {', '.join(names)}")
