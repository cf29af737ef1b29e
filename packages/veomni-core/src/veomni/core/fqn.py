"""Glob patterns over fully qualified module/parameter names (``layers.*.mlp.experts.w1``).

``*`` matches any run of characters inside one name component: it never crosses a ``.``, so ``layers.1.*``
cannot match ``layers.10.w`` and ``layers.*.w`` does not match ``layers.1.0.w``. A pattern matches whole names.
"""

from __future__ import annotations

import functools
import re


@functools.lru_cache(maxsize=1024)
def compile_fqn_glob(pattern: str) -> re.Pattern[str]:
    """The regex equivalent of ``pattern`` (use ``.fullmatch``)."""
    return re.compile("[^.]*".join(re.escape(piece) for piece in pattern.split("*")))


def fqn_matches(pattern: str, fqn: str) -> bool:
    """Whether the whole of ``fqn`` matches the glob ``pattern``."""
    return compile_fqn_glob(pattern).fullmatch(fqn) is not None
