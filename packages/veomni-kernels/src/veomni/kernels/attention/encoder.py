"""Packed (varlen) attention for encoder towers: ``[T, H, D]`` tokens of many images/clips in one call.

Vision and audio towers pack every item of a batch into one row and attend inside each item (bidirectional).
`encoder_varlen_attention` runs that on any attention backend of the kernel registry with the tower's own
``cu_seqlens``; nothing here looks at a model's ``attn_implementation`` name, so the packed path never depends
on a backend being called "flash". It is SP-free: call it with the full packed sequence (identical on every SP
rank), or let `veomni.core.sp.ulysses_attention` hand it the full sequence and a share of the heads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch

KernelFn = Callable[..., torch.Tensor]

# Backend name -> built kernel. The registry is filled at import time only, so a name maps to one function for
# the process. A plain dict rather than functools.cache: torch.compile traces a dict lookup (guarded) but traces
# *into* a cached function, and the hardware probe there is not traceable.
_BUILT: dict[str, KernelFn] = {}


def _registry_kernel(backend: str) -> KernelFn:
    kernel = _BUILT.get(backend)
    if kernel is not None:
        return kernel
    from veomni.kernels import KERNELS, detect_hardware

    spec = KERNELS.get("attention", "default", backend)  # KeyError listing the registered backends
    problem = spec.requires.unmet(detect_hardware())
    if problem:
        raise RuntimeError(f"attention backend {backend!r} is unavailable here: {problem}")
    # The registry types kernels as Callable[..., object] (ops return different things); attention rows return
    # the output tensor.
    return _BUILT.setdefault(backend, cast(KernelFn, spec.factory()))


def encoder_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    backend: str | KernelFn = "sdpa",
) -> torch.Tensor:
    """Attention inside each packed sequence, flash-attn varlen style.

    Args:
        q: ``[T, Hq, D]`` float; the tokens of all sequences back to back.
        k, v: ``[T, Hkv, D]`` with ``Hq % Hkv == 0`` (consecutive query heads share a KV head).
        cu_seqlens: ``[n + 1]`` integer offsets, ``0 = c_0 < ... < c_n = T`` (int32 or int64; cast to int32 on
            device, no host sync).
        max_seqlen: longest sequence as a python int, or None (backends that need it then compute it: one
            host sync).
        causal: False for encoder towers (every token sees its whole sequence).
        scale: softmax scale, ``1/sqrt(D)`` when None.
        backend: a registered attention backend (``"eager"``, ``"sdpa"``, ``"flex"``, ``"varlen"``,
            ``"flash_attn_2"``, ...) or an attention function of the ``veomni.kernels.attention`` convention.
    Returns:
        ``[T, Hq, D]`` in q's dtype.
    Raises:
        ValueError: shapes or offsets that do not follow the above; KeyError / RuntimeError: a backend that is
        unknown / cannot run here.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"encoder_varlen_attention expects packed [T, H, D] tensors, got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise ValueError(
            f"q, k and v must hold the same T tokens: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError(
            f"cu_seqlens must be a 1-D integer tensor [n + 1] with n >= 1, got dtype {cu_seqlens.dtype} "
            f"shape {tuple(cu_seqlens.shape)}"
        )
    if max_seqlen is not None and not isinstance(max_seqlen, int):
        raise TypeError(f"max_seqlen must be a python int or None, got {type(max_seqlen).__name__}")
    kernel = _registry_kernel(backend) if isinstance(backend, str) else backend
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    out = kernel(q[None], k[None], v[None], causal=causal, cu_seqlens=cu, max_seqlen=max_seqlen, scale=scale)
    return out[0]
