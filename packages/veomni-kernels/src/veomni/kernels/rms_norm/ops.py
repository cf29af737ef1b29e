"""RMSNorm's Triton kernels as torch custom ops (``veomni::rms_norm_fwd``, ``veomni::add_rms_norm_fwd``,
``veomni::rms_norm_bwd``), so that ``torch.compile(block, fullgraph=True)`` traces through them.

`triton_impl`'s public functions take these ops only while dynamo traces (``torch.compiler.is_compiling()``);
eager calls keep the `torch.autograd.Function`, which skips the dispatcher. Both paths launch the same kernels
through `triton_impl.forward_rows` / `triton_impl.backward_rows` with the default launch shape, so their
results are bitwise equal. The ops are opaque to inductor (``custom_op``, not ``triton_op``): under
``TRITON_INTERPRET=1`` a ``triton_op`` would have to run the interpreter on fake tensors, and the same
registration must serve the CPU tests and the GPU.

No Python annotations module import here: ``torch.library`` reads the type hints at registration.
"""

import math
from typing import Any

import torch
from torch import Tensor

from veomni.kernels.rms_norm import triton_impl as _impl

__all__ = ["add_rms_norm_fwd", "rms_norm_bwd", "rms_norm_fwd"]


def _cfg(x: Tensor) -> "_impl.LaunchConfig":
    return _impl.default_config(x.shape[-1])


def _out_dtype(x: Tensor, weight: Tensor | None, mode: int) -> torch.dtype:
    if mode == _impl._STANDARD and weight is not None:
        return torch.promote_types(x.dtype, weight.dtype)
    return x.dtype


def _no_dw(x: Tensor, weight: Tensor | None) -> Tensor:
    # Schemas cannot return an optional tensor: "no weight gradient" is an empty one.
    return x.new_empty((0,), dtype=weight.dtype if weight is not None else x.dtype)


@torch.library.custom_op("veomni::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x: Tensor, weight: Tensor | None, eps: float, mode: int) -> tuple[Tensor, Tensor]:
    """RMSNorm forward of ``mode`` (0 standard, 1 offset, 2 unweighted).

    ``x [..., H]``, ``weight [H]`` (None for unweighted). Returns ``(y [..., H], rstd fp32 [N])``, ``N`` the
    number of rows; ``y`` contiguous in ``promote_types(x, weight)`` (standard) or ``x.dtype``.
    """
    y, _, _, rstd = _impl.forward_rows(x, weight, None, eps, mode, _cfg(x))
    return y, rstd


@rms_norm_fwd.register_fake
def _(x: Tensor, weight: Tensor | None, eps: float, mode: int) -> tuple[Tensor, Tensor]:
    rows = math.prod(x.shape[:-1])
    return x.new_empty(x.shape, dtype=_out_dtype(x, weight, mode)), x.new_empty((rows,), dtype=torch.float32)


@torch.library.custom_op("veomni::add_rms_norm_fwd", mutates_args=())
def add_rms_norm_fwd(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Residual add + standard RMSNorm. ``x``, ``residual`` ``[..., H]`` of one dtype; ``weight [H]``.

    Returns ``(y, z = x + residual, rstd fp32 [N])``; ``y`` and ``z`` contiguous.
    """
    y, z, _, rstd = _impl.forward_rows(x, weight, residual, eps, _impl._STANDARD, _cfg(x))
    assert z is not None  # forward_rows returns x + residual when given a residual
    return y, z, rstd


@add_rms_norm_fwd.register_fake
def _(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    rows = math.prod(x.shape[:-1])
    y = x.new_empty(x.shape, dtype=_out_dtype(x, weight, _impl._STANDARD))
    return y, x.new_empty(x.shape), x.new_empty((rows,), dtype=torch.float32)


@torch.library.custom_op("veomni::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(
    dy: Tensor, dz: Tensor | None, x: Tensor, weight: Tensor | None, rstd: Tensor, mode: int, compute_dw: bool
) -> tuple[Tensor, Tensor]:
    """RMSNorm backward. ``x [..., H]`` is what was normalised (``x + residual`` for the fused add); ``dz``
    the gradient of ``x + residual`` (None without a residual); ``rstd`` fp32 ``[N]`` from the forward.

    Returns ``(dx [..., H] in x.dtype, dw)``: ``dw [H]`` in ``weight.dtype`` when ``compute_dw``, else ``[0]``.
    """
    w = weight.contiguous() if weight is not None else None
    dx, dw = _impl.backward_rows(dy, dz, _impl._rows(x), w, rstd, mode, _cfg(x), compute_dw, x.shape)
    return dx, dw if dw is not None else _no_dw(x, weight)


@rms_norm_bwd.register_fake
def _(
    dy: Tensor, dz: Tensor | None, x: Tensor, weight: Tensor | None, rstd: Tensor, mode: int, compute_dw: bool
) -> tuple[Tensor, Tensor]:
    dw = weight.new_empty(weight.shape) if compute_dw and weight is not None else _no_dw(x, weight)
    return x.new_empty(x.shape), dw


def _setup_norm(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    x, weight, _eps, mode = inputs
    _y, rstd = output
    ctx.save_for_backward(x, weight, rstd)
    ctx.mode = mode
    ctx.mark_non_differentiable(rstd)


def _backward_norm(ctx: Any, dy: Tensor, _drstd: Tensor | None) -> tuple[Tensor, Tensor | None, None, None]:
    x, weight, rstd = ctx.saved_tensors
    want_dw = weight is not None and ctx.needs_input_grad[1]
    dx, dw = rms_norm_bwd(dy, None, x, weight, rstd, ctx.mode, want_dw)
    return dx, dw if want_dw else None, None, None


def _setup_add(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor, Tensor]) -> None:
    _x, _residual, weight, _eps = inputs
    _y, z, rstd = output
    ctx.save_for_backward(z, weight, rstd)
    ctx.mark_non_differentiable(rstd)


def _backward_add(
    ctx: Any, dy: Tensor, dz: Tensor | None, _drstd: Tensor | None
) -> tuple[Tensor, Tensor | None, Tensor | None, None]:
    z, weight, rstd = ctx.saved_tensors
    want_dw = ctx.needs_input_grad[2]
    dx, dw = rms_norm_bwd(dy, dz, z, weight, rstd, _impl._STANDARD, want_dw)
    # d(x + residual)/dx = d/dresidual = 1: both inputs get the same gradient, as in the autograd function.
    return dx, dx if ctx.needs_input_grad[1] else None, dw if want_dw else None, None


rms_norm_fwd.register_autograd(_backward_norm, setup_context=_setup_norm)
add_rms_norm_fwd.register_autograd(_backward_add, setup_context=_setup_add)


def apply(
    x: Tensor, weight: Tensor | None, residual: Tensor | None, eps: float, mode: int
) -> Tensor | tuple[Tensor, Tensor]:
    """The custom-op form of `triton_impl._apply` (default launch shape): ``y``, or ``(y, x + residual)``."""
    if residual is not None:
        y, z, _ = add_rms_norm_fwd(x, residual, weight, float(eps))
        return y, z
    y_rstd: tuple[Tensor, Tensor] = rms_norm_fwd(x, weight, float(eps), mode)
    return y_rstd[0]
