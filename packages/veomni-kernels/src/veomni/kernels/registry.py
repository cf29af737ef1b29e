"""The kernel registry: (op, semantic variant, backend) -> a lazily built implementation with a requirement.

Variants keep different maths apart (RMSNorm ``standard`` casts before the weight multiply, ``offset`` scales by
``1 + w`` in fp32), so two implementations are interchangeable only within one (op, variant). ``eager`` is the
plain-PyTorch reference of every (op, variant) and runs anywhere. Third-party backends call `register` at
import time; nothing else mutates the registry.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable

import attrs

from veomni.kernels.hardware import Hardware, Requirement

KernelFn = Callable[..., object]


@attrs.frozen(kw_only=True)
class KernelSpec:
    """One registered implementation.

    Attributes:
        op, variant, backend: the key.
        factory: builds the callable on first use (imports heavy packages lazily).
        requires: hardware and packages it needs.
        description: a line for listings.
        capabilities: optional features the implementation computes (attention: ``softcap``, ``sinks``,
            ``sliding_window``); a model that needs one is refused on a backend without it.
    """

    op: str
    variant: str
    backend: str
    factory: Callable[[], KernelFn]
    requires: Requirement
    description: str = ""
    capabilities: frozenset[str] = frozenset()


class KernelRegistry:
    """Import-time registry of kernel implementations. Use the module-level `KERNELS`."""

    def __init__(self) -> None:
        self._specs: dict[tuple[str, str, str], KernelSpec] = {}

    def register(
        self,
        op: str,
        variant: str,
        backend: str,
        factory: Callable[[], KernelFn],
        requires: Requirement,
        description: str = "",
        capabilities: frozenset[str] = frozenset(),
    ) -> KernelSpec:
        """Add an implementation; registering the same key twice is an error (no silent override)."""
        key = (op, variant, backend)
        if key in self._specs:
            raise ValueError(f"kernel {op}/{variant} for backend {backend!r} is already registered")
        spec = KernelSpec(
            op=op,
            variant=variant,
            backend=backend,
            factory=factory,
            requires=requires,
            description=description,
            capabilities=frozenset(capabilities),
        )
        self._specs[key] = spec
        return spec

    def specs(self) -> list[KernelSpec]:
        """Every registered implementation, sorted by key."""
        return [self._specs[k] for k in sorted(self._specs)]

    def ops(self) -> list[str]:
        return sorted({op for op, _, _ in self._specs})

    def variants(self, op: str) -> list[str]:
        self._require_op(op)
        return sorted({v for o, v, _ in self._specs if o == op})

    def backends(self, op: str) -> list[str]:
        self._require_op(op)
        return sorted({b for o, _, b in self._specs if o == op})

    def get(self, op: str, variant: str, backend: str) -> KernelSpec:
        """The spec for a key, or a ``KeyError`` that lists what exists."""
        spec = self._specs.get((op, variant, backend))
        if spec is None:
            self._require_op(op)
            if variant not in self.variants(op):
                raise KeyError(f"{op} has no variant {variant!r}{_suggest(variant, self.variants(op))}")
            have = sorted(b for o, v, b in self._specs if (o, v) == (op, variant))
            raise KeyError(f"{op}/{variant} has no {backend!r} implementation; registered backends: {have}")
        return spec

    def backend_problem(self, op: str, backend: str, hw: Hardware) -> str | None:
        """Why ``backend`` cannot run ``op`` on ``hw`` (all its variants must run), or None if it can."""
        specs = [s for (o, _, b), s in self._specs.items() if (o, b) == (op, backend)]
        if not specs:
            return f"{backend!r} is not a backend of {op}"
        for spec in specs:
            problem = spec.requires.unmet(hw)
            if problem:
                return f"{op}/{spec.variant} on {backend!r} {problem}"
        return None

    def capabilities(self, op: str, backend: str) -> frozenset[str]:
        """The capabilities every variant of ``op`` on ``backend`` has (an unknown backend: ``KeyError``)."""
        specs = [s for (o, _, b), s in self._specs.items() if (o, b) == (op, backend)]
        if not specs:
            self._require_op(op)
            raise KeyError(f"{backend!r} is not a backend of {op}; registered: {self.backends(op)}")
        return frozenset.intersection(*(s.capabilities for s in specs))

    def _require_op(self, op: str) -> None:
        if op not in self.ops():
            raise KeyError(f"no kernel op {op!r}{_suggest(op, self.ops())}; registered ops: {self.ops()}")


def _suggest(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


KERNELS = KernelRegistry()
