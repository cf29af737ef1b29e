"""gpt-oss pieces the generated modeling file imports: the experts claim and the MXFP4 checkpoint guard.

``GptOssExperts`` stores ``gate_up_proj [E, H, 2I]`` (gate and up interleaved column by column) and
``down_proj [E, I, H]``, each with a bias, and gates with a clamped, alpha-scaled SwiGLU. The generic
``moe_experts`` kernels compute none of that, so the generated class is claimed for the ``clamped_*`` variants
(`veomni.kernels.moe_experts.clamped`), after checking numerically that its ``_apply_gate`` is their activation.
"""

from __future__ import annotations

import torch

from veomni.models.hf.experts import ExpertsClaim
from veomni.models.loading.quantized import check_not_quantized


def _gate_check(cls: type) -> str | None:
    """None when ``cls._apply_gate`` is `clamped_swiglu` (checked on values that hit both clamps), else why not."""
    from veomni.kernels.moe_experts.clamped import clamped_swiglu

    probe = type("Probe", (), {"limit": 1.25, "alpha": 1.702})()
    gen = torch.Generator().manual_seed(0)
    # An explicit device: the generated module may be imported under a meta-device context (building on meta).
    gate_up = torch.randn(5, 16, generator=gen, dtype=torch.float64, device="cpu") * 3
    try:
        got = cls._apply_gate(probe, gate_up)
    except Exception as err:  # any failure means the gate is not the one the kernels compute
        return f"its _apply_gate failed on a probe: {err!r}"
    want = clamped_swiglu(gate_up, probe.limit, probe.alpha)
    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-12, atol=1e-12):
        return "its _apply_gate is not (clamp(up) + 1) * clamp(gate) * sigmoid(alpha * clamp(gate)) on interleaved columns"
    return None


GPT_OSS_EXPERTS = ExpertsClaim(
    name="gpt-oss clamped SwiGLU (biased, [E, H, 2I] interleaved / [E, I, H])",
    routed="clamped_routed",
    grouped="clamped_grouped",
    flags={
        "has_gate": True,
        "is_concatenated": False,
        "is_transposed": True,
        "has_bias": True,
        "has_post_expert_norm": False,
    },
    params=("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"),
    option_attrs={"limit": "limit", "alpha": "alpha"},
    gate_check=_gate_check,
)


def reject_quantized(config: object) -> None:
    """Raise for configs of quantized checkpoints (the published gpt-oss weights are MXFP4), with the conversion:
    veomni trains bf16/fp32 weights and never silently reads packed 4-bit blocks as parameters. Called from the
    patched ``__init__`` so a directly built class is refused too, not only `build_model`."""
    check_not_quantized(config, where="this gpt_oss config")
