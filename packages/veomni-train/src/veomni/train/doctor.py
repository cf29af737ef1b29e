"""``veomni-doctor``: what this machine has (devices, packages) and which kernel backends can run here, and why not."""

from __future__ import annotations

import importlib.metadata
import platform
import sys

import torch

from veomni.kernels import DEFAULT_BACKENDS, KERNELS, detect_hardware

PACKAGES = (
    "torch", "transformers", "triton", "liger-kernel", "flash-attn", "flash-attn-3", "safetensors", "tokenizers",
    "diffusers", "tensorboard", "wandb", "veomni-core", "veomni-kernels", "veomni-models", "veomni-train",
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
    lines += [f"{name:<16} {_version(name)}" for name in PACKAGES]
    hw = detect_hardware()
    lines += ["", f"kernel backends on {hw.device_type} (default marked *):"]
    for op in KERNELS.ops():
        default = DEFAULT_BACKENDS.get(op, {}).get(hw.device_type)
        for backend in KERNELS.backends(op):
            problem = KERNELS.backend_problem(op, backend, hw)
            mark = "*" if backend == default and problem is None else " "
            status = "ok" if problem is None else f"unavailable: {problem}"
            lines.append(f"  {mark} {op:<20} {backend:<14} {status}")
    return "\n".join(lines)


def main() -> int:
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
