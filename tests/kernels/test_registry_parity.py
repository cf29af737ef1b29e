"""Walks the kernel registry: every registered implementation matches its eager reference, forward and backward.

An implementation whose (op, variant) has no case here fails the walk, so nothing can be registered without a
parity test. Implementations this machine cannot run (a GPU backend on CPU, a missing package) are skipped with
the registry's reason; on CPU the Triton kernels run through Triton's interpreter (see tests/conftest.py).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from veomni.kernels import KERNELS, detect_hardware

Case = Callable[[torch.Generator], tuple[tuple, dict]]
# Kernels run where the hardware is: CUDA when present, else an Ascend NPU (torch_npu registers torch.npu), else
# CPU (Triton through its interpreter).
DEVICE = {"cuda": "cuda", "npu": "npu"}.get(detect_hardware().device_type, "cpu")


def _t(gen: torch.Generator, *shape: int, grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(DEVICE).requires_grad_(grad)


def _rope_case(rotary_dim: int | None) -> Case:
    def build(gen):
        b, s, d = 2, 5, 8
        # HF's cos/sin repeat their first half (each frequency drives a pair of dims); kernels may rely on it.
        angles = torch.randn(b, s, (rotary_dim or d) // 2, generator=gen).to(DEVICE)
        angles = torch.cat([angles, angles], dim=-1)
        cos_sin = torch.stack([angles, angles])
        q = _t(gen, b, 4, s, d).transpose(1, 2).contiguous().transpose(1, 2)  # HF-style non-contiguous view
        return (q, _t(gen, b, 2, s, d), cos_sin[0].cos(), cos_sin[1].sin()), {"rotary_dim": rotary_dim}

    return build


def _mrope_case(gen):
    b, s, d = 2, 5, 12
    # Three position tables (temporal, height, width), each with HF's duplicated halves; sections 2 + 1 + 3 = D/2.
    angles = torch.randn(3, b, s, d // 2, generator=gen).to(DEVICE)
    angles = torch.cat([angles, angles], dim=-1)
    q = _t(gen, b, 4, s, d)
    return (q, _t(gen, b, 2, s, d), angles.cos(), angles.sin()), {"mrope_section": [2, 1, 3]}


def _interleaved_rope_case(gen):
    b, s, d = 2, 5, 12
    # Wan's tables: float64 [1, S, 1, D], each angle repeated for both dims of its pair; q a non-contiguous view.
    angles = torch.randn(1, s, 1, d // 2, generator=gen, dtype=torch.float64).repeat_interleave(2, -1).to(DEVICE)
    q = _t(gen, b, s, 3 * d)[..., : 2 * d].unflatten(-1, (2, d))
    return (q, _t(gen, b, s, 1, d), angles.cos(), angles.sin()), {}


def _vision_rope_case(gen):
    s, d = 9, 16
    # ViT towers: height and width frequencies concatenated per patch, then duplicated halves.
    angles = torch.randn(s, d // 2, generator=gen).to(DEVICE)
    angles = torch.cat([angles, angles], dim=-1)
    return (_t(gen, s, 4, d), _t(gen, s, 4, d), angles.cos(), angles.sin()), {}


CASES: dict[tuple[str, str], Case] = {
    ("rope", "mrope"): _mrope_case,
    ("rope_vision", "full"): _vision_rope_case,
    ("rms_norm", "standard"): lambda g: ((_t(g, 3, 5, 37), _t(g, 37), 1e-6), {}),
    ("rms_norm", "offset"): lambda g: ((_t(g, 3, 5, 37), _t(g, 37), 1e-6), {}),
    ("rms_norm", "unweighted"): lambda g: ((_t(g, 7, 19), 1e-5), {}),
    ("rms_norm", "residual"): lambda g: ((_t(g, 6, 33), _t(g, 6, 33), _t(g, 33), 1e-6), {}),
    ("rope", "full"): _rope_case(None),
    ("rope", "partial"): _rope_case(4),
    ("rope", "interleaved"): _interleaved_rope_case,
    ("swiglu", "standard"): lambda g: ((_t(g, 4, 3, 21), _t(g, 4, 3, 21)), {}),
    ("load_balancing_loss", "switch"): lambda g: (([_t(g, 9, 6), _t(g, 9, 6)], 6, 2), {}),
    # Head size 16: flex needs at least 16.
    ("attention", "default"): lambda g: (
        (_t(g, 1, 7, 4, 16), _t(g, 1, 7, 2, 16), _t(g, 1, 7, 2, 16)),
        {"causal": True},
    ),
    # (hidden, LM-head weight, labels); one label ignored, soft-cap and z-loss on so every term is compared.
    ("cross_entropy", "causal"): lambda g: (
        (
            _t(g, 2, 5, 16),
            _t(g, 11, 16),
            torch.randint(0, 11, (2, 5), generator=g).index_fill(1, torch.tensor([0]), -100).to(DEVICE),
        ),
        {"logit_softcap": 3.0, "z_loss_weight": 1e-2},
    ),
    ("cross_entropy", "seq_cls"): lambda g: (
        (_t(g, 4, 16), _t(g, 3, 16), torch.randint(0, 3, (4,), generator=g).to(DEVICE)),
        {},
    ),
    # (hidden [T, H], LM-head weight, targets); one target ignored, soft-cap and temperature on, entropy returned
    # so the walk's random probes send a gradient through both outputs at once.
    ("log_probs", "linear"): lambda g: (
        (
            _t(g, 9, 16),
            _t(g, 13, 16),
            torch.randint(0, 13, (9,), generator=g).index_fill(0, torch.tensor([4]), -100).to(DEVICE),
        ),
        {"logit_softcap": 3.0, "temperature": 0.7, "entropy": True},
    ),
    # H = 8, I = 4: 16-byte fp32 rows for torch._grouped_mm. Token 1 routes to expert 2 twice; expert 1 is empty.
    ("moe_experts", "routed"): lambda g: (
        (
            _t(g, 5, 8),
            torch.tensor([[0, 2], [2, 2], [3, 0], [2, 3], [0, 0]], device=DEVICE),
            _t(g, 5, 2),
            _t(g, 4, 8, 8),
            _t(g, 4, 8, 4),
        ),
        {},
    ),  # fmt: skip
    ("moe_experts", "grouped"): lambda g: (
        (_t(g, 7, 8), torch.tensor([3, 0, 4], device=DEVICE), _t(g, 3, 8, 8), _t(g, 3, 8, 4)),
        {},
    ),
    # Per-expert LoRA (rank 2, padded by the torch backend) on both projections: A [E, r, in], B [E, out, r].
    ("moe_experts", "lora_routed"): lambda g: (
        (_t(g, 5, 8), torch.tensor([[0, 2], [2, 2], [3, 0], [2, 3], [0, 0]], device=DEVICE), _t(g, 5, 2),
         _t(g, 4, 8, 8), _t(g, 4, 8, 4), _t(g, 4, 2, 8), _t(g, 4, 8, 2), _t(g, 4, 2, 4), _t(g, 4, 8, 2)),
        {"scaling": 0.5},
    ),  # fmt: skip
    ("moe_experts", "lora_grouped"): lambda g: (
        (_t(g, 7, 8), torch.tensor([3, 0, 4], device=DEVICE), _t(g, 3, 8, 8), _t(g, 3, 8, 4), _t(g, 3, 2, 8),
         _t(g, 3, 8, 2), _t(g, 3, 2, 4), _t(g, 3, 8, 2)),
        {"scaling": 2.0},
    ),  # fmt: skip
    # gpt-oss layout: gate_up_proj [E, H, 2I] interleaved + bias, down_proj [E, I, H] + bias (H = 8, I = 4); a
    # small limit so both clamps clip some of the random pre-activations.
    ("moe_experts", "clamped_routed"): lambda g: (
        (_t(g, 5, 8), torch.tensor([[0, 2], [2, 2], [3, 0], [2, 3], [0, 0]], device=DEVICE), _t(g, 5, 2),
         _t(g, 4, 8, 8), _t(g, 4, 8), _t(g, 4, 4, 8), _t(g, 4, 8)),
        {"limit": 1.5, "alpha": 1.702},
    ),  # fmt: skip
    ("moe_experts", "clamped_grouped"): lambda g: (
        (_t(g, 7, 8), torch.tensor([3, 0, 4], device=DEVICE), _t(g, 3, 8, 8), _t(g, 3, 8), _t(g, 3, 4, 8),
         _t(g, 3, 8)),
        {"limit": 1.5, "alpha": 1.702},
    ),  # fmt: skip
    # Gated DeltaNet: 2 q/k heads serving 4 value heads, 3 packed documents (one shorter than the conv window).
    ("gated_delta_rule", "chunk"): lambda g: (
        (_t(g, 1, 70, 2, 16), _t(g, 1, 70, 2, 16), _t(g, 1, 70, 4, 8),
         torch.nn.functional.logsigmoid(torch.randn(1, 70, 4, generator=g) + 2).to(DEVICE).requires_grad_(),
         torch.rand(1, 70, 4, generator=g).to(DEVICE).requires_grad_()),
        {"cu_seqlens": torch.tensor([0, 2, 41, 70], dtype=torch.int32, device=DEVICE)},
    ),  # fmt: skip
    ("causal_conv1d", "standard"): lambda g: (
        (_t(g, 1, 23, 24), _t(g, 24, 4), _t(g, 24)),
        {"activation": "silu", "cu_seqlens": torch.tensor([0, 2, 17, 23], dtype=torch.int32, device=DEVICE)},
    ),
    ("rms_norm_gated", "standard"): lambda g: ((_t(g, 6, 4, 32), _t(g, 6, 4, 32), _t(g, 32), 1e-6), {}),
}
# fla's chunked delta rule runs its matmuls in TF32 on GPUs: fp32 parity holds to ~1e-3, not 1e-5.
TOLERANCE: dict[tuple[str, str], float] = {("gated_delta_rule", "fla"): 3e-3}


def _leaves(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.requires_grad else []
    if isinstance(obj, list | tuple):
        return [t for item in obj for t in _leaves(item)]
    return []


def _outputs(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    return [t for item in obj for t in _outputs(item)]


def _clone(obj):
    if isinstance(obj, torch.Tensor):
        return (
            obj.detach().clone().requires_grad_(obj.requires_grad) if obj.is_floating_point() else obj.clone()
        )
    if isinstance(obj, list | tuple):
        return type(obj)(_clone(item) for item in obj)
    return obj


def _run(fn, args, kwargs, seed: int):
    args = _clone(args)
    outs = _outputs(fn(*args, **kwargs))
    gen = torch.Generator().manual_seed(seed)
    probes = [torch.randn(o.shape, generator=gen).to(o.device) for o in outs]
    floating = [
        (o, p) for o, p in zip(outs, probes, strict=True) if o.is_floating_point() and o.requires_grad
    ]
    total = sum((o.float() * p).sum() for o, p in floating)
    leaves = _leaves(args)
    grads = torch.autograd.grad(total, leaves, allow_unused=True) if floating else [None] * len(leaves)
    return [o.detach() for o in outs], list(grads)


SPECS = [s for s in KERNELS.specs() if s.backend != "eager"]


def test_every_registered_implementation_has_a_parity_case():
    missing = sorted({(s.op, s.variant) for s in KERNELS.specs()} - set(CASES))
    assert not missing, f"registered (op, variant)s without a parity case in this file: {missing}"
    for op, variant in CASES:
        KERNELS.get(op, variant, "eager")  # every case has a reference


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.op}-{s.variant}-{s.backend}")
def test_implementation_matches_eager(spec):
    problem = spec.requires.unmet(detect_hardware())
    if problem:
        pytest.skip(f"{spec.backend}: {problem}")
    args, kwargs = CASES[(spec.op, spec.variant)](torch.Generator().manual_seed(0))
    if spec.op == "cross_entropy" and spec.backend in CE_WITHOUT_SOFTCAP_ZLOSS:
        kwargs = {}  # it raises NotImplementedError for these (tested in its own file); compare the plain CE
    tol = TOLERANCE.get((spec.op, spec.backend), 1e-5)
    if spec.backend in HALF_ONLY:
        # The kernel takes bf16 only: feed it bf16 and hold it to bf16 accuracy against fp32 eager on the same
        # rounded values.
        args = _cast(_cast(args, torch.bfloat16), torch.float32)
        tol = 3e-2
    ref_out, ref_grads = _run(KERNELS.get(spec.op, spec.variant, "eager").factory(), args, kwargs, seed=1)
    impl_args = _cast(args, torch.bfloat16) if spec.backend in HALF_ONLY else args
    out, grads = _run(spec.factory(), impl_args, kwargs, seed=1)
    for got, want in zip(out, ref_out, strict=True):
        torch.testing.assert_close(got.to(want.dtype), want, rtol=tol, atol=tol)
    for i, (got, want) in enumerate(zip(grads, ref_grads, strict=True)):
        if want is None:
            assert got is None or bool((got == 0).all()), f"grad {i} should be absent"
        else:
            torch.testing.assert_close(
                got.to(want.dtype), want, rtol=tol, atol=tol, msg=lambda m, i=i: f"grad {i}: {m}"
            )


# Backends whose kernels accept only fp16/bf16 inputs (quack's grouped GEMM is bf16/fp16; its other ops are
# held to the same bf16 standard).
HALF_ONLY = {"varlen", "flash_attn_2", "flash_attn_3", "flash_attn_4", "quack"}
# Cross-entropy backends without logit soft-cap and z-loss.
CE_WITHOUT_SOFTCAP_ZLOSS = {"quack"}


def _cast(obj, dtype: torch.dtype):
    if isinstance(obj, torch.Tensor) and obj.is_floating_point():
        return obj.detach().to(dtype).requires_grad_(obj.requires_grad)
    if isinstance(obj, list | tuple):
        return type(obj)(_cast(item, dtype) for item in obj)
    return obj
