"""The training path of a Gated DeltaNet layer after its input projections, shared by Qwen3-Next and Qwen3.5
(which differ only in how q, k, v, z, beta and the decay logits are projected).

Short convolution and delta rule through the instance's kernels with the packing's ``cu_seq_lens_q`` (state and
conv window restart per document), Ulysses SP over heads (`veomni.models.qwen3_next.sp`), then the gated norm and
``out_proj``.

HF's decoder layers hand ``position_ids`` to the attention layers only, so a row packed by its positions alone
(``DataCollatorWithFlattening``) would reach the Gated DeltaNet layers as one document; and a forward that builds
the config's default cache sends them to upstream's generation code. The patched text models call
`prepare_training_forward` once per forward: it turns such positions into the ``cu_seq_lens_q/k`` every layer reads
and keeps packed and SP forwards off the cache.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.masking_utils import create_recurrent_attention_mask

from veomni.kernels import Kernels
from veomni.models.hf.attention_inputs import current_sp_state, packing_metadata
from veomni.models.qwen3_next.sp import gdn_heads_to_sequence, gdn_sequence_to_heads

__all__ = [
    "check_cached_call",
    "gated_delta_net_train",
    "init_decay_log",
    "prepare_training_forward",
    "recurrent_padding_mask",
]


def init_decay_log(a_log: torch.Tensor) -> None:
    """Upstream's initial ``A_log`` (``log A``, ``A ~ U(0.01, 16)`` drawn in fp32), drawn on ``a_log``'s own layout.

    Upstream draws a plain ``torch.empty(heads)``; copied into a parameter that FSDP2 already sharded (a fresh init
    of the trainer) that mixes a tensor and a DTensor, which DTensor refuses. ``empty_like`` draws a DTensor
    through DTensor's RNG there, and exactly upstream's numbers on a plain tensor.

    Args:
        a_log: ``[Hv]`` parameter (any float dtype; plain tensor or DTensor).
    """
    init.copy_(a_log, torch.empty_like(a_log, dtype=torch.float32).uniform_(0.01, 16).log_())


def prepare_training_forward(
    module: nn.Module,
    position_ids: torch.Tensor | None,
    hidden_states: torch.Tensor,
    past_key_values: Any,
    use_cache: bool | None,
    kwargs: dict[str, Any],
) -> tuple[dict[str, Any], bool | None]:
    """What a hybrid text model's forward hands its layers: ``(kwargs, use_cache)``, called before it builds its
    default cache.

    1. Rows packed by ``position_ids`` alone (HF's ``DataCollatorWithFlattening``) get ``cu_seq_lens_q/k``. veomni
       attention finds such packing in ``position_ids`` by itself, but HF never passes them to the linear attention
       layers, whose convolution and recurrent state would run across document boundaries. The offsets are the ones
       veomni attention derives (`veomni.models.hf.attention_inputs.packing_metadata`: a document starts wherever a
       position is not its predecessor + 1, rows flattened into one), computed once per forward; under Ulysses SP
       the positions are this rank's shard, gathered over the SP group and cut to ``sp_unpadded_len`` as the
       attention does. Positions with one document per row (an ordinary batch) add nothing.
    2. A packed or Ulysses SP forward builds no default cache (``use_cache`` is the config's ``True`` unless the
       caller says otherwise, and HF's Trainer does not): with a cache the Gated DeltaNet layers run upstream's
       generation code, which reads neither the packing nor the SP shards.

    Left unchanged: a model without kernels (upstream's code) and a cache passed by the caller (generation; a packed
    or SP forward with one is refused by the layers, `check_cached_call`).

    Args:
        module: the text model (its ``veomni_kernels`` tell whether the patched layers run).
        position_ids: ``[B, S]`` text positions given by the caller (this rank's shard under SP), or None.
        hidden_states: ``[B, S, D]`` input embeddings (batch and local length).
        past_key_values: the cache the caller passed, or None.
        use_cache: the forward's ``use_cache``.
        kwargs: the forward's remaining kwargs (not modified).
    Returns:
        ``kwargs`` or a copy with ``cu_seq_lens_q`` and ``cu_seq_lens_k`` (int32 ``[n + 1]``) added, and
        ``use_cache`` or False.
    """
    if getattr(module, "veomni_kernels", None) is None or past_key_values is not None:
        return kwargs, use_cache
    state = current_sp_state()
    if position_ids is not None and kwargs.get("cu_seq_lens_q") is None:
        batch, length = hidden_states.shape[:2]
        group, full_len = None, None
        if state is not None:
            group = state.sp_group
            unpadded = kwargs.get("sp_unpadded_len")
            full_len = length * state.dims.sp if unpadded is None else unpadded
        cu, _ = packing_metadata(
            {"position_ids": position_ids}, batch, length, group=group, full_len=full_len
        )
        if cu is not None:
            kwargs = {**kwargs, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu}
    if kwargs.get("cu_seq_lens_q") is not None or state is not None:
        use_cache = False
    return kwargs, use_cache


def recurrent_padding_mask(
    config: Any,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    past_key_values: Any = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """HF's ``create_recurrent_attention_mask`` (the ``[B, S]`` padding mask the Gated DeltaNet layers multiply their
    input by); under Ulysses SP the caller's 2-D mask must be this rank's shard.

    Under SP every per-token input is the rank's shard (``input_ids``, ``position_ids``, labels; the MoE aux loss
    refuses a mask of other width), so the mask is ``[B, S/P]`` too. HF's builder would take a full ``[B, S]`` mask
    and keep its last ``S/P`` columns on every rank: each rank would zero its tokens where the last shard is padding,
    silently. So any other width is refused. The mask is returned as given under SP (HF's all-ones shortcut is a host
    sync, and it also drops the mask of a one-token shard, taking it for a decode step).

    Args:
        config, past_key_values, kwargs: as HF's builder takes them (passed on to it without SP).
        inputs_embeds: ``[B, S_local, D]``, this rank's shard under SP.
        attention_mask: None, a ``[B, S_local]`` padding mask (1 keeps a token), or a 4-D mask (HF's rules: None).
    Returns:
        ``[B, S_local]`` or None.
    Raises:
        ValueError: under SP, a 2-D mask whose shape is not ``[B, S_local]``.
    """
    state = current_sp_state()
    if state is None or attention_mask is None or attention_mask.dim() != 2:
        return create_recurrent_attention_mask(
            config, inputs_embeds, attention_mask, past_key_values, **kwargs
        )
    expected = list(inputs_embeds.shape[:2])
    if list(attention_mask.shape) != expected:
        raise ValueError(
            f"Gated DeltaNet under Ulysses SP (sp={state.dims.sp}): attention_mask must be this rank's shard of the "
            f"padding mask, {expected} like its input_ids ([B, S/P]: veomni.core.sp.slice_sequence(mask, 1, "
            f"sp_group)), got {list(attention_mask.shape)}. A full-sequence [B, S] mask would be cut to its last "
            "S/P columns on every rank, zeroing the wrong tokens"
        )
    return attention_mask.contiguous()


def check_cached_call(kwargs: Mapping[str, Any]) -> None:
    """Refuse a Gated DeltaNet call with a cache that is packed (``cu_seq_lens_q``) or runs under Ulysses SP.

    With a cache the layer runs upstream's generation code on its own input: it would carry the state from one
    document into the next, or recur over this rank's shard alone.
    """
    state = current_sp_state()
    if kwargs.get("cu_seq_lens_q") is None and state is None:
        return
    what = "packed rows (cu_seq_lens_q)" if state is None else f"Ulysses SP (sp={state.dims.sp})"
    raise ValueError(
        f"Gated DeltaNet: {what} cannot run with a cache (past_key_values): the cached path is upstream's "
        "generation code, which would run the recurrent state across documents or over one rank's shard. Call "
        "the model with use_cache=False and no past_key_values for training"
    )


def gated_delta_net_train(
    module: nn.Module,
    kernels: Kernels,
    mixed_qkv: torch.Tensor,
    z: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    kwargs: Mapping[str, Any],
) -> torch.Tensor:
    """One Gated DeltaNet layer from its projections (no cache).

    Args:
        module: the ``GatedDeltaNet`` (``conv1d``, ``A_log``, ``dt_bias``, ``norm``, ``out_proj``, head counts and
            dims, ``activation``).
        kernels: the instance's kernel set (``causal_conv1d``, ``gated_delta_rule``; ``module.norm`` reads its own).
        mixed_qkv: ``[B, T, 2*Hk*dk + Hv*dv]`` pre-conv channels (all q heads, all k heads, all v heads).
        z: ``[B, T, Hv, dv]`` output gate; b, a: ``[B, T, Hv]`` beta and decay logits. ``T`` is this rank's
            sequence shard under SP.
        kwargs: the layer's forward kwargs (``cu_seq_lens_q``, ``sp_unpadded_len`` are read); ``cu_seq_lens_q``
            covers the ``B`` rows read as one flattened row of ``B * T`` tokens (full ``T`` under SP).
    Returns:
        ``[B, T, hidden]`` in the projections' dtype.
    """
    # Under Ulysses SP: the whole sequence of this rank's heads (and their conv rows); else the layer as is.
    local = gdn_sequence_to_heads(module, mixed_qkv, b, a, kwargs.get("sp_unpadded_len"))
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    rows, length = local.mixed_qkv.shape[:2]
    mixed_qkv, beta_logits, decay_logits = local.mixed_qkv, local.b, local.a
    if cu_seqlens is not None and rows > 1:
        # HF's varlen convention (and veomni attention's): the offsets cover all rows read as one flattened row.
        mixed_qkv, beta_logits, decay_logits = (
            x.reshape(1, rows * length, *x.shape[2:]) for x in (mixed_qkv, beta_logits, decay_logits)
        )
    mixed_qkv = kernels.get("causal_conv1d", "standard")(
        mixed_qkv, local.conv_weight, None, activation=module.activation, cu_seqlens=cu_seqlens
    )
    num_k, num_v, dk, dv = local.num_k_heads, local.num_v_heads, module.head_k_dim, module.head_v_dim
    query, key, value = torch.split(mixed_qkv, [num_k * dk, num_k * dk, num_v * dv], dim=-1)
    lead = mixed_qkv.shape[:2]
    query, key = query.reshape(*lead, num_k, dk), key.reshape(*lead, num_k, dk)
    value = value.reshape(*lead, num_v, dv)
    # fp32 so that exp(A_log) cannot overflow in fp16 (as upstream).
    g = -local.a_log.float().exp() * F.softplus(decay_logits.float() + local.dt_bias)
    core = kernels.get("gated_delta_rule", "chunk")(
        query, key, value, g, beta_logits.sigmoid(), use_qk_l2norm=True, cu_seqlens=cu_seqlens
    )
    core = gdn_heads_to_sequence(module, core.reshape(rows, length, *core.shape[2:]))  # [B, T, Hv, dv]
    return module.out_proj(module.norm(core, z).flatten(2))
