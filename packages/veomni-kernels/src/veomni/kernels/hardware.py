"""What the current process can run kernels on: device type, compute capability, Triton interpreter mode."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import attrs
import torch


@attrs.frozen(kw_only=True)
class Hardware:
    """The accelerator kernels will run on.

    Attributes:
        device_type: ``"cuda"``, ``"npu"`` or ``"cpu"``.
        capability: CUDA compute capability ``(major, minor)``; None off CUDA.
        triton_interpret: Triton kernels run through Triton's CPU interpreter (``TRITON_INTERPRET=1``).
    """

    device_type: str = attrs.field(validator=attrs.validators.in_(("cuda", "npu", "cpu")))
    capability: tuple[int, int] | None = None
    triton_interpret: bool = False

    def describe(self) -> str:
        if self.device_type == "cuda":
            return f"cuda (sm_{self.capability[0]}{self.capability[1]})" if self.capability else "cuda"
        suffix = " with TRITON_INTERPRET=1" if self.triton_interpret else ""
        return f"{self.device_type}{suffix}"


def detect_hardware() -> Hardware:
    """The hardware of this process: CUDA if available, else an Ascend NPU if torch_npu sees one, else CPU."""
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if torch.cuda.is_available():
        return Hardware(
            device_type="cuda", capability=torch.cuda.get_device_capability(), triton_interpret=interpret
        )
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return Hardware(device_type="npu", triton_interpret=interpret)
    return Hardware(device_type="cpu", triton_interpret=interpret)


@attrs.frozen(kw_only=True)
class Requirement:
    """What an implementation needs to run.

    Attributes:
        device_types: devices it runs on; ``"triton"`` means CUDA, or any device under the Triton interpreter.
        min_capability: lowest CUDA compute capability (e.g. ``(9, 0)`` for Hopper-only kernels).
        packages: importable top-level modules it needs (``liger_kernel``, ``flash_attn``, ``torch_npu``).
        condition: a further check run once the above are met (e.g. a package version known to compute wrong
            results on this GPU); returns why it fails, or None. It may import the packages it checks.
    """

    device_types: tuple[str, ...]
    min_capability: tuple[int, int] | None = None
    packages: tuple[str, ...] = ()
    condition: Callable[[Hardware], str | None] | None = None

    def unmet(self, hw: Hardware) -> str | None:
        """Why this requirement fails on ``hw`` (a sentence), or None when it is met."""
        devices = set(self.device_types)
        runs_here = hw.device_type in devices or ("triton" in devices and (hw.device_type == "cuda" or hw.triton_interpret))
        if not runs_here:
            wanted = ", ".join(
                "cuda (or any device with TRITON_INTERPRET=1)" if d == "triton" else d for d in self.device_types
            )
            return f"needs {wanted}; this process has {hw.describe()}"
        if self.min_capability and hw.device_type == "cuda" and hw.capability and hw.capability < self.min_capability:
            need = f"sm_{self.min_capability[0]}{self.min_capability[1]}"
            return f"needs compute capability >= {need}; this GPU is {hw.describe()}"
        missing = [p for p in self.packages if importlib.util.find_spec(p) is None]
        if missing:
            return f"needs the package(s) {missing}, which are not installed"
        return self.condition(hw) if self.condition is not None else None


ANYWHERE = Requirement(device_types=("cpu", "cuda", "npu"))
TRITON = Requirement(device_types=("triton",))
