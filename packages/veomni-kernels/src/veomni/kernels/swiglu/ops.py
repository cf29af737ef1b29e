"""SwiGLU's Triton kernels as torch custom ops (``veomni::swiglu_fwd``, ``veomni::swiglu_bwd``), so that
``torch.compile(fullgraph=True)`` traces through them.

`triton_impl.swiglu_triton` takes these ops only while dynamo traces; eager calls keep the
`torch.autograd.Function`. Both run `triton_impl.forward_rows` / `triton_impl.backward_rows`, so results are
bitwise equal, and the backward still keeps only ``gate`` and ``up`` (``silu(gate)`` is recomputed).
"""

from typing import Any

import torch
from torch import Tensor

from veomni.kernels.swiglu import triton_impl as _impl

__all__ = ["swiglu_bwd", "swiglu_fwd"]


@torch.library.custom_op("veomni::swiglu_fwd", mutates_args=())
def swiglu_fwd(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` for ``gate``, ``up`` ``[..., I]`` of one dtype; returns a new contiguous ``[..., I]``."""
    return _impl.forward_rows(_impl._rows(gate), _impl._rows(up)).view(gate.shape)


@swiglu_fwd.register_fake
def _(gate: Tensor, up: Tensor) -> Tensor:
    return gate.new_empty(gate.shape)


@torch.library.custom_op("veomni::swiglu_bwd", mutates_args=())
def swiglu_bwd(grad_out: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """Gradients of ``silu(gate) * up``: returns new contiguous ``(d gate, d up)``, ``[..., I]`` each."""
    dg, du = _impl.backward_rows(grad_out, _impl._rows(gate), _impl._rows(up))
    return dg.view(gate.shape), du.view(gate.shape)


@swiglu_bwd.register_fake
def _(grad_out: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    gate, up = inputs
    ctx.save_for_backward(gate, up)


def _backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, Tensor | None]:
    gate, up = ctx.saved_tensors
    dg, du = swiglu_bwd(grad_out, gate, up)
    return (dg if ctx.needs_input_grad[0] else None), (du if ctx.needs_input_grad[1] else None)


swiglu_fwd.register_autograd(_backward, setup_context=_setup)
