"""veomni's attention kernels inside HF models, through HF's own extension point (``AttentionInterface``).

`register_hf_attention` adds one name per attention backend of ``veomni.kernels.KERNELS``
(`hf_attention_name`): ``veomni_eager``, ``veomni_sdpa``, ``veomni_flex``, ``veomni_varlen``, ``veomni_fa2``,
``veomni_fa3``, ``veomni_fa4``, ... A model selects one like any HF implementation
(``attn_implementation="veomni_sdpa"``) and needs no modeling changes for packing or Ulysses SP.
FlashAttention backends are *not* named ``veomni_flash_attn_N``: transformers treats every implementation
name containing "flash" as its own flash path (``is_flash_attention_requested``) and tries to load a hub
kernel of that name.

Packed sequences. The batch is treated as packed when HF forwards packing metadata in the attention kwargs:

* ``cu_seq_lens_q`` (``[n + 1]``, any int dtype) and optionally ``max_length_q`` (python int), as
  ``TransformersKwargs`` defines them. The fast path: no host sync (the int32 cast stays on device). The
  tokens of all rows are read as one flattened row of ``B * S`` tokens (HF's varlen convention); use B == 1.
  ``cu_seq_lens_k`` must be absent or describe the same segments (self-attention; only its shape is checked).
* otherwise ``position_ids`` (HF's decoder layers always forward them): a segment starts wherever a position
  is not its predecessor + 1, and at every row start. This costs one host sync per layer (``nonzero``), like
  HF's own flash path; collators should pass ``cu_seq_lens_q``. One segment per row is an ordinary batch.

Padding masks. HF's mask builder is told (via ``AttentionMaskInterface``) to hand over the user's 2-D padding
mask untouched (no ``[S, S]`` mask is ever built). Causal attention accepts right padding only: padded tail
tokens never influence the real ones, so they are computed and then ignored. The check runs on device
(``torch._assert_async``): no host sync on GPUs. Left padding, bidirectional attention with padding and
pre-built 4-D masks raise. Note: with ``position_ids`` and no mask, HF's ``create_causal_mask`` itself looks
for packing once per forward (a host sync in ``find_packed_sequence_indices``), as for its flash path.

Ulysses SP. Inside ``with use_parallel_state(state):`` with ``state.dims.sp > 1`` every call goes through
`veomni.core.sp.ulysses_attention`: the kernel sees the full sequence and ``H / P`` heads. Each rank feeds
its sequence shard (``S_local`` tokens; the full sequence zero-padded to ``P * S_local``) and the
*full-sequence* packing metadata. ``cu_seq_lens_q`` covers the padded ``P * S_local`` tokens (the padding as
segments of its own), unless the caller also passes ``sp_unpadded_len=L`` (python int): then it covers the
first L tokens and attention never sees the padding. Without ``cu_seq_lens_q`` the local ``position_ids``
are all-gathered over the SP group (one collective and one host sync per layer).

Keys of another length than the queries. Two cases, told apart explicitly:

* cross-attention: the module says so (``module.is_cross_attention = True``, as HF's BERT-family and diffusers
  attention modules do, or an ``is_cross_attention=True`` kwarg) and is non-causal. Keys/values come from a
  condition encoder and are replicated on every SP rank, so the local queries attend to them with no
  all-to-all (`veomni.core.sp.sp_cross_attention`); the kernel is the selected backend. A causal
  cross-attention module, a padding mask or packing kwargs on a cross-attention call raise.
* KV-cache decoding: anything else with ``S_kv != S_q``; it runs as before (torch SDPA, bottom-right causal),
  refused under SP, where a bidirectional one is told to declare itself a cross-attention.

Encoder towers. HF's vision towers pass their packing to the attention function only when the implementation
name contains "flash", so with ``veomni_*`` they loop over images with a host sync per layer, and under SP each
per-image call would be taken for a sequence shard. `veomni.models.hf_encoder_attention.encoder_attention` is the explicit entry a tower's
attention calls instead (a model adapter's job): packed ``[T, H, D]`` tokens, the tower's own ``cu_seqlens``,
the backend of the tower config's implementation, and no ``**kwargs``, so the language model's packing kwargs
cannot reach it (`veomni.models.hf_encoder_attention`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from veomni.core.parallel_state import ParallelState, current_parallel_state
from veomni.core.sp import gather_sequence, sp_cross_attention, ulysses_attention
from veomni.kernels import KERNELS, detect_hardware

PREFIX = "veomni_"
OP, VARIANT = "attention", "default"

HFAttentionFn = Callable[..., tuple[torch.Tensor, None]]

# Backend name -> the HF-signature function registered for it. Keeping the very objects makes registration
# idempotent: registering again stores the same function, and a foreign function under our name is detected.
_BUILT: dict[str, HFAttentionFn] = {}


def register_hf_attention(backends: list[str] | None = None) -> list[str]:
    """Register `hf_attention_name` (backend) in HF's global ``AttentionInterface`` and mask interface.

    Idempotent. Backends that cannot run on this machine are registered too: they raise a clear error when a
    model first calls them, so configs stay portable.

    Args:
        backends: attention backends of ``KERNELS`` to register (all of them when None).
    Returns:
        the registered implementation names, e.g. ``["veomni_eager", "veomni_sdpa", ...]``.
    Raises:
        KeyError: a backend that ``KERNELS`` does not know (the message lists the known ones).
        ValueError: the name is already taken by a function that is not ours.
    """
    known = KERNELS.backends(OP)
    chosen = known if backends is None else list(backends)
    names = []
    for backend in chosen:
        KERNELS.get(OP, VARIANT, backend)  # raises for unknown backends, listing the registered ones
        name = hf_attention_name(backend)
        fn = hf_attention_function(backend)
        existing = AttentionInterface._global_mapping.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(
                f"attention implementation {name!r} is already registered by someone else: {existing}"
            )
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, padding_mask_passthrough)
        names.append(name)
    return names


def hf_attention_name(backend: str) -> str:
    """The HF ``attn_implementation`` name of a ``KERNELS`` attention backend (flash_attn_2 -> veomni_fa2).

    "flash" never appears in the result: transformers routes any such name through its own FlashAttention
    loader.
    """
    return PREFIX + backend.replace("flash_attn_", "fa").replace("flash", "fa")


def hf_attention_function(backend: str) -> HFAttentionFn:
    """The HF-signature attention function (see `veomni_attention_forward`) for one ``KERNELS`` backend.

    The kernel is looked up now (unknown backend: ``KeyError``), but built and checked against the hardware on
    first call, so building it never imports optional packages.
    """
    if backend in _BUILT:
        return _BUILT[backend]
    spec = KERNELS.get(OP, VARIANT, backend)
    kernel: list[Callable[..., torch.Tensor]] = []

    def resolve() -> Callable[..., torch.Tensor]:
        if not kernel:
            hardware = detect_hardware()
            problem = spec.requires.unmet(hardware)
            if problem:
                runnable = [
                    b for b in KERNELS.backends(OP) if KERNELS.backend_problem(OP, b, hardware) is None
                ]
                raise RuntimeError(
                    f"attention implementation {hf_attention_name(backend)!r} is unavailable: {problem}. "
                    f"Runnable here: {[hf_attention_name(b) for b in runnable]}"
                )
            kernel.append(spec.factory())
        return kernel[0]

    def attention(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        return veomni_attention_forward(
            resolve(),
            module,
            query,
            key,
            value,
            attention_mask,
            scaling=scaling,
            dropout=dropout,
            backend=backend,
            **kwargs,
        )

    attention.resolve_kernel = resolve  # type: ignore[attr-defined]  # for veomni.models.hf_async_sp
    attention.__name__ = attention.__qualname__ = f"{hf_attention_name(backend)}_attention"
    attention.__doc__ = (
        f"HF attention function running veomni's {backend!r} kernel; see veomni_attention_forward."
    )
    _BUILT[backend] = attention
    return attention


def veomni_attention_forward(
    kernel: Callable[..., torch.Tensor],
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    backend: str = "?",
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Run ``kernel`` (veomni's ``fn(q, k, v, *, causal, cu_seqlens, max_seqlen, scale)``) for an HF module.

    Args:
        query: ``[B, Hq, S, D]``; key, value: ``[B, Hkv, S, D]`` (HF layout; under SP ``S`` is the local
            shard).
        attention_mask: None, or the bool ``[B, S_kv]`` padding mask (right padding only, causal only).
        scaling: softmax scale (``1/sqrt(D)`` when None). dropout: must be 0 (no backend implements it).
        kwargs: HF's attention kwargs: ``cu_seq_lens_q/k``, ``max_length_q/k``, ``position_ids``,
            ``is_causal`` (overrides ``module.is_causal``), ``is_cross_attention`` (overrides
            ``module.is_cross_attention``), ``sp_unpadded_len``; ``sliding_window``, ``s_aux`` (sinks ``[Hq]``)
            and ``softcap`` go to the kernel as ``window`` / ``sinks`` / ``softcap`` (a kernel lacking one
            raises; `veomni.models.kernel_hooks.apply_ops` refuses such a backend at build time); under SP the
            sinks are cut to the rank's heads and the window applies to global positions. Unrelated kwargs
            are ignored. Cross-attention: key, value ``[B, Hkv, S_kv, D]``
            with any ``S_kv``, replicated across SP ranks.
    Returns:
        ``(out [B, S, Hq, Dv] in query's dtype, None)`` (``Dv``: value's head size, which may differ from
        the query's, as in DeepSeek's MLA); attention weights are never materialised.
    """
    name = hf_attention_name(backend)
    if dropout:
        raise ValueError(
            f"{name} has no attention dropout (got dropout={dropout}); set the model's attention_dropout to 0"
        )
    features = _features(kwargs)
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    cross = kwargs.get("is_cross_attention")
    if bool(getattr(module, "is_cross_attention", False) if cross is None else cross):
        if any(f is not None for f in features.values()):
            raise NotImplementedError(f"{name}: cross-attention takes no window, sinks or softcap")
        return _cross_attention(
            name, kernel, query, key, value, attention_mask, causal, scaling, kwargs
        ), None
    if key.shape[2] != query.shape[2]:
        return _cached_decode(
            name, query, key, value, attention_mask, causal, scaling, kwargs, features
        ), None
    if attention_mask is not None:
        _check_padding_mask(attention_mask, causal, name)

    # HF hands over [B, H, S, D]; veomni kernels and the Ulysses exchange work on [B, S, H, D] views.
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    state = _sp_state()
    if state is None:
        cu_seqlens, max_seqlen = _packing(kwargs, query.shape[0], query.shape[2], group=None, full_len=None)
        out = _run_kernel(
            q,
            k,
            v,
            kernel=kernel,
            causal=causal,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            scale=scaling,
            **features,
        )
        return out, None

    sp = sp_kernel_kwargs(state, kwargs, features, batch=q.shape[0], local_len=q.shape[1], query_heads=q.shape[2])
    out = ulysses_attention(
        q, k, v, _run_kernel, state.sp_group, seq_dim=1, head_dim=2, unpadded_len=sp.pop("unpadded_len"),
        kernel=kernel, causal=causal, scale=scaling, **sp,
    )  # fmt: skip
    return out, None


def sp_kernel_kwargs(
    state: ParallelState,
    kwargs: dict[str, Any],
    features: dict[str, Any],
    *,
    batch: int,
    local_len: int,
    query_heads: int,
) -> dict[str, Any]:
    """What a Ulysses call needs besides q/k/v (shared with `veomni.models.hf_async_sp`): ``unpadded_len``, the
    full-sequence ``cu_seqlens`` / ``max_seqlen`` and the features, sinks cut to this rank's heads."""
    group = state.sp_group
    padded_len = local_len * dist.get_world_size(group)
    unpadded_len = kwargs.get("sp_unpadded_len")
    if unpadded_len is not None and not 0 < unpadded_len <= padded_len:
        raise ValueError(
            f"sp_unpadded_len={unpadded_len} does not fit shards of {local_len} tokens on "
            f"{dist.get_world_size(group)} ranks (expected 1 to {padded_len})"
        )
    full_len = padded_len if unpadded_len is None else unpadded_len
    cu_seqlens, max_seqlen = _packing(kwargs, batch, local_len, group=group, full_len=full_len)
    features = dict(features)
    if features["sinks"] is not None:
        # The exchange hands rank r the r-th block of H / P query heads; the kernel sees only their sinks.
        local_heads = query_heads // dist.get_world_size(group)
        features["sinks"] = features["sinks"].narrow(0, dist.get_rank(group) * local_heads, local_heads)
    # The window needs no care: the kernel sees the full sequence, so it applies to global positions.
    return {"unpadded_len": unpadded_len, "cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen, **features}


def _features(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The optional attention features HF passes: ``sliding_window`` (int), ``s_aux`` (sinks ``[Hq]``),
    ``softcap`` (float), as the kernels' ``window`` / ``sinks`` / ``softcap`` (None when off)."""
    return {
        "window": kwargs.get("sliding_window"),
        "sinks": kwargs.get("s_aux"),
        "softcap": kwargs.get("softcap"),
    }


def _cached_decode(
    name: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    causal: bool,
    scaling: float | None,
    kwargs: dict[str, Any],
    features: dict[str, Any],
) -> torch.Tensor:
    """Generation with a KV cache (keys longer than queries): one explicit fp32 computation for every backend.

    Not a training path, so every veomni backend shares this one: the queries are the last ``S_q`` of the
    ``S_kv`` cached positions, and each attends to the keys up to its own position that the padding mask and
    the sliding window keep (positions relative to the query, so a cache that dropped old tokens reads the
    same); soft-cap and sinks as in the kernels (``veomni.kernels.attention.features``). Returns
    ``[B, S_q, Hq, D]``.
    """
    if _sp_state() is not None or kwargs.get("cu_seq_lens_q") is not None:
        hint = (
            ""
            if causal
            else "; if this is cross-attention to keys/values replicated on every rank, mark the module "
            "(module.is_cross_attention = True) or pass is_cross_attention=True"
        )
        raise NotImplementedError(
            f"{name}: keys of another length than the queries are read as KV-cache decoding, which cannot be "
            f"combined with sequence parallelism or packed sequences: query {tuple(query.shape)}, key "
            f"{tuple(key.shape)}{hint}"
        )
    q_len, kv_len = query.shape[2], key.shape[2]
    if kv_len < q_len:
        raise ValueError(f"{name}: fewer keys ({kv_len}) than queries ({q_len})")
    window, sinks, softcap = features["window"], features["sinks"], features["softcap"]
    # Distance of key j behind query i, both placed at the end of the cached positions.
    behind = (
        torch.arange(q_len, device=query.device)[:, None]
        + (kv_len - q_len)
        - torch.arange(kv_len, device=query.device)
    )
    allowed = behind >= 0 if causal else torch.ones_like(behind, dtype=torch.bool)
    if window is not None:
        allowed = allowed & (behind < window)
    mask = allowed[None, None]
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape[-1] != kv_len:
            raise ValueError(
                f"{name}: decoding needs a [B, {kv_len}] padding mask, got {tuple(attention_mask.shape)}"
            )
        mask = mask & attention_mask.bool()[:, None, None, :]
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1).float()
    v = value.repeat_interleave(groups, dim=1).float()
    scale = 1.0 / math.sqrt(query.shape[-1]) if scaling is None else scaling
    scores = query.float() @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float()[None, :, None, None].expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return (probs @ v).to(query.dtype).transpose(1, 2)


def _cross_attention(
    name: str,
    kernel: Callable[..., torch.Tensor],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    causal: bool,
    scaling: float | None,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """Bidirectional attention of (under SP: sequence-sharded) queries to full, replicated keys/values.

    ``query [B, Hq, S_q, D]``, ``key``/``value [B, Hkv, S_kv, D]`` -> ``[B, S_q, Hq, D]``.
    """
    if causal:
        raise ValueError(
            f"{name}: the module is marked as cross-attention but attends causally (is_causal=True); that is "
            "ambiguous (KV-cache decoding is causal self-attention, cross-attention is bidirectional). Set "
            "module.is_causal = False for cross-attention, or unmark is_cross_attention for decoding"
        )
    if attention_mask is not None:
        raise NotImplementedError(
            f"{name}: cross-attention takes no attention mask (got {tuple(attention_mask.shape)}); pad the "
            "condition with tokens the model can attend to, or use HF's sdpa implementation"
        )
    for packing in ("cu_seq_lens_q", "cu_seq_lens_k"):
        if kwargs.get(packing) is not None:
            raise NotImplementedError(
                f"{name}: packed sequences ({packing}) reached a cross-attention call; the queries' packing says "
                "nothing about the condition keys. Strip the packing kwargs before the cross-attention modules"
            )
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    run = dict(kernel=kernel, causal=False, cu_seqlens=None, max_seqlen=None, scale=scaling)
    if _sp_state() is None:
        return _run_kernel(q, k, v, **run)
    return sp_cross_attention(q, k, v, _run_kernel, seq_dim=1, head_dim=2, **run)


def padding_mask_passthrough(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """HF mask-interface function for ``veomni_*``: the 2-D bool padding mask ``[B, kv_length]`` or None.

    Causality and packing are the kernels' business (``causal`` / ``cu_seqlens``), so no ``[S, S]`` mask is
    built; HF's packing-derived ``mask_function`` is ignored because the attention function reads the same
    packing from its kwargs.
    """
    if attention_mask is None:
        return None
    return attention_mask[:, -kv_length:]


def packed_kwargs(position_ids: torch.Tensor) -> dict[str, Any]:
    """Packing kwargs for an HF forward, from the full sequence's ``position_ids`` (for collators and tests).

    Args:
        position_ids: ``[S]`` or ``[1, S]`` int positions of one packed row; a document starts wherever the
            position is not its predecessor + 1.
    Returns:
        ``{"cu_seq_lens_q", "cu_seq_lens_k": int32 [n + 1], "max_length_q", "max_length_k": int}`` on the
        positions' device (computing them syncs with the host once; do it in the data pipeline).
    """
    flat = position_ids.reshape(1, -1)
    cu = _cu_from_positions(flat)
    max_len = int((cu[1:] - cu[:-1]).max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_len, "max_length_k": max_len}


def _sp_state() -> ParallelState | None:
    # No current state is the ordinary single-process case, not an error: core raises; we read it as "no SP".
    try:
        state = current_parallel_state()
    except RuntimeError:
        return None
    return state if state.dims.sp > 1 else None


def _check_padding_mask(mask: torch.Tensor, causal: bool, name: str) -> None:
    if mask.dim() != 2 or mask.dtype != torch.bool:
        raise NotImplementedError(
            f"{name} takes no pre-built attention masks, only a 2-D padding mask; got {mask.dtype} "
            f"{tuple(mask.shape)}. Causality comes from module.is_causal and packing from cu_seq_lens_q / "
            "position_ids"
        )
    if not causal:
        raise NotImplementedError(
            f"{name}: padding masks with bidirectional attention are not supported; pack the sequences "
            "instead (position_ids / cu_seq_lens_q, no attention_mask)"
        )
    # Right padding only: a kept token after a padded one would attend to the padding. On device: no sync.
    left_padded = (mask[:, 1:] & ~mask[:, :-1]).any()
    torch._assert_async(
        ~left_padded,
        f"{name} supports right padding only (a real token follows a padding token in attention_mask); "
        "pad on the right or pack the sequences",
    )


def _packing(
    kwargs: dict[str, Any],
    batch: int,
    seq_len: int,
    *,
    group: dist.ProcessGroup | None,
    full_len: int | None,
) -> tuple[torch.Tensor | None, int | None]:
    """``(cu_seqlens int32 | None, max_seqlen | None)`` over the full sequence, from HF's attention kwargs."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        cu_k = kwargs.get("cu_seq_lens_k")
        if cu_k is not None and cu_k.shape != cu.shape:
            raise NotImplementedError(
                f"cu_seq_lens_k {tuple(cu_k.shape)} differs from cu_seq_lens_q {tuple(cu.shape)}: "
                "veomni attention is self-attention over one packing"
            )
        max_len = kwargs.get("max_length_q")
        # A tensor max_length (HF computes one that way) costs a sync to read; kernels that need it compute
        # it themselves, so pass it on only when it is a python int.
        return cu.to(torch.int32), max_len if isinstance(max_len, int) else None
    positions = kwargs.get("position_ids")
    if positions is None:
        return None, None
    positions = positions.reshape(-1, positions.shape[-1]).expand(batch, -1)
    if positions.shape[1] != seq_len:
        raise ValueError(f"position_ids {tuple(positions.shape)} do not match {seq_len} query tokens")
    if group is not None:
        # Under SP each rank holds a shard of the positions; segments are a property of the whole sequence.
        positions = gather_sequence(positions.contiguous(), group, dim=1, equal_sizes=True)[:, :full_len]
    cu = _cu_from_positions(positions)
    if cu.numel() - 1 == batch:
        return None, None  # one sequence per row: an ordinary batch, which every kernel runs fastest unpacked
    return cu, None


def _cu_from_positions(positions: torch.Tensor) -> torch.Tensor:
    """int32 ``[n + 1]`` segment offsets of the flattened ``[B, S]`` positions (one host sync: nonzero)."""
    batch, seq = positions.shape
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    offsets = starts.reshape(-1).nonzero().reshape(-1)
    end = offsets.new_full((1,), batch * seq)  # a fill: no blocking host -> device copy
    return torch.cat([offsets, end]).to(torch.int32)


def _run_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    kernel: Callable[..., torch.Tensor],
    causal: bool,
    cu_seqlens: torch.Tensor | None,
    max_seqlen: int | None,
    scale: float | None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``[B, S, H, D]`` in and out; with ``cu_seqlens`` the batch runs as one packed row of B * S tokens.

    The optional features are passed on only when set, so kernels of the older signature keep working."""
    batch, seq = q.shape[:2]
    if cu_seqlens is not None and batch > 1:
        q, k, v = (t.reshape(1, batch * seq, *t.shape[2:]) for t in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    features = {
        key: value
        for key, value in (("window", window), ("sinks", sinks), ("softcap", softcap))
        if value is not None
    }
    out = kernel(
        q, k, v, causal=causal, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, scale=scale, **features
    )
    return out.reshape(batch, seq, *out.shape[2:])


__all__ = [
    "PREFIX",
    "hf_attention_function",
    "hf_attention_name",
    "packed_kwargs",
    "padding_mask_passthrough",
    "register_hf_attention",
    "veomni_attention_forward",
]
