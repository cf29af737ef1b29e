"""veomni.kernels: one kernel registry, `OpsConfig`, and kernels as plain tensor functions.

Importing this package registers veomni's own implementations (lazily: no triton, liger-kernel or flash-attn
import happens until a config selects them). Third-party backends call ``KERNELS.register`` at import time.
"""

from veomni.kernels.builtin import register_builtin
from veomni.kernels.config import DEFAULT_BACKENDS, Kernels, OpsConfig, op_fields, resolve_kernels
from veomni.kernels.hardware import Hardware, Requirement, detect_hardware
from veomni.kernels.registry import KERNELS, KernelRegistry, KernelSpec

register_builtin()

__all__ = [
    "DEFAULT_BACKENDS",
    "KERNELS",
    "Hardware",
    "KernelRegistry",
    "KernelSpec",
    "Kernels",
    "OpsConfig",
    "Requirement",
    "detect_hardware",
    "op_fields",
    "resolve_kernels",
]
