"""``veomni-doctor``: what this machine has (devices, packages) and which kernel backends can run here, and why not.

Per op it lists every registered backend with the variants it implements, whether it runs here (or the reason it
does not: device, compute capability, missing package), whether an Ascend NPU would accept it (the NPU rule:
GPU backends are rejected there), and the backend each OpsConfig field gets by default on this machine.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys

import torch

from veomni.kernels import KERNELS, OpsConfig, detect_hardware, op_fields
from veomni.kernels.config import npu_backends

# Every distribution a kernel backend or a task imports (flash-attn-4 and quack need nvidia-cutlass-dsl; the fla
# backend is flash-linear-attention's fla package on fla-core).
PACKAGES = (
    "torch", "transformers", "triton", "liger-kernel", "flash-attn", "flash-attn-3", "flash-attn-4",
    "quack-kernels", "nvidia-cutlass-dsl", "flash-linear-attention", "fla-core", "torch_npu", "safetensors",
    "tokenizers", "diffusers", "tensorboard", "wandb", "veomni-core", "veomni-kernels", "veomni-models",
    "veomni-train",
)  # fmt: skip


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def report() -> str:
    """The doctor's text: devices, package versions, and per op each backend's status on this hardware."""
    lines = [f"python {sys.version.split()[0]} on {platform.platform()}"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            lines.append(
                f"cuda:{i} {props.name}  capability {props.major}.{props.minor}  {props.total_memory / 2**30:.0f} GiB"
            )
    else:
        lines.append("no CUDA device visible to torch; CPU only")
    lines.append("")
    lines += [f"{name:<22} {_version(name)}" for name in PACKAGES]
    hw = detect_hardware()
    # Built here so a default that cannot run shows up as its fallback (OpsConfig also logs why).
    defaults = OpsConfig(hardware=hw)
    lines += ["", f"kernel backends on {hw.describe()} (the default here marked *; npu: allowed on an Ascend NPU):"]
    for op in KERNELS.ops():
        default = getattr(defaults, op, None)
        npu_ok = set(npu_backends(op)) if op in op_fields() else set()
        for backend in KERNELS.backends(op):
            problem = KERNELS.backend_problem(op, backend, hw)
            mark = "*" if backend == default else " "
            variants = ",".join(s.variant for s in KERNELS.specs() if (s.op, s.backend) == (op, backend))
            npu = "npu:ok " if backend in npu_ok else "npu:no "
            status = "ok" if problem is None else f"unavailable: {problem}"
            lines.append(f"  {mark} {op:<20} {backend:<14} {npu} [{variants}] {status}")
    lines += ["", "defaults here: " + ", ".join(f"{f}={getattr(defaults, f)}" for f in op_fields())]
    return "\n".join(lines)


def main() -> int:
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
