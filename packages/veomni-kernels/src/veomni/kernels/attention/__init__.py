"""Attention functions on ``[B, S, H, D]`` tensors with one calling convention (see ``functions.py``).

``ATTENTION_FUNCTIONS`` maps each name to its function; `available_attention_functions` says which can run
here. Importing this package imports no optional backend (flash-attn is imported on first call).
`encoder_varlen_attention` is the packed ``[T, H, D]`` entry for bidirectional encoder towers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from veomni.kernels.attention.encoder import encoder_varlen_attention
from veomni.kernels.attention.external import (
    available_attention_functions,
    flash_attn_2,
    flash_attn_3,
    flash_attn_4,
    varlen_attention,
)
from veomni.kernels.attention.functions import eager_attention, flex_attention, sdpa_attention

AttentionFunction = Callable[..., torch.Tensor]

ATTENTION_FUNCTIONS: dict[str, AttentionFunction] = {
    "eager": eager_attention,
    "sdpa": sdpa_attention,
    "flex": flex_attention,
    "varlen": varlen_attention,
    "flash_attn_2": flash_attn_2,
    "flash_attn_3": flash_attn_3,
    "flash_attn_4": flash_attn_4,
}

__all__ = [
    "ATTENTION_FUNCTIONS",
    "AttentionFunction",
    "available_attention_functions",
    "eager_attention",
    "encoder_varlen_attention",
    "flash_attn_2",
    "flash_attn_3",
    "flash_attn_4",
    "flex_attention",
    "sdpa_attention",
    "varlen_attention",
]
