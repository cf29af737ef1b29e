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
mask untouched (no ``[S, S]`` mask is ever built). Causal kernels take right padding only: padded tail
tokens never influence the real ones, so they are computed and then ignored. What the kernels do not take --
left or gapped padding, a static cache, pre-built 4-D masks, ``output_attentions=True`` -- runs transformers'
own sdpa (eager for attention weights) for that call, outside Ulysses SP (`veomni.models.hf.attention_fallback`;
reading whether a 2-D mask is right-padded is one host sync per mask built). Under SP the right-padding check
runs on device (``torch._assert_async``) and the rest raises; bidirectional attention with padding raises. Note: with ``position_ids`` and no mask, HF's ``create_causal_mask`` itself looks
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
per-image call would be taken for a sequence shard. `veomni.models.hf.encoder_attention.encoder_attention` is the explicit entry a tower's
attention calls instead (a model adapter's job): packed ``[T, H, D]`` tokens, the tower's own ``cu_seqlens``,
the backend of the tower config's implementation, and no ``**kwargs``, so the language model's packing kwargs
cannot reach it (`veomni.models.hf.encoder_attention`).

Reading HF's kwargs (packing, the padding-mask check, features, the SP state) and the kernel call itself live in
`veomni.models.hf.attention_inputs`, shared with the async Ulysses path (`veomni.models.hf.async_sp`);
`packed_kwargs` is re-exported here, where collators and tests have always imported it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.masking_utils import AttentionMaskInterface, bidirectional_mask_function
from transformers.modeling_utils import AttentionInterface

from veomni.core.sp import sp_cross_attention, ulysses_attention
from veomni.kernels import KERNELS, detect_hardware
from veomni.models.hf.attention_fallback import hf_attention, hf_mask, needs_hf_attention
from veomni.models.hf.attention_inputs import (
    attention_features,
    check_padding_mask,
    current_sp_state,
    packed_kwargs,
    packing_metadata,
    run_kernel,
    sp_kernel_kwargs,
)
from veomni.models.hf.output_capture import attention_weights_requested

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

    attention.resolve_kernel = resolve  # type: ignore[attr-defined]  # for veomni.models.hf.async_sp
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
        attention_mask: None, or the bool ``[B, S_kv]`` padding mask (right padding only, causal only); a 4-D
            mask (or ``output_attentions``) runs transformers' attention instead (`hf_attention`).
        scaling: softmax scale (``1/sqrt(D)`` when None). dropout: must be 0 (no backend implements it).
        kwargs: HF's attention kwargs: ``cu_seq_lens_q/k``, ``max_length_q/k``, ``position_ids``,
            ``is_causal`` (overrides ``module.is_causal``), ``is_cross_attention`` (overrides
            ``module.is_cross_attention``), ``sp_unpadded_len``; ``sliding_window``, ``s_aux`` (sinks ``[Hq]``)
            and ``softcap`` go to the kernel as ``window`` / ``sinks`` / ``softcap`` (a kernel lacking one
            raises; `veomni.models.hf.kernel_hooks.apply_ops` refuses such a backend at build time); under SP the
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
    if attention_weights_requested() or (attention_mask is not None and attention_mask.dim() == 4):
        # Not the training shape (a prepared mask: left padding, a static cache, a user's own 4-D mask; or weights
        # asked for): transformers' own attention for this call (veomni.models.hf.attention_fallback).
        return hf_attention(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, name=name, **kwargs
        )
    features = attention_features(kwargs)
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
        check_padding_mask(attention_mask, causal, name)

    # HF hands over [B, H, S, D]; veomni kernels and the Ulysses exchange work on [B, S, H, D] views.
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    state = current_sp_state()
    if state is None:
        cu_seqlens, max_seqlen = packing_metadata(
            kwargs, query.shape[0], query.shape[2], group=None, full_len=None
        )
        out = run_kernel(
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

    sp = sp_kernel_kwargs(
        state, kwargs, features, batch=q.shape[0], local_len=q.shape[1], query_heads=q.shape[2]
    )
    out = ulysses_attention(
        q, k, v, run_kernel, state.sp_group, seq_dim=1, head_dim=2, unpadded_len=sp.pop("unpadded_len"),
        kernel=kernel, causal=causal, scale=scaling, **sp,
    )  # fmt: skip
    return out, None


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
    if current_sp_state() is not None or kwargs.get("cu_seq_lens_q") is not None:
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
    if current_sp_state() is None:
        return run_kernel(q, k, v, **run)
    return sp_cross_attention(q, k, v, run_kernel, seq_dim=1, head_dim=2, **run)


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
    packing from its kwargs. Outside Ulysses SP, a static cache (keys not ending at the queries), a left or gapped
    padding mask and ``output_attentions`` get transformers' 4-D sdpa mask instead, which routes the attention
    calls to transformers' own implementation (`veomni.models.hf.attention_fallback`).
    """
    cross = (
        mask_function is bidirectional_mask_function
    )  # an encoder-decoder's cross-attention mask: no cache
    # The decode path takes the queries as the last keys (a dynamic cache's past + new). A preallocated cache
    # (StaticCache, generate(cache_implementation="static")) hands over every slot, the unwritten ones too: that,
    # left or gapped padding and output_attentions get transformers' 4-D mask, and the attention function then
    # runs transformers' attention for them (veomni.models.hf.attention_fallback).
    static = not cross and q_length != kv_length and int(q_offset) + q_length != int(kv_offset) + kv_length
    if (static and current_sp_state() is None) or needs_hf_attention(attention_mask):
        device = kwargs.get("device", "cpu" if attention_mask is None else attention_mask.device)
        return hf_mask(
            batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, device,
            use_vmap=kwargs.get("use_vmap", False),
        )  # fmt: skip
    if static:
        raise NotImplementedError(
            f"veomni attention under Ulysses SP decodes with no cache; this one has {kv_length} key slots from "
            f"{int(kv_offset)} for queries at {int(q_offset)}..{int(q_offset) + q_length - 1} (a static cache?)"
        )
    if attention_mask is None:
        return None
    return attention_mask[:, -kv_length:]


__all__ = [
    "PREFIX",
    "hf_attention_function",
    "hf_attention_name",
    "packed_kwargs",
    "padding_mask_passthrough",
    "register_hf_attention",
    "veomni_attention_forward",
]
