"""Ulysses sequence parallelism for Gated DeltaNet layers (Qwen3-Next; reusable by Qwen3.5's layout).

The delta-rule recurrence runs over the whole sequence, so SP must split heads, not the recurrence: each rank
projects its sequence shard, one all-to-all turns ``[B, S/P, channels of all heads]`` into ``[B, S, channels of
this rank's heads]`` (q, k, v of the local heads plus their beta and gate logits, packed into one message), the
short convolution runs with the conv weight rows of those channels, the recurrence runs per local head over the
whole (packed, ``cu_seqlens``) sequence, and a second all-to-all returns ``[B, S/P, all value heads]``.

Rank r owns key heads ``[r*Hk/P, (r+1)*Hk/P)`` and value heads ``[r*Hv/P, (r+1)*Hv/P)``; with grouped value heads
(Hv = g*Hk, value head j reads key head j // g) those two ranges match, so no key head is needed on two ranks.
"""

from __future__ import annotations

import attrs
import torch
import torch.distributed as dist
from torch import nn

from veomni.core.parallel_state import current_parallel_state_or_none
from veomni.core.sp import all_to_all, heads_to_seq, unpad

__all__ = ["GdnLocal", "check_gdn_sp_heads", "gdn_heads_to_sequence", "gdn_sequence_to_heads"]


@attrs.frozen
class GdnLocal:
    """This rank's slice of a Gated DeltaNet layer's inputs and per-head parameters.

    Attributes:
        mixed_qkv: ``[B, S, Hk_l*dk + Hk_l*dk + Hv_l*dv]`` pre-convolution channels of the local heads.
        b, a: ``[B, S, Hv_l]`` beta and decay logits of the local value heads.
        conv_weight: ``[C_l, W]`` the conv rows of those channels; a_log, dt_bias: ``[Hv_l]``.
        num_k_heads, num_v_heads: the local head counts ``Hk_l``, ``Hv_l``.
    """

    mixed_qkv: torch.Tensor
    b: torch.Tensor
    a: torch.Tensor
    conv_weight: torch.Tensor
    a_log: torch.Tensor
    dt_bias: torch.Tensor
    num_k_heads: int
    num_v_heads: int


def _sp_group() -> dist.ProcessGroup | None:
    state = current_parallel_state_or_none()
    return None if state is None or state.dims.sp == 1 else state.sp_group


def check_gdn_sp_heads(num_k_heads: int, num_v_heads: int, sp_size: int) -> None:
    """Raise ``ValueError`` unless both head counts split evenly over ``sp_size`` ranks."""
    if num_k_heads % sp_size or num_v_heads % sp_size:
        raise ValueError(
            f"Ulysses SP of a Gated DeltaNet layer splits heads: linear_num_key_heads ({num_k_heads}) and "
            f"linear_num_value_heads ({num_v_heads}) must both be divisible by the SP size {sp_size}"
        )


def gdn_sequence_to_heads(
    module: nn.Module,
    mixed_qkv: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    unpadded_len: int | None = None,
) -> GdnLocal:
    """This rank's heads over the whole sequence (an identity view without SP).

    Args:
        module: the ``GatedDeltaNet`` (``num_k_heads``, ``num_v_heads``, ``head_k_dim``, ``head_v_dim``,
            ``conv1d``, ``A_log``, ``dt_bias``).
        mixed_qkv: ``[B, S/P, 2*Hk*dk + Hv*dv]``, channels ordered all q heads, all k heads, all v heads.
        b, a: ``[B, S/P, Hv]``.
        unpadded_len: the true full length when the shards were padded to a multiple of P and the packing
            (``cu_seqlens``) describes the unpadded row (``sp_unpadded_len``); the tail is cut after the exchange.
    Returns:
        `GdnLocal`, sequence length ``S`` (or ``unpadded_len``) under SP.
    """
    hk, hv, dk, dv = module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim
    weight = module.conv1d.weight.squeeze(1)  # [C, W]
    group = _sp_group()
    if group is None:
        return GdnLocal(mixed_qkv, b, a, weight, module.A_log, module.dt_bias, hk, hv)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    check_gdn_sp_heads(hk, hv, world)
    hk_l, hv_l = hk // world, hv // world
    batch, length = mixed_qkv.shape[:2]
    q, k, v = torch.split(mixed_qkv, [hk * dk, hk * dk, hv * dv], dim=-1)
    # [B, S/P, P, local channels]: slot p holds what rank p needs; one all-to-all swaps slots for sequence.
    per_rank = [
        q.reshape(batch, length, world, hk_l * dk),
        k.reshape(batch, length, world, hk_l * dk),
        v.reshape(batch, length, world, hv_l * dv),
        b.reshape(batch, length, world, hv_l),
        a.reshape(batch, length, world, hv_l),
    ]
    widths = [t.shape[-1] for t in per_rank]
    message = torch.cat([t.to(mixed_qkv.dtype) for t in per_rank], dim=-1)
    local = all_to_all(message, group, scatter_dim=2, gather_dim=1).squeeze(2)  # [B, S, local channels]
    if unpadded_len is not None:
        local = unpad(local, 1, unpadded_len)
    q, k, v, b, a = torch.split(local, widths, dim=-1)
    channels = torch.cat(
        [
            torch.arange(rank * hk_l * dk, (rank + 1) * hk_l * dk),
            hk * dk + torch.arange(rank * hk_l * dk, (rank + 1) * hk_l * dk),
            2 * hk * dk + torch.arange(rank * hv_l * dv, (rank + 1) * hv_l * dv),
        ]
    ).to(weight.device)
    heads = slice(rank * hv_l, (rank + 1) * hv_l)
    return GdnLocal(
        torch.cat([q, k, v], dim=-1),
        b,
        a,
        weight[channels],
        module.A_log[heads],
        module.dt_bias[heads],
        hk_l,
        hv_l,
    )


def gdn_heads_to_sequence(module: nn.Module, core: torch.Tensor) -> torch.Tensor:
    """Back to this rank's sequence shard with every value head: ``[B, S, Hv/P, dv] -> [B, ceil(S/P), Hv, dv]``
    (zero-padding an unpadded ``S`` back to a multiple of P; identity without SP)."""
    group = _sp_group()
    if group is None:
        return core
    return heads_to_seq(core, group, seq_dim=1, head_dim=2)
