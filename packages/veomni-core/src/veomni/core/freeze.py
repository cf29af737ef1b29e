"""Freezing sub-modules by FQN glob: frozen parameters take no gradient, no optimizer state and no reduction.

Freeze before FSDP2 wraps the model: `fully_shard` copies each parameter's ``requires_grad`` into its shards, and
a unit whose parameters are all frozen then reduce-scatters nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from torch import nn

from veomni.core.fqn import fqn_matches

log = logging.getLogger("veomni.core")


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
    named: set[str] = set()  # the parameter names the patterns reach
    for pattern in patterns:
        found = {}
        for name, module in model.named_modules():
            if name and fqn_matches(pattern, name):
                for local, p in module.named_parameters(remove_duplicate=False):
                    found[id(p)] = p
                    named.add(f"{name}.{local}")
        for name, p in model.named_parameters(remove_duplicate=False):
            if fqn_matches(pattern, name):
                found[id(p)] = p
                named.add(name)
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
    tied = [n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in frozen and n not in named]
    if tied:
        # One tensor under two names (tied embeddings and LM head): freezing one freezes the other.
        log.warning("%s: %s frozen too: tied to a frozen parameter (the same tensor)", where, tied)
    return [name for name, p in model.named_parameters() if id(p) in frozen]
