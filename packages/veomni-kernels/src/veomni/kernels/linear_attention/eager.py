"""Eager linear-attention ops: the plain-PyTorch oracles the ``fla`` backend is tested against.

Everything is differentiable through autograd and computes in fp32 (outputs are cast back to the input
dtype; fp64 inputs stay fp64). Varlen inputs (``cu_seqlens``) are one packed row, ``B == 1``; each document is computed as if it
were alone: the delta-rule state and the convolution window never cross a document boundary.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

__all__ = [
    "causal_conv1d_eager",
    "check_cu_seqlens",
    "gated_delta_rule_eager",
    "gated_delta_rule_recurrent",
    "rms_norm_gated_eager",
]

CONV_ACTIVATIONS = (None, "silu")


def check_cu_seqlens(
    cu_seqlens: torch.Tensor | None, batch: int, length: int, who: str, *, check_values: bool = True
) -> None:
    """Raise ``ValueError`` unless ``cu_seqlens`` is None or a valid int ``[N + 1]`` offset vector for one
    packed row of ``length`` tokens (``batch`` must then be 1): starts at 0, ends at ``length``, non-decreasing.

    ``check_values=False`` checks shape and dtype only: reading the values syncs with the host, which the fast
    backends avoid (their kernels index with the offsets on the device).
    """
    if cu_seqlens is None:
        return
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError(
            f"{who}: cu_seqlens must be an integer tensor [N + 1] with N >= 1, got {cu_seqlens.dtype} "
            f"{tuple(cu_seqlens.shape)}"
        )
    if batch != 1:
        raise ValueError(f"{who}: varlen inputs (cu_seqlens) must be one packed row, B == 1; got B = {batch}")
    if not check_values:
        return
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0 or offsets[-1] != length or any(b < a for a, b in itertools.pairwise(offsets)):
        raise ValueError(
            f"{who}: cu_seqlens must rise from 0 to the row length {length} without decreasing, got {offsets}"
        )


def check_delta_rule_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> None:
    """Raise ``ValueError`` unless q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g, beta ``[B, T, HV]`` with
    ``HV`` a multiple of ``H``, all floating point on one device."""
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(
            f"gated_delta_rule: q and k must both be [B, T, H, K], got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    b, t, h, _ = q.shape
    if v.dim() != 4 or v.shape[:2] != (b, t) or v.shape[2] % h:
        raise ValueError(
            f"gated_delta_rule: v must be [B, T, HV, V] with B, T = {b}, {t} and HV a multiple of H = {h}, "
            f"got {tuple(v.shape)}"
        )
    for name, gate in (("g", g), ("beta", beta)):
        if tuple(gate.shape) != tuple(v.shape[:3]):
            raise ValueError(
                f"gated_delta_rule: {name} must be [B, T, HV] = {tuple(v.shape[:3])}, got {tuple(gate.shape)}"
            )
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not x.is_floating_point() or x.device != q.device:
            raise ValueError(
                f"gated_delta_rule: {name} must be floating point on {q.device}, got {x.dtype} on {x.device}"
            )


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    # eps inside the sqrt, as fla's l2norm kernel does, so the two backends agree on near-zero vectors.
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


# (q, k, v, g, beta) in the computation layout: fp32 (or fp64) [B, HV, T, D] q, k, v and [B, HV, T] g, beta.
_Prepared = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
) -> _Prepared:
    """fp32 ``[B, HV, T, D]`` q (scaled), k, v and ``[B, HV, T]`` g, beta, with q/k repeated to HV heads."""
    groups = v.shape[2] // q.shape[2]
    compute = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs (exact tests)
    q, k, v, g, beta = (x.to(compute).transpose(1, 2) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    if (
        groups > 1
    ):  # grouped value attention: query/key head i serves value heads i*groups ... i*groups+groups-1
        q, k = q.repeat_interleave(groups, dim=1), k.repeat_interleave(groups, dim=1)
    return q * scale, k, v, g, beta


def _tokens(tensors: _Prepared, start: int, end: int) -> _Prepared:
    """Tokens ``[start, end)`` of each prepared tensor (dim 2 is T)."""
    q, k, v, g, beta = (x[:, :, start:end] for x in tensors)
    return q, k, v, g, beta


def _chunked_one(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, chunk: int
) -> torch.Tensor:
    """The chunked (WY) form of the gated delta rule on fp32 ``[B, H, T, D]`` tensors from a zero state.

    Within a chunk with cumulative log-decay ``G_i``, the state written by token i is ``k_i u_i^T`` where
    ``(I + L) u = beta*v - beta*exp(G)*K S0`` and ``L_ij = beta_i (k_i . k_j) exp(G_i - G_j)`` for j < i; the
    outputs are ``exp(G_i) q_i^T S0 + sum_{j<=i} exp(G_i - G_j)(q_i . k_j) u_j``. Only the chunk-to-chunk
    state carry is sequential.
    """
    bsz, heads, length, dk = k.shape
    dv = v.shape[-1]
    pad = (-length) % chunk
    if pad:  # zero-padded tokens (beta = 0, g = 0) write nothing and only follow the real ones
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (length + pad) // chunk
    q, k, v = (x.reshape(bsz, heads, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(bsz, heads, n, chunk), beta.reshape(bsz, heads, n, chunk)
    cum = g.cumsum(-1)
    # exp(G_i - G_j) for j <= i; masked before exp so the upper triangle cannot overflow.
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    strict = decay.tril(-1)
    lower = (beta.unsqueeze(-1) * (k @ k.transpose(-1, -2))) * strict
    system = lower + torch.eye(chunk, dtype=q.dtype, device=q.device)
    u_free = torch.linalg.solve_triangular(system, beta.unsqueeze(-1) * v, upper=False, unitriangular=True)
    u_state = torch.linalg.solve_triangular(
        system, (beta * cum.exp()).unsqueeze(-1) * k, upper=False, unitriangular=True
    )
    scores = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_to_end = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()
    state = q.new_zeros(bsz, heads, dk, dv)
    outs = []
    for i in range(n):
        u = u_free[:, :, i] - u_state[:, :, i] @ state
        outs.append(q_decayed[:, :, i] @ state + scores[:, :, i] @ u)
        state = state * chunk_decay[:, :, i, None, None] + k_to_end[:, :, i].transpose(-1, -2) @ u
    return torch.cat(outs, dim=2)[:, :, :length]


def gated_delta_rule_eager(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> torch.Tensor:
    """Gated delta rule (chunked), from a zero state per sequence / per ``cu_seqlens`` document.

    Per value head, with state ``S [K, V]``: ``S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T
    k_t))^T`` and ``o_t = S_t^T (scale * q_t)``.

    Args:
        q, k: ``[B, T, H, K]``; l2-normalised over K first when ``use_qk_l2norm``.
        v: ``[B, T, HV, V]``, ``HV`` a multiple of ``H`` (q/k head i serves ``HV // H`` consecutive v heads).
        g: ``[B, T, HV]`` log-decay (``<= 0``); beta: ``[B, T, HV]`` write strength (after the sigmoid).
        scale: query scale; ``K ** -0.5`` when None.
        cu_seqlens: int ``[N + 1]`` document offsets of one packed row (``B == 1``), or None.
        chunk_size: chunk length of the WY form (a speed knob; the result does not depend on it).
    Returns:
        ``[B, T, HV, V]`` in ``q.dtype``.
    """
    check_delta_rule_inputs(q, k, v, g, beta)
    check_cu_seqlens(cu_seqlens, q.shape[0], q.shape[1], "gated_delta_rule")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    tensors = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    if cu_seqlens is None:
        out = _chunked_one(*tensors, chunk=chunk_size)
    else:
        # One document at a time from a zero state: the state never leaks from one document into the next.
        offsets = cu_seqlens.tolist()
        pieces = [
            _chunked_one(*_tokens(tensors, a, b), chunk=chunk_size)
            for a, b in itertools.pairwise(offsets)
            if b > a
        ]
        out = torch.cat(pieces, dim=2)
    return out.transpose(1, 2).to(q.dtype)


def gated_delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """The token-by-token recurrence of `gated_delta_rule_eager` (same arguments, no varlen): the definition
    the chunked form is tested against. Slow (one step per token); for tests only. Returns ``[B, T, HV, V]``."""
    check_delta_rule_inputs(q, k, v, g, beta)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    state = q.new_zeros(q.shape[0], q.shape[1], q.shape[-1], v.shape[-1])
    outs = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t, None, None].exp()
        delta = beta[:, :, t, None] * (v[:, :, t] - (state * k[:, :, t, :, None]).sum(-2))
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        outs.append((state * q[:, :, t, :, None]).sum(-2))
    return torch.stack(outs, dim=2).transpose(1, 2).to(dtype)


def check_conv_inputs(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None
) -> None:
    """Raise ``ValueError`` unless x ``[B, T, C]``, weight ``[C, W]``, bias ``[C]`` or None, activation in
    ``CONV_ACTIVATIONS``."""
    if x.dim() != 3 or not x.is_floating_point():
        raise ValueError(
            f"causal_conv1d: x must be a floating-point [B, T, C] tensor, got {x.dtype} {tuple(x.shape)}"
        )
    if weight.dim() != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"causal_conv1d: weight must be [C, W] with C = {x.shape[-1]} (a Conv1d weight [C, 1, W] squeezed), "
            f"got {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (x.shape[-1],):
        raise ValueError(
            f"causal_conv1d: bias must be [C] = ({x.shape[-1]},) or None, got {tuple(bias.shape)}"
        )
    if activation not in CONV_ACTIVATIONS:
        raise ValueError(f"causal_conv1d: activation must be one of {CONV_ACTIVATIONS}, got {activation!r}")


def causal_conv1d_eager(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = "silu",
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depthwise causal convolution ``y_t = act(bias + sum_s weight[:, W-1-s] * x_{t-s})``, per channel.

    Args:
        x: ``[B, T, C]``; weight: ``[C, W]``; bias: ``[C]`` or None; activation: ``"silu"`` or None.
        cu_seqlens: int ``[N + 1]`` document offsets of one packed row (``B == 1``): taps reaching back past
            a document's start read zeros, as if the document were alone.
    Returns:
        ``[B, T, C]`` in ``x.dtype`` (computed in fp32).
    """
    check_conv_inputs(x, weight, bias, activation)
    batch, length, _ = x.shape
    check_cu_seqlens(cu_seqlens, batch, length, "causal_conv1d")
    width = weight.shape[-1]
    compute = torch.promote_types(x.dtype, torch.float32)
    xf, wf = x.to(compute), weight.to(compute)
    if cu_seqlens is None:
        pos = torch.arange(length, device=x.device)
    else:
        # Position of each token inside its own document: a tap of lag s is valid only where pos >= s.
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device=x.device, dtype=torch.long)
        starts = cu_seqlens[:-1].to(device=x.device, dtype=torch.long).repeat_interleave(lengths)
        pos = torch.arange(length, device=x.device) - starts
    out = xf * wf[:, -1]
    for lag in range(1, min(width, length)):
        shifted = F.pad(xf[:, :-lag], (0, 0, lag, 0))
        valid = (pos >= lag).to(xf.dtype)[None, :, None]
        out = out + shifted * valid * wf[:, width - 1 - lag]
    if bias is not None:
        out = out + bias.to(compute)
    if activation == "silu":
        out = F.silu(out)
    return out.to(x.dtype)


def rms_norm_gated_eager(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Gated RMSNorm of Qwen3-Next / Qwen3.5: ``(weight * x̂.to(x.dtype)) * silu(gate.float())``, cast to
    ``x.dtype``, with ``x̂ = x·rsqrt(mean(x², -1) + eps)`` in fp32 (normalise first, then gate).

    ``x``, ``gate``: ``[..., D]`` of one shape; ``weight``: ``[D]``. Returns ``[..., D]`` in ``x.dtype``.
    """
    if x.shape != gate.shape or x.dim() < 1:
        raise ValueError(
            f"rms_norm_gated: x and gate must have one shape [..., D], got {tuple(x.shape)} and {tuple(gate.shape)}"
        )
    if tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"rms_norm_gated: weight must be [D] = ({x.shape[-1]},), got {tuple(weight.shape)}")
    if not eps >= 0:
        raise ValueError(f"rms_norm_gated: eps must be >= 0, got {eps!r}")
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return ((weight * normed) * F.silu(gate.float())).to(x.dtype)
