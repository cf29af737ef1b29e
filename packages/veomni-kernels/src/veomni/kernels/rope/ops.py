"""RoPE's Triton kernel as a torch custom op (``veomni::rope``), so that ``torch.compile(fullgraph=True)``
traces through it.

`triton_impl.apply_rope_triton` takes this op only while dynamo traces; eager calls keep the
`torch.autograd.Function`. Both run `triton_impl._launch`, so results are bitwise equal. The backward is the
same op with ``backward=True`` (the transposed rotation), so one registration serves both directions.
"""

from typing import Any

import torch
from torch import Tensor

from veomni.kernels.rope import triton_impl as _impl

__all__ = ["rope"]


@torch.library.custom_op("veomni::rope", mutates_args=())
def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> tuple[Tensor, Tensor]:
    """Rotate ``q [B, Hq, S, D]`` and ``k [B, Hkv, S, D]`` by ``cos``/``sin`` (``[B, S, R]``, ``[1, S, R]`` or
    ``[S, R]``); ``backward=True`` applies the transposed rotation (the gradient map).

    Returns new tensors laid out like ``q`` and ``k`` (``empty_like``), fp32 math rounded once to their dtype.
    """
    q_out, k_out = _impl._launch(q, k, cos, sin, backward=backward)
    assert q_out is not None and k_out is not None  # _launch returns an output for each given input
    return q_out, k_out


@rope.register_fake
def _(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> tuple[Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    _q, _k, cos, sin, backward = inputs
    ctx.save_for_backward(cos, sin)
    ctx.backward = backward


def _backward(
    ctx: Any, grad_q: Tensor, grad_k: Tensor
) -> tuple[Tensor | None, Tensor | None, None, None, None]:
    cos, sin = ctx.saved_tensors
    # The map is linear in q and k; cos/sin are constants (as in the autograd function: no gradient).
    dq, dk = rope(grad_q, grad_k, cos, sin, not ctx.backward)
    return (
        (dq if ctx.needs_input_grad[0] else None),
        (dk if ctx.needs_input_grad[1] else None),
        None,
        None,
        None,
    )


rope.register_autograd(_backward, setup_context=_setup)
