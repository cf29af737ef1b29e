"""Tile configurations of the `moe_experts` Triton kernels: a fixed table, no autotuning at first call.

Kinds (one per GEMM of the fwd+bwd):
- ``gate_up``: ``[N, H] @ W1[e]^T`` with the SwiGLU epilogue (two accumulators, so the tile is BLOCK_M x 2*BLOCK_N);
- ``down``: ``[N, I] @ W2[e]^T`` (short reduction, K = I);
- ``down_dgrad``: ``[N, H] @ W2[e]`` then the SwiGLU backward: fused into the GEMM's epilogue, or with
  ``SPLIT`` a plain GEMM writing ``dh [N, I]`` and one elementwise pass (the fused epilogue keeps ``acc``,
  ``g`` and ``u`` live at once, which costs registers);
- ``up_dgrad``: ``[N, 2I] @ W1[e]``;
- ``wgrad_down`` / ``wgrad_gate_up``: ``g[rows_e]^T @ x[rows_e]`` per expert for ``down_proj`` (``dy^T h``,
  ``[H, I]``) and ``gate_up_proj`` (``d[gate, up]^T x``, ``[2I, H]``); BLOCK_M x BLOCK_N output tile, reduction
  over the expert's rows.

The sm_90 bf16/fp16 rows were chosen by ``tools/bench/bench_moe.py --tune`` on an H100 (torch 2.11, Triton
3.6) at the Qwen3-30B-A3B shape (E=128, k=8, H=2048, I=768, 16k tokens; 74 candidates, the fastest per kernel;
notebook/benchmarks-log.md, 2026-11-21). Every shape uses the same tiles: the sweep over E in {8..256} and 4k-32k tokens
in that entry ran with them. No autotuning happens at run time, so the first call compiles exactly six GEMM
kernels (plus two small ones) and timings never depend on what ran first. Other GPUs get an untuned generic
table; fp32 uses small tiles (its dots run in IEEE fp32, not on the tensor cores); Triton's CPU interpreter gets
small tiles so the tests stay fast.
"""

from __future__ import annotations

import os

import torch

# One kernel kind's launch config: BLOCK_M/N/K, num_warps, num_stages (ints) and SPLIT (a bool).
KernelConfig = dict[str, int]

KINDS = ("gate_up", "down", "down_dgrad", "up_dgrad", "wgrad_down", "wgrad_gate_up")


def _cfg(bm: int, bn: int, bk: int, warps: int, stages: int, split: bool = False) -> KernelConfig:
    return {
        "BLOCK_M": bm,
        "BLOCK_N": bn,
        "BLOCK_K": bk,
        "num_warps": warps,
        "num_stages": stages,
        "SPLIT": split,
    }


SM90_HALF: dict[str, KernelConfig] = {
    "gate_up": _cfg(128, 128, 64, 8, 4),
    "down": _cfg(128, 256, 64, 8, 4),
    "down_dgrad": _cfg(128, 256, 64, 8, 4, split=True),
    "up_dgrad": _cfg(128, 256, 64, 8, 4),
    "wgrad_down": _cfg(128, 128, 32, 4, 5),
    "wgrad_gate_up": _cfg(128, 128, 32, 4, 5),
}
GENERIC_HALF: dict[str, KernelConfig] = {
    kind: _cfg(128, 64, 32, 4, 3, split=kind == "down_dgrad") for kind in KINDS
}
FP32: dict[str, KernelConfig] = {kind: _cfg(64, 64, 32, 4, 2) for kind in KINDS}
INTERPRETER: dict[str, KernelConfig] = {kind: _cfg(32, 32, 32, 4, 1) for kind in KINDS}


def interpreting() -> bool:
    """True when Triton kernels run through the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernel_config(kind: str, dtype: torch.dtype, device: torch.device) -> KernelConfig:
    """The tile config for one kernel kind, activation dtype and device."""
    if kind not in KINDS:
        raise KeyError(f"unknown moe_experts kernel kind {kind!r}; kinds: {list(KINDS)}")
    if device.type != "cuda":
        return INTERPRETER[kind]
    if dtype == torch.float32:
        return FP32[kind]
    if torch.cuda.get_device_capability(device)[0] == 9:
        return SM90_HALF[kind]
    return GENERIC_HALF[kind]
