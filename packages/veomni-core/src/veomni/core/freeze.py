"""Freezing sub-modules by FQN glob: frozen parameters take no gradient, no optimizer state and no reduction.

Freeze before FSDP2 wraps the model: `fully_shard` copies each parameter's ``requires_grad`` into its shards, and
a unit whose parameters are all frozen then reduce-scatters nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from veomni.core.fqn import fqn_matches


def freeze_modules(model: nn.Module, patterns: Sequence[str], *, where: str = "freeze") -> list[str]:
    """Set ``requires_grad=False`` on every parameter of each module whose FQN matches one of ``patterns``.

    Args:
        model: the module (on any device, meta included).
        patterns: `veomni.core.fqn` globs of module names (``"model.visual"``, ``"model.layers.*.mlp"``); a
            pattern may also name a single parameter.
        where: the caller, for error messages (``"model.freeze"``).
    Returns:
        the names of the parameters frozen, in ``named_parameters`` order.
    Raises:
        ValueError: a pattern matching no module or parameter (with the model's top-level children named).
    """
    unmatched = []
    frozen: dict[int, nn.Parameter] = {}  # by identity: a tied parameter has one entry under several names
    for pattern in patterns:
        found = {
            id(p): p
            for name, module in model.named_modules()
            if name and fqn_matches(pattern, name)
            for p in module.parameters()
        }
        found |= {id(p): p for name, p in model.named_parameters() if fqn_matches(pattern, name)}
        if not found:
            unmatched.append(pattern)
        frozen |= found
    if unmatched:
        children = [name for name, _ in model.named_children()]
        raise ValueError(
            f"{where}: {unmatched} match no module or parameter of {type(model).__name__}; patterns are dotted "
            f"module names where * stands for one name component (top-level modules: {children})"
        )
    for param in frozen.values():
        param.requires_grad_(False)
    return [name for name, p in model.named_parameters() if id(p) in frozen]
