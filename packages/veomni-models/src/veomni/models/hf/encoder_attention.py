"""The attention entry of encoder towers (ViT, audio encoders) inside HF models.

HF's Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision attention hands its packing (``cu_seq_lens_q=cu_seqlens``) to the
attention function only when the implementation name contains "flash"; for every other name (``veomni_*``
included) it splits the packed tokens per image with a host sync per layer, and it forwards the outer model's
``**kwargs``. `encoder_attention` is the explicit entry a tower's attention module calls instead (model adapters
route it there): the packed ``[T, H, D]`` tokens, the tower's own ``cu_seqlens``, the backend that the tower
config's ``attn_implementation`` names, and no ``**kwargs``, so the language model's packing metadata
(``cu_seq_lens_q``, ``position_ids``, ``sp_unpadded_len``, ...) cannot reach it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from veomni.core.sp import ulysses_attention
from veomni.kernels import KERNELS
from veomni.kernels.attention import encoder_varlen_attention
from veomni.models.hf.attention import OP, hf_attention_name


def encoder_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None = None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sp_group: dist.ProcessGroup | None = None,
    sp_unpadded_len: int | None = None,
) -> torch.Tensor:
    """The attention entry of an encoder tower (ViT, audio encoder): bidirectional, packed, the tower's metadata.

    The backend follows ``module.config._attn_implementation``: ``veomni_<backend>`` names and HF's ``eager``,
    ``sdpa``, ``flex_attention``, ``flash_attention_2/3`` map to the kernel registry's backends
    (`backend_for_implementation`); it runs `veomni.kernels.attention.encoder_varlen_attention`.

    Args:
        query: ``[T, Hq, D]`` packed tokens of every image/clip; key, value: ``[T, Hkv, D]``.
        cu_seqlens: ``[n + 1]`` integer offsets of the tower's own sequences over the full ``T_full`` tokens.
        max_seqlen: longest sequence (python int) or None (some backends then compute it: one host sync).
        scaling: softmax scale (``1/sqrt(D)`` when None). dropout: must be 0.
        sp_group: None: the inputs are the full packed sequence (the same on every SP rank) and no collective
            runs, whatever parallel state is current. A group: the inputs are this rank's slice of the tower's
            sequence (zero-padded to ``P * T``), attention runs through `ulysses_attention` with the full
            ``cu_seqlens``; ``sp_unpadded_len`` is the true ``T_full`` when the slices carry tail padding.
    Returns:
        ``[T, Hq, D]`` in query's dtype (for ``sp_group``: this rank's slice).
    """
    if dropout:
        raise ValueError(f"encoder_attention has no attention dropout (got dropout={dropout})")
    implementation = getattr(getattr(module, "config", None), "_attn_implementation", None)
    backend = backend_for_implementation(implementation)
    if sp_group is None:
        return encoder_varlen_attention(
            query, key, value, cu_seqlens, max_seqlen, causal=False, scale=scaling, backend=backend
        )
    return ulysses_attention(
        query,
        key,
        value,
        encoder_varlen_attention,
        sp_group,
        seq_dim=0,
        head_dim=1,
        unpadded_len=sp_unpadded_len,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        causal=False,
        scale=scaling,
        backend=backend,
    )


_HF_IMPLEMENTATIONS = {
    "eager": "eager",
    "sdpa": "sdpa",
    "flex_attention": "flex",
    "flash_attention_2": "flash_attn_2",
    "flash_attention_3": "flash_attn_3",
}


# HF implementation name -> KERNELS backend, built on first use. KERNELS is filled at import time only, so the map
# is built once, not per layer call; a dict (not functools.cache) so that torch.compile traces a guarded lookup.
_NAMES: dict[str, str] = {}


def _veomni_names() -> dict[str, str]:
    if not _NAMES:
        _NAMES.update({hf_attention_name(b): b for b in KERNELS.backends(OP)})
    return _NAMES


def backend_for_implementation(implementation: str | None) -> str:
    """The ``KERNELS`` attention backend behind an HF ``attn_implementation`` name (veomni_fa2 -> flash_attn_2).

    Raises ``ValueError`` for names with no veomni kernel (the message lists the accepted ones).
    """
    ours = _veomni_names()
    backend = ours.get(implementation or "", _HF_IMPLEMENTATIONS.get(implementation or ""))
    if backend is None:
        raise ValueError(
            f"attn_implementation {implementation!r} has no veomni attention kernel; expected one of "
            f"{sorted(ours) + sorted(_HF_IMPLEMENTATIONS)}"
        )
    return backend


def needs_max_seqlen(implementation: str) -> bool:
    """Whether the encoder attention backend behind ``implementation`` uses ``max_seqlen``.

    The varlen kernels (flash_attn_2/3, ...) take the longest segment as a host int, and compute it themselves
    (one host sync) when given None; a tower reads it once per forward, not once per layer, for those only.
    ``eager``, ``sdpa`` and ``flex`` don't use it. Raises ``ValueError`` as `backend_for_implementation` does.
    """
    return backend_for_implementation(implementation) not in ("eager", "sdpa", "flex")


__all__ = ["backend_for_implementation", "encoder_attention", "needs_max_seqlen"]
