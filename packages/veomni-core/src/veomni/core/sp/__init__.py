"""Ulysses sequence parallelism: padding/slicing, all-to-all and gather collectives, the attention wrapper."""

from veomni.core.sp.async_ulysses import async_ulysses_attention
from veomni.core.sp.attention import kv_repeats_for_sp, sp_cross_attention, ulysses_attention
from veomni.core.sp.comm import (
    all_reduce_sum,
    all_to_all,
    gather_sequence,
    heads_to_seq,
    qkv_seq_to_heads,
    seq_to_heads,
)
from veomni.core.sp.padding import (
    pad_and_slice,
    pad_to_length,
    pad_to_multiple,
    padded_length,
    slice_for_rank,
    slice_sequence,
    unpad,
)

__all__ = [
    "all_reduce_sum",
    "async_ulysses_attention",
    "all_to_all",
    "gather_sequence",
    "heads_to_seq",
    "kv_repeats_for_sp",
    "pad_and_slice",
    "pad_to_length",
    "pad_to_multiple",
    "padded_length",
    "qkv_seq_to_heads",
    "seq_to_heads",
    "slice_for_rank",
    "slice_sequence",
    "sp_cross_attention",
    "ulysses_attention",
    "unpad",
]
