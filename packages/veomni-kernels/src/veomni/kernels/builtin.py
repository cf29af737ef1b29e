"""veomni's own registrations: every (op, variant, backend) shipped with veomni-kernels.

Each row names the implementation as ``"module:function"``; the module is imported only when a config selects
it, so importing veomni.kernels never imports triton, liger-kernel or flash-attn.
"""

from __future__ import annotations

import importlib

from veomni.kernels.hardware import ANYWHERE, Requirement
from veomni.kernels.registry import KERNELS, KernelFn

CUDA = Requirement(device_types=("cuda",))
LIGER = Requirement(device_types=("cuda",), packages=("liger_kernel",))
NPU = Requirement(device_types=("npu",), packages=("torch_npu",))

_K = "veomni.kernels"
BUILTIN: list[tuple[str, str, str, str, Requirement]] = [
    # op, variant, backend, implementation, requirement
    ("cross_entropy", "causal", "eager", f"{_K}.cross_entropy.eager:causal_lm_cross_entropy", ANYWHERE),
    ("cross_entropy", "seq_cls", "eager", f"{_K}.cross_entropy.eager:sequence_classification_cross_entropy", ANYWHERE),
    ("moe_experts", "swiglu", "eager", f"{_K}.moe_experts.eager:experts_swiglu", ANYWHERE),
]


def _importer(target: str) -> KernelFn:
    module_name, _, attr = target.partition(":")

    def factory() -> KernelFn:
        return getattr(importlib.import_module(module_name), attr)

    return factory


def _npu_unavailable(op: str, variant: str) -> KernelFn:
    def factory() -> KernelFn:
        # Only reachable when torch_npu imports (the requirement checks it), and veomni ships no NPU kernels
        # yet: say so instead of running something else.
        raise NotImplementedError(
            f"{op}/{variant} on 'npu' is declared for config validation, but veomni ships no torch_npu kernel "
            "for it yet; choose 'eager'"
        )

    return factory


def register_builtin() -> None:
    """Register every row of `BUILTIN`, plus an ``npu`` declaration for each op that has one in its defaults."""
    for op, variant, backend, target, requires in BUILTIN:
        KERNELS.register(op, variant, backend, _importer(target), requires, description=target)
    for op, variant in sorted({(op, variant) for op, variant, *_ in BUILTIN}):
        if op in _NPU_DECLARED:
            KERNELS.register(op, variant, "npu", _npu_unavailable(op, variant), NPU, description="torch_npu")


_NPU_DECLARED = ("attention", "cross_entropy", "rms_norm", "rope", "swiglu")
