"""veomni's own registrations: every (op, variant, backend) shipped with veomni-kernels.

Each row names the implementation as ``"module:function"``; the module is imported only when a config selects
it, so importing veomni.kernels never imports triton, liger-kernel or flash-attn.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
from collections.abc import Callable

from veomni.kernels.attention.external import flash_2_problem, flash_4_problem
from veomni.kernels.hardware import ANYWHERE, TRITON, Requirement
from veomni.kernels.linear_attention.fla_support import fla_gated_delta_problem
from veomni.kernels.registry import KERNELS, KernelFn

CUDA = Requirement(device_types=("cuda",))
LIGER = Requirement(device_types=("cuda",), packages=("liger_kernel",))


def _release_at_least(dist: str, minimum: tuple[int, int, int], why: str) -> Callable[[object], str | None]:
    """A `Requirement.condition`: the installed distribution ``dist`` is at least ``minimum``, read from its
    metadata (nothing is imported). ``why`` says what the older releases lack."""

    def problem(hw: object) -> str | None:
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None  # not installed as a distribution: the package requirement speaks for itself
        match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
        if match is None or tuple(int(g or 0) for g in match.groups()) >= minimum:
            return None
        return f"needs {dist} >= {'.'.join(map(str, minimum))} ({why}); {dist} {version} is installed"

    return problem


# The liger rope wrapper passes rotary_dim (partial RoPE), a LigerRopeFunction argument since 0.8.5; an older
# release would raise a TypeError at the model's first forward.
LIGER_ROPE = Requirement(
    device_types=("cuda",),
    packages=("liger_kernel",),
    condition=_release_at_least("liger-kernel", (0, 8, 5), "its rope takes rotary_dim since then"),
)
NPU = Requirement(device_types=("npu",), packages=("torch_npu",))
# torch._grouped_mm: CPU kernels (torch >= 2.9), and on CUDA the sync-free CUTLASS path exists for sm_90/sm_100
# (older GPUs get a fallback that copies the offsets to the host). See moe_experts/torch_impl.py for dtypes.
GROUPED_MM = Requirement(device_types=("cpu", "cuda"), min_capability=(9, 0))
FLASH_2 = Requirement(
    device_types=("cuda",), min_capability=(8, 0), packages=("flash_attn",), condition=flash_2_problem
)
FLASH_3 = Requirement(device_types=("cuda",), min_capability=(9, 0), packages=("flash_attn_interface",))
# quack-kernels (CuTe-DSL): Hopper and newer; the import name is `quack`. quack_backend's offset RMSNorm passes
# weight_offset, which quack.rmsnorm takes since 0.6.2.
QUACK = Requirement(
    device_types=("cuda",),
    min_capability=(9, 0),
    packages=("quack",),
    condition=_release_at_least("quack-kernels", (0, 6, 2), "quack.rmsnorm takes weight_offset since then"),
)
# FlashAttention 4 is the flash_attn.cute subpackage: a plain flash_attn (FA2) install is not enough.
FLASH_4 = Requirement(
    device_types=("cuda",), min_capability=(9, 0), packages=("flash_attn",), condition=flash_4_problem
)
FLA = Requirement(device_types=("cuda",), packages=("fla",))
FLA_GATED_DELTA = Requirement(device_types=("cuda",), packages=("fla",), condition=fla_gated_delta_problem)

_K = "veomni.kernels"
BUILTIN: list[tuple[str, str, str, str, Requirement]] = [
    # op, variant, backend, implementation, requirement
    ("cross_entropy", "causal", "eager", f"{_K}.cross_entropy.eager:causal_lm_cross_entropy", ANYWHERE),
    ("cross_entropy", "seq_cls", "eager", f"{_K}.cross_entropy.eager:sequence_classification_cross_entropy", ANYWHERE),
    ("cross_entropy", "causal", "triton", f"{_K}.cross_entropy.triton_impl:causal_lm_cross_entropy", TRITON),
    ("cross_entropy", "seq_cls", "triton", f"{_K}.cross_entropy.triton_impl:sequence_classification_cross_entropy", TRITON),
    ("cross_entropy", "causal", "liger", f"{_K}.cross_entropy.liger_impl:causal_lm_cross_entropy", LIGER),
    ("cross_entropy", "seq_cls", "liger", f"{_K}.cross_entropy.liger_impl:sequence_classification_cross_entropy", LIGER),
    ("moe_experts", "routed", "eager", f"{_K}.moe_experts.eager:moe_experts_routed_eager", ANYWHERE),
    ("moe_experts", "grouped", "eager", f"{_K}.moe_experts.eager:moe_experts_grouped_eager", ANYWHERE),
    ("moe_experts", "routed", "torch", f"{_K}.moe_experts.torch_impl:moe_experts_routed_torch", GROUPED_MM),
    ("moe_experts", "grouped", "torch", f"{_K}.moe_experts.torch_impl:moe_experts_grouped_torch", GROUPED_MM),
    ("moe_experts", "routed", "triton", f"{_K}.moe_experts.triton_impl:moe_experts_routed_triton", TRITON),
    ("moe_experts", "grouped", "triton", f"{_K}.moe_experts.triton_impl:moe_experts_grouped_triton", TRITON),
    ("moe_experts", "lora_routed", "eager", f"{_K}.moe_experts.lora:moe_experts_lora_routed_eager", ANYWHERE),
    ("moe_experts", "lora_grouped", "eager", f"{_K}.moe_experts.lora:moe_experts_lora_grouped_eager", ANYWHERE),
    ("moe_experts", "lora_routed", "torch", f"{_K}.moe_experts.lora:moe_experts_lora_routed_torch", GROUPED_MM),
    ("moe_experts", "lora_grouped", "torch", f"{_K}.moe_experts.lora:moe_experts_lora_grouped_torch", GROUPED_MM),
    ("moe_experts", "clamped_routed", "eager", f"{_K}.moe_experts.clamped:moe_experts_clamped_routed_eager", ANYWHERE),
    ("moe_experts", "clamped_grouped", "eager", f"{_K}.moe_experts.clamped:moe_experts_clamped_grouped_eager", ANYWHERE),
    ("moe_experts", "clamped_routed", "torch", f"{_K}.moe_experts.clamped:moe_experts_clamped_routed_torch", GROUPED_MM),
    ("moe_experts", "clamped_grouped", "torch", f"{_K}.moe_experts.clamped:moe_experts_clamped_grouped_torch", GROUPED_MM),
    ("moe_experts", "clamped_routed", "triton", f"{_K}.moe_experts.clamped:moe_experts_clamped_routed_triton", TRITON),
    ("moe_experts", "clamped_grouped", "triton", f"{_K}.moe_experts.clamped:moe_experts_clamped_grouped_triton", TRITON),
    ("rms_norm", "standard", "eager", f"{_K}.rms_norm.eager:rms_norm_standard", ANYWHERE),
    ("rms_norm", "offset", "eager", f"{_K}.rms_norm.eager:rms_norm_offset", ANYWHERE),
    ("rms_norm", "unweighted", "eager", f"{_K}.rms_norm.eager:rms_norm_unweighted", ANYWHERE),
    ("rms_norm", "residual", "eager", f"{_K}.rms_norm.eager:fused_add_rms_norm", ANYWHERE),
    ("rms_norm", "standard", "triton", f"{_K}.rms_norm.triton_impl:rms_norm_standard", TRITON),
    ("rms_norm", "offset", "triton", f"{_K}.rms_norm.triton_impl:rms_norm_offset", TRITON),
    ("rms_norm", "unweighted", "triton", f"{_K}.rms_norm.triton_impl:rms_norm_unweighted", TRITON),
    ("rms_norm", "residual", "triton", f"{_K}.rms_norm.triton_impl:fused_add_rms_norm", TRITON),
    ("rms_norm", "standard", "torch", f"{_K}.rms_norm.torch_native:rms_norm_standard", ANYWHERE),
    ("rms_norm", "offset", "torch", f"{_K}.rms_norm.torch_native:rms_norm_offset", ANYWHERE),
    ("rms_norm", "unweighted", "torch", f"{_K}.rms_norm.torch_native:rms_norm_unweighted", ANYWHERE),
    ("rms_norm", "residual", "torch", f"{_K}.rms_norm.torch_native:fused_add_rms_norm", ANYWHERE),
    # One function serves both rope variants: `partial` passes rotary_dim < head_dim.
    ("rope", "full", "eager", f"{_K}.rope.eager:apply_rope_eager", ANYWHERE),
    ("rope", "partial", "eager", f"{_K}.rope.eager:apply_rope_eager", ANYWHERE),
    ("rope", "full", "triton", f"{_K}.rope.triton_impl:apply_rope_triton", TRITON),
    ("rope", "partial", "triton", f"{_K}.rope.triton_impl:apply_rope_triton", TRITON),
    ("swiglu", "standard", "eager", f"{_K}.swiglu.eager:swiglu_eager", ANYWHERE),
    ("swiglu", "standard", "triton", f"{_K}.swiglu.triton_impl:swiglu_triton", TRITON),
    ("load_balancing_loss", "switch", "eager", f"{_K}.moe_loss.eager:load_balancing_loss_eager", ANYWHERE),
    ("load_balancing_loss", "switch", "triton", f"{_K}.moe_loss.triton_impl:load_balancing_loss_triton", TRITON),
    ("rms_norm", "standard", "liger", f"{_K}.liger_backend:rms_norm_standard", LIGER),
    ("rms_norm", "offset", "liger", f"{_K}.liger_backend:rms_norm_offset", LIGER),
    ("rope", "full", "liger", f"{_K}.liger_backend:apply_rope", LIGER_ROPE),
    ("rope", "partial", "liger", f"{_K}.liger_backend:apply_rope", LIGER_ROPE),
    ("swiglu", "standard", "liger", f"{_K}.liger_backend:swiglu", LIGER),
    ("attention", "default", "eager", f"{_K}.attention.functions:eager_attention", ANYWHERE),
    ("attention", "default", "sdpa", f"{_K}.attention.functions:sdpa_attention", ANYWHERE),
    # Flex runs forward-only on CPU (torch has no CPU flex backward), so it is registered for CUDA.
    ("attention", "default", "flex", f"{_K}.attention.functions:flex_attention", CUDA),
    ("attention", "default", "varlen", f"{_K}.attention.external:varlen_attention", CUDA),
    ("attention", "default", "flash_attn_2", f"{_K}.attention.external:flash_attn_2", FLASH_2),
    ("attention", "default", "flash_attn_3", f"{_K}.attention.external:flash_attn_3", FLASH_3),
    ("attention", "default", "flash_attn_4", f"{_K}.attention.external:flash_attn_4", FLASH_4),
    # Vision towers' 2-D rotary on packed [S, H, D] tokens, and the language model's multimodal rotary (M-RoPE).
    ("rope_vision", "full", "eager", f"{_K}.rope.multimodal:apply_rope_vision_eager", ANYWHERE),
    ("rope_vision", "full", "triton", f"{_K}.rope.multimodal_triton:apply_rope_vision_triton", TRITON),
    ("rope", "mrope", "eager", f"{_K}.rope.multimodal:apply_mrope_eager", ANYWHERE),
    ("rope", "mrope", "triton", f"{_K}.rope.multimodal_triton:apply_mrope_triton", TRITON),
    # Portable token-chunked linear CE (plain torch): the NPU default, and runnable anywhere.
    ("cross_entropy", "causal", "chunk_loss", f"{_K}.cross_entropy.chunked:causal_lm_cross_entropy", ANYWHERE),
    ("cross_entropy", "seq_cls", "chunk_loss", f"{_K}.cross_entropy.chunked:sequence_classification_cross_entropy", ANYWHERE),
    # QuACK (optional extra, sm_90+): RMSNorm, fused linear CE and the experts' grouped GEMM (quack_backend.py).
    ("rms_norm", "standard", "quack", f"{_K}.quack_backend:rms_norm_standard", QUACK),
    ("rms_norm", "offset", "quack", f"{_K}.quack_backend:rms_norm_offset", QUACK),
    ("rms_norm", "unweighted", "quack", f"{_K}.quack_backend:rms_norm_unweighted", QUACK),
    ("rms_norm", "residual", "quack", f"{_K}.quack_backend:fused_add_rms_norm", QUACK),
    ("cross_entropy", "causal", "quack", f"{_K}.quack_backend:causal_lm_cross_entropy", QUACK),
    ("cross_entropy", "seq_cls", "quack", f"{_K}.quack_backend:sequence_classification_cross_entropy", QUACK),
    ("moe_experts", "routed", "quack", f"{_K}.quack_backend:moe_experts_routed", QUACK),
    ("moe_experts", "grouped", "quack", f"{_K}.quack_backend:moe_experts_grouped", QUACK),
    # Ascend NPU through torch_npu (npu_backend.py); parity tests are marked `npu`.
    ("rms_norm", "standard", "npu", f"{_K}.npu_backend:rms_norm_standard", NPU),
    ("rms_norm", "offset", "npu", f"{_K}.npu_backend:rms_norm_offset", NPU),
    ("rms_norm", "unweighted", "npu", f"{_K}.npu_backend:rms_norm_unweighted", NPU),
    ("rms_norm", "residual", "npu", f"{_K}.npu_backend:fused_add_rms_norm", NPU),
    ("rope", "full", "npu", f"{_K}.npu_backend:apply_rope", NPU),
    ("rope", "partial", "npu", f"{_K}.npu_backend:apply_rope", NPU),
    ("rope", "mrope", "npu", f"{_K}.npu_backend:apply_mrope", NPU),
    ("rope_vision", "full", "npu", f"{_K}.npu_backend:apply_rope_vision", NPU),
    ("attention", "default", "npu", f"{_K}.npu_backend:attention", NPU),
    ("moe_experts", "routed", "npu", f"{_K}.npu_backend:moe_experts_routed", NPU),
    ("moe_experts", "grouped", "npu", f"{_K}.npu_backend:moe_experts_grouped", NPU),
    ("gated_delta_rule", "chunk", "eager", f"{_K}.linear_attention.eager:gated_delta_rule_eager", ANYWHERE),
    ("gated_delta_rule", "chunk", "fla", f"{_K}.linear_attention.fla_impl:gated_delta_rule_fla", FLA_GATED_DELTA),
    ("causal_conv1d", "standard", "eager", f"{_K}.linear_attention.eager:causal_conv1d_eager", ANYWHERE),
    ("causal_conv1d", "standard", "fla", f"{_K}.linear_attention.fla_impl:causal_conv1d_fla", FLA),
    ("rms_norm_gated", "standard", "eager", f"{_K}.linear_attention.eager:rms_norm_gated_eager", ANYWHERE),
    ("rms_norm_gated", "standard", "fla", f"{_K}.linear_attention.fla_impl:rms_norm_gated_fla", FLA),
    # Per-token target log-probs and entropy from hidden states + LM head (DPO, policy-gradient tasks).
    ("log_probs", "linear", "eager", f"{_K}.log_probs.eager:linear_log_probs", ANYWHERE),
    ("log_probs", "linear", "chunked", f"{_K}.log_probs.chunked:linear_log_probs", ANYWHERE),
    ("log_probs", "linear", "triton", f"{_K}.log_probs.triton_impl:linear_log_probs", TRITON),
    # Interleaved-pair rotary on [B, S, H, D] (Wan and other video DiTs; rope/interleaved.py).
    ("rope", "interleaved", "eager", f"{_K}.rope.interleaved:apply_rope_interleaved_eager", ANYWHERE),
    ("rope", "interleaved", "triton", f"{_K}.rope.interleaved_triton:apply_rope_interleaved_triton", TRITON),
]


def _importer(target: str) -> Callable[[], KernelFn]:
    module_name, _, attr = target.partition(":")

    def factory() -> KernelFn:
        kernel: KernelFn = getattr(importlib.import_module(module_name), attr)
        return kernel

    return factory


def _capabilities(op: str, backend: str) -> frozenset[str]:
    # Attention features live next to the kernels that check them (attention/features.py, torch only).
    if op != "attention":
        return frozenset()
    from veomni.kernels.attention.features import BACKEND_FEATURES

    return BACKEND_FEATURES.get(backend, frozenset())


def register_builtin() -> None:
    """Register every row of `BUILTIN`."""
    for op, variant, backend, target, requires in BUILTIN:
        caps = _capabilities(op, backend)
        KERNELS.register(op, variant, backend, _importer(target), requires, description=target, capabilities=caps)
