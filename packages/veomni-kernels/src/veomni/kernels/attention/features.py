"""Optional attention features (sliding window, sinks, logit soft-cap): their maths, checks and shared helpers.

Every attention function takes them as keyword arguments, ``None`` meaning "off":

* ``window`` (int ``W >= 1``, causal only): query ``i`` attends to keys ``j`` with ``i - W < j <= i``: itself and
  the ``W - 1`` tokens before it, HF's ``sliding_window_overlay`` (``kv_idx > q_idx - sliding_window``). Positions
  are indices into the kernel's (full, under Ulysses SP) sequence; with packed sequences the document mask applies
  as well, so the window never crosses a document boundary and is the same as within each document.
* ``sinks`` (float ``[Hq]``, one learned logit per query head): a column added to every row's softmax and dropped
  after it (gpt-oss): ``p_j = exp(s_j) / (exp(sink_h) + sum_l exp(s_l))``. Differentiable w.r.t. ``sinks``.
* ``softcap`` (float ``c > 0``): scores become ``c * tanh(s / c)`` after scaling and before masking (Gemma 2).

Which backend computes which feature is declared with its registration (``KernelSpec.capabilities``); a model
needing one that the configured backend lacks is refused when it is built (`OpsConfig.require_capabilities`).
"""

from __future__ import annotations

import torch

SOFTCAP, SINKS, WINDOW = "softcap", "sinks", "sliding_window"
ATTENTION_FEATURES = (SOFTCAP, SINKS, WINDOW)

# What each built-in backend implements; the registry's capabilities and the kernels' own checks read this.
# sdpa: sinks as an extra key, windows as a mask, no soft-cap (SDPA cannot transform scores). flex: everything
# (soft-cap as a score_mod, sinks by log-sum-exp rescaling). varlen: windows (torch's varlen backward drops the
# log-sum-exp gradient that sinks would need). FlashAttention 2/3: windows and soft-cap. FlashAttention 4
# (flash_attn.cute, 4.0.0b36 checked on SM90): all three, sinks as its ``learnable_sink`` with their gradient; a
# release whose function lacks one of these parameters is refused by name when it is asked for (`_check_accepts`).
BACKEND_FEATURES: dict[str, frozenset[str]] = {
    "eager": frozenset(ATTENTION_FEATURES),
    "sdpa": frozenset({SINKS, WINDOW}),
    "flex": frozenset(ATTENTION_FEATURES),
    "varlen": frozenset({WINDOW}),
    "flash_attn_2": frozenset({WINDOW, SOFTCAP}),
    "flash_attn_3": frozenset({WINDOW, SOFTCAP}),
    "flash_attn_4": frozenset(ATTENTION_FEATURES),
    # torch_npu's npu_fusion_attention: window and sinks are not wired (veomni has no NPU to test them on).
    "npu": frozenset(),
}


# Backends whose forward kernel torch dispatches as an op that ``keep_attention`` checkpointing can save
# (`veomni.core.checkpointing.ATTENTION_OP_NAMES`: SDPA's ATen kernels and veomni's packed CPU op, torch's varlen op,
# FlashAttention 2/3's registered ops). eager is matmuls and a softmax; flex a compiled kernel; FlashAttention 4
# launches through cute-DSL: none of them can be kept.
CHECKPOINT_KEEPABLE = frozenset({"sdpa", "varlen", "flash_attn_2", "flash_attn_3"})


def check_features(
    backend: str,
    q: torch.Tensor,
    causal: bool,
    window: int | None,
    sinks: torch.Tensor | None,
    softcap: float | None,
) -> None:
    """Raise unless the requested features are well-formed and ``backend`` implements them (`BACKEND_FEATURES`)."""
    supported = BACKEND_FEATURES[backend]
    asked = {WINDOW: window, SINKS: sinks, SOFTCAP: softcap}
    for name, value in asked.items():
        if value is not None and name not in supported:
            have = ", ".join(sorted(supported)) or "none"
            raise NotImplementedError(
                f"attention backend {backend!r} does not implement {name} (it implements: {have}); choose a "
                "backend that has it (veomni.kernels.KERNELS capabilities, or OpsConfig.require_capabilities)"
            )
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"attention window must be an int >= 1 (tokens a query sees), got {window!r}")
        if not causal:
            raise ValueError(f"a sliding window ({window}) needs causal attention, got causal=False")
    if sinks is not None:
        if sinks.dim() != 1 or sinks.shape[0] != q.shape[2] or not sinks.is_floating_point():
            raise ValueError(
                f"sinks must be a float [Hq] = [{q.shape[2]}] tensor (one logit per query head), got "
                f"{sinks.dtype} {tuple(sinks.shape)}"
            )
        if sinks.device != q.device:
            raise ValueError(f"sinks are on {sinks.device} but q on {q.device}")
    if softcap is not None and not (isinstance(softcap, int | float) and softcap > 0):
        raise ValueError(f"softcap must be a positive number, got {softcap!r}")


def window_mask(seq_len: int, window: int, device: torch.device) -> torch.Tensor:
    """Bool ``[S, S]``: True where ``0 <= i - j < window`` (the causal sliding window)."""
    pos = torch.arange(seq_len, device=device)
    dist = pos[:, None] - pos[None, :]
    return (dist >= 0) & (dist < window)


def sink_rescale(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Turn attention without sinks into attention with them, given its log-sum-exp.

    ``softmax`` over ``[s_1..s_n, sink]`` restricted to the real keys is the plain softmax times
    ``Z / (Z + exp(sink)) = sigmoid(lse - sink)`` with ``lse = log Z``: an exact rescaling of each row, and
    differentiable through ``lse`` (the backend must propagate its gradient).

    Args:
        out: ``[B, S, H, D]`` attention output without sinks. lse: ``[B, H, S]`` fp32 natural-log sum of exp.
        sinks: ``[H]``.
    Returns:
        ``[B, S, H, D]`` in out's dtype.
    """
    factor = torch.sigmoid(lse.float() - sinks.float()[None, :, None])  # [B, H, S]
    return (out.float() * factor.transpose(1, 2)[..., None]).to(out.dtype)


def sink_key_augment(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q/K/V with one extra key whose score is exactly ``sinks[h]`` for query head ``h`` and whose value is 0.

    The sink becomes a real key in front of the sequence (key index 0), so any kernel that takes a mask computes
    attention with sinks, gradient included. The sink logit rides in two extra query dims (``hi + lo`` of
    ``sink / scale``, so a bf16 query carries it to ~16 bits) that meet ones in the sink key and zeros in the real
    keys; the head dim is then padded to a multiple of 8 (flash-style kernels want it).

    Args:
        q: ``[B, S, Hq, D]``; k, v: ``[B, Sk, Hkv, D]``; sinks: ``[Hq]``; scale: the softmax scale used.
    Returns:
        ``q' [B, S, Hq, D']``, ``k' [B, Sk + 1, Hkv, D']``, ``v' [B, Sk + 1, Hkv, D]`` with ``D' >= D + 2``.
    """
    batch, seq, heads, dim = q.shape
    padded = -(-(dim + 2) // 8) * 8
    logit = sinks.float() / scale
    hi = logit.to(q.dtype)
    lo = (logit - hi.float()).to(q.dtype)
    extra = torch.stack([hi, lo], dim=-1)[None, None].expand(batch, seq, heads, 2)
    q_aug = torch.cat([q, extra, q.new_zeros(batch, seq, heads, padded - dim - 2)], dim=-1)
    k_pad = torch.nn.functional.pad(k, (0, padded - dim))
    sink_key = k.new_zeros(batch, 1, k.shape[2], padded)
    sink_key[..., dim : dim + 2] = 1.0
    k_aug = torch.cat([sink_key, k_pad], dim=1)
    v_aug = torch.cat([v.new_zeros(batch, 1, *v.shape[2:]), v], dim=1)
    return q_aug, k_aug, v_aug
