"""The output head as an FSDP unit of its own (`veomni.core.fsdp.FSDPPolicy.head`), and `forward_through`.

An untied LM head is as large as the embedding. As its own unit it is gathered while the blocks compute and its
gradient is reduce-scattered as soon as the loss's backward is done, instead of with the root's after the whole
backward. A fused linear-cross-entropy reads its weight without calling it; `forward_through` runs such code as a
forward of the unit, so FSDP gathers the parameters and reduces their gradients as for a call.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

__all__ = ["forward_through"]

# The method `forward_through` adds to an FSDP unit and registers as one of its forward methods.
_THROUGH = "_veomni_forward_through"
_R = TypeVar("_R")


def _prefetch_head(first_block: FSDPModule, head: FSDPModule) -> None:
    # FSDP2 issues a unit's all-gather when its forward starts, which overlaps earlier compute only when the host
    # runs ahead of the GPU; host syncs in the step (EP's split sizes) stop that. Gathered from the first block
    # on, the head's parameters (as large as the embedding's) arrive under the whole forward. It stays gathered
    # until backward has used it (no reshard after forward), so this moves no peak.
    first_block.set_modules_to_forward_prefetch([head])


def _check_head(
    model: nn.Module, fqn: str | None, blocks: list[str], expert_fqns: list[str]
) -> nn.Module | None:
    """The head module `FSDPPolicy.head` names, after checking it can be a unit of its own."""
    if fqn is None:
        return None
    try:
        head = model.get_submodule(fqn)
    except AttributeError:
        raise ValueError(
            f"apply_fsdp2: FSDPPolicy.head={fqn!r} names no submodule of {type(model).__name__}"
        ) from None
    inside = [
        b for b in [*blocks, *expert_fqns] if fqn == b or fqn.startswith(b + ".") or b.startswith(fqn + ".")
    ]
    if inside:
        raise ValueError(
            f"apply_fsdp2: FSDPPolicy.head={fqn!r} overlaps the block/expert units {inside[:3]}; the head must be "
            "a module of its own, outside every block"
        )
    own = {id(p) for p in head.parameters()}
    if not own:
        raise ValueError(f"apply_fsdp2: FSDPPolicy.head={fqn!r} has no parameters to shard")
    shared = [
        name
        for name, p in model.named_parameters(remove_duplicate=False)
        if id(p) in own and not name.startswith(fqn + ".")
    ]
    if shared:
        raise ValueError(
            f"apply_fsdp2: FSDPPolicy.head={fqn!r} shares parameters with {shared[:3]} (tied embeddings?); a "
            "tied head must stay in the root unit: set FSDPPolicy.head=None"
        )
    return head


def forward_through(module: nn.Module, fn: Callable[..., _R], *args: Any, **kwargs: Any) -> _R:
    """``fn(module, *args, **kwargs)``, run as a forward of ``module``.

    For code that reads a module's parameters without calling it (a fused linear-cross-entropy takes
    ``lm_head.weight`` and the hidden states): when ``module`` is an FSDP unit of its own, FSDP then gathers its
    parameters before ``fn``, registers the backward hooks on ``fn``'s tensor inputs and outputs, and
    reduce-scatters the parameters' gradients when the backward through ``fn`` is done -- as for
    ``module(...)``. Any other module (a plain one, or one inside a larger unit) is passed to ``fn`` as is.

    Args:
        module: the module whose parameters ``fn`` reads.
        fn: called as ``fn(module, *args, **kwargs)``; tensors that need gradients must be in ``args`` or
            ``kwargs`` (FSDP finds them there), not captured by ``fn``.
    Returns:
        what ``fn`` returns.
    """
    if not isinstance(module, FSDPModule):
        return fn(module, *args, **kwargs)
    if not hasattr(module, _THROUGH):
        # A bound method on this instance, registered once: FSDP runs its pre-/post-forward around each call.
        setattr(module, _THROUGH, types.MethodType(_call_with_self, module))
        register_fsdp_forward_method(module, _THROUGH)
    result: _R = getattr(module, _THROUGH)(fn, *args, **kwargs)
    return result


def _call_with_self(self: nn.Module, fn: Callable[..., _R], *args: Any, **kwargs: Any) -> _R:
    return fn(self, *args, **kwargs)
