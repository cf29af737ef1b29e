"""Which tokens of an SP slice are real: the row's length before SP padding, for code the model calls without it.

Ulysses SP pads a row to a multiple of the SP size before slicing it (`veomni.core.sp.padding`). Attention never sees
the padding (it is a packed segment of its own) and the loss ignores it (labels -100), but anything that pools over
*all* tokens of the slice -- the MoE routers' load-balancing statistics above all -- would count those few tokens,
which one process never sees. The trainer knows the unpadded length per micro-batch; the model's loss code is
called by HF's forward with no room for it. `use_real_length` hands it over for the duration of the forward, as
`veomni.core.parallel_state.use_parallel_state` does for the mesh, and `real_token_mask` turns it into a mask of this
rank's slice.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

__all__ = ["real_token_mask", "use_real_length"]

_REAL_LENGTH: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "veomni_sp_real_length", default=None
)


@contextlib.contextmanager
def use_real_length(length: int | None) -> Iterator[None]:
    """Inside the block, the current row holds ``length`` real tokens before SP padding (None: no padding known)."""
    if length is not None and (not isinstance(length, int) or length < 1):
        raise ValueError(f"use_real_length expects a positive int token count or None, got {length!r}")
    token = _REAL_LENGTH.set(length)
    try:
        yield
    finally:
        _REAL_LENGTH.reset(token)


def real_token_mask(local_length: int, sp_rank: int, device: torch.device | str) -> torch.Tensor | None:
    """``[local_length]`` bool, True where this rank's slice holds a real token; None when every token is real.

    Rank ``r`` holds positions ``[r * local_length, (r + 1) * local_length)`` of the padded row (the padding sits at
    its end). None outside `use_real_length` or when this slice ends before the real length does; all False when
    the slice is padding only (a row shorter than the SP size).
    """
    length = _REAL_LENGTH.get()
    start = sp_rank * local_length
    if length is None or start + local_length <= length:
        return None
    # arange + compare on the device: a host mask would need a copy, and this runs inside the training step.
    return torch.arange(start, start + local_length, device=device) < length
