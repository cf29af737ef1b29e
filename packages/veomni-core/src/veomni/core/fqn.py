"""Glob patterns over fully qualified module/parameter names (``layers.*.mlp.experts.w1``).

``*`` matches any run of characters inside one name component: it never crosses a ``.``, so ``layers.1.*``
cannot match ``layers.10.w`` and ``layers.*.w`` does not match ``layers.1.0.w``. A pattern matches whole names.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from torch import nn


@functools.lru_cache(maxsize=1024)
def compile_fqn_glob(pattern: str) -> re.Pattern[str]:
    """The regex equivalent of ``pattern`` (use ``.fullmatch``)."""
    return re.compile("[^.]*".join(re.escape(piece) for piece in pattern.split("*")))


def fqn_matches(pattern: str, fqn: str) -> bool:
    """Whether the whole of ``fqn`` matches the glob ``pattern``."""
    return compile_fqn_glob(pattern).fullmatch(fqn) is not None


def pattern_tuple(value: object) -> tuple[Any, ...]:
    """``value`` (a sequence of FQN patterns) as a tuple; a bare string is refused (it would become letters)."""
    if isinstance(value, str):
        raise TypeError(f"FSDPPolicy.block_patterns must be a sequence of strings, got the string {value!r}")
    return tuple(value)  # type: ignore[arg-type]


def match_blocks(
    model: nn.Module, patterns: tuple[str, ...], expert_fqns: list[str], caller: str = "apply_fsdp2"
) -> list[str]:
    """The FQNs of ``model``'s modules matching ``patterns`` (the blocks FSDP2, checkpointing and compilation
    wrap), in module order. Raises ValueError for a pattern matching nothing, nested blocks, or a block that is
    (inside) one of ``expert_fqns``; ``caller`` names the entry point in the message."""
    hits = {p: 0 for p in patterns}
    blocks: list[str] = []
    for fqn, _ in model.named_modules():
        matched = [p for p in patterns if fqn and fqn_matches(p, fqn)]
        for p in matched:
            hits[p] += 1
        if matched:
            blocks.append(fqn)
    missing = [p for p, n in hits.items() if n == 0]
    if missing:
        sample = [fqn for fqn, _ in model.named_modules() if fqn][:10]
        raise ValueError(
            f"{caller}: block pattern(s) {missing} matched no module of {type(model).__name__} ('*' "
            f"matches within one FQN component); its modules include {sample}"
        )
    for i, outer in enumerate(blocks):
        for inner in blocks[i + 1 :]:
            if inner.startswith(outer + "."):
                raise ValueError(
                    f"{caller}: block {inner!r} is nested in block {outer!r}; blocks must not nest"
                )
    for block in blocks:
        for expert in expert_fqns:
            if expert == block or block.startswith(expert + "."):
                raise ValueError(
                    f"{caller}: block pattern matched {block!r}, which is (inside) the expert module "
                    f"{expert!r}; blocks must contain expert modules, not be them"
                )
    return blocks
