"""How a built model carries its kernel set: one `Kernels` object, attached to every submodule.

Generated modeling files read ``self.veomni_kernels`` in their patched forwards; a module without one (or whose
op is configured ``eager``) runs the untouched upstream code. Attaching per instance lets two models in one
process use different kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from veomni.kernels import Kernels

ATTR = "veomni_kernels"


def attach_kernels(model: nn.Module, kernels: Kernels) -> nn.Module:
    """Give ``model`` and all its submodules the resolved kernel set; returns ``model``."""
    if not isinstance(kernels, Kernels):
        raise TypeError(f"attach_kernels expects veomni.kernels.Kernels, got {type(kernels).__name__}")
    for module in model.modules():
        setattr(module, ATTR, kernels)
    return model


def apply_rope(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    upstream: Callable[..., tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE through ``module``'s kernel set, or the model's own ``upstream`` function when it has none / eager.

    Args:
        query: ``[B, Hq, S, D]``; key: ``[B, Hkv, S, D]``; cos, sin: ``[B, S, D]`` (HF's position embeddings).
    Returns:
        the rotated ``(query, key)``, same shapes and dtype.
    """
    kernels = getattr(module, ATTR, None)
    if kernels is not None and kernels.config.rope != "eager":
        return kernels.get("rope", "full")(query, key, cos, sin)
    return upstream(query, key, cos, sin)
