"""LoRA on fused MoE experts: per-expert adapters on ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``, applied
inside the grouped-GEMM experts path, and their form in PEFT's ``target_parameters`` files.

In the model, an adapted projection ``P`` of an experts module gains two parameters beside it, ``P_lora_A [E, r, in]``
and ``P_lora_B [E, out, r]`` (expert-major, so expert parallelism slices them on dim 0 with the weights:
`lora_expert_plan`), and the module records ``lora_targets`` (the adapted projections) and ``lora_scaling``.
`veomni.models.hf.experts.veomni_experts_forward` then runs the ``moe_experts/lora_*`` kernels
(`veomni.kernels.moe_experts.lora`), which add ``scaling * (x @ A[e]^T) @ B[e]^T`` to each expert's GEMM output
before the activation (gate_up) or the combine (down); the experts are never unfused and ``W + BA`` never formed.

PEFT 0.21 adapts such a parameter with a ``ParamWrapper`` (``LoraConfig(target_parameters=[...])``), whose
``lora_A.weight`` is ``[E*r, in]`` (expert-major: ``.reshape(E, r, in)`` is ours) and ``lora_B.weight`` ``[out, r*E]``
(rank-major: ``.reshape(out, r, E).permute(2, 0, 1)`` is ours). Two wrapped parameters of one module nest, the one
wrapped first (the first in the module's parameter order) innermost: with both projections adapted, gate_up_proj's
adapters are saved as ``<experts>.base_layer.lora_A.weight`` and down_proj's as ``<experts>.lora_A.weight``.
PEFT refuses dropout on wrapped parameters, so experts targets need ``lora.dropout: 0``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from veomni.core.ep.plan import ExpertPlan
from veomni.core.fqn import compile_fqn_glob
from veomni.models.hf.experts import (
    EXPERTS_IMPLEMENTATION,
    LORA_ATTR,
    LORA_PROJECTIONS,
    LORA_SUFFIXES,
    claim_of,
    experts_mismatches,
    is_hf_experts_module,
)

if TYPE_CHECKING:
    from veomni.models.lora.spec import LoraSpec


def expert_projections(model: nn.Module) -> list[tuple[str, str]]:
    """``(parameter FQN, experts module FQN)`` of every fused projection (`LORA_PROJECTIONS`) of every HF experts
    module of ``model``, in parameter order: what ``lora.targets`` may select besides ``nn.Linear`` layers."""
    found = []
    for fqn, module in model.named_modules():
        if fqn and is_hf_experts_module(module):
            names = [n for n, _ in module.named_parameters(recurse=False) if n in LORA_PROJECTIONS]
            found.extend((f"{fqn}.{n}", fqn) for n in names)
    return found


def split_expert_target(model: nn.Module, target: str) -> tuple[str, str] | None:
    """``(experts module FQN, projection)`` when ``target`` names a fused projection of an experts module, else
    None (a linear layer's FQN)."""
    owner, _, name = target.rpartition(".")
    if name not in LORA_PROJECTIONS or not owner:
        return None
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        return None
    return (owner, name) if is_hf_experts_module(module) else None


def _require_veomni_experts(module: nn.Module, args: tuple) -> None:
    # Upstream's experts forward (HF's eager loop, grouped_mm, ...) reads gate_up_proj / down_proj and would
    # silently drop the adapters.
    impl = getattr(getattr(module, "config", None), "_experts_implementation", None)
    if impl != EXPERTS_IMPLEMENTATION:
        raise RuntimeError(
            f"{type(module).__name__} carries LoRA adapters on {list(getattr(module, LORA_ATTR))}, which only "
            f"veomni's experts implementation applies, but its experts implementation is {impl!r} (that forward "
            "would ignore them); bind veomni's kernels with veomni.models.hf.kernel_hooks.apply_ops(model, ops), as "
            "build_model(backend='veomni') does"
        )


def inject_expert_lora(
    model: nn.Module, spec: LoraSpec, targets: Mapping[str, list[str]], adapter_dtype: torch.dtype
) -> None:
    """Give each experts module in ``targets`` (``{module FQN: projections}``) its adapters, uninitialised, in
    ``adapter_dtype`` on the weights' device (meta is fine); `veomni.models.lora.state.init_adapters` fills them.

    Raises:
        ValueError: ``spec.dropout > 0`` (PEFT refuses dropout on wrapped parameters: the adapter could not be
            exported), or an experts module off the generic SwiGLU layout the LoRA kernels compute (gpt-oss's
            biased, transposed, clamped experts), naming how it differs.
        TypeError: a module adapted twice.
    """
    if targets and spec.dropout > 0:
        raise ValueError(
            f"lora.dropout={spec.dropout} with fused experts targets ({sorted(targets)[:2]} ...): PEFT's "
            "target_parameters adapters take no dropout (the adapter file could not be loaded by PEFT); set "
            "lora.dropout: 0 or leave the experts out of lora.targets"
        )
    for owner, names in targets.items():
        module = model.get_submodule(owner)
        problems = (
            experts_mismatches(module) if claim_of(module) is None else ["a claimed non-default layout"]
        )
        if problems:
            raise ValueError(
                f"lora: {owner} ({type(module).__name__}) is not in the SwiGLU experts layout that the LoRA experts "
                f"kernels compute ([E, 2I, H] / [E, H, I], no bias, no clamp): {'; '.join(problems)}"
            )
        if getattr(module, LORA_ATTR, ()):
            raise TypeError(f"lora: {owner} already carries adapters on {list(getattr(module, LORA_ATTR))}")
        ordered = tuple(n for n, _ in module.named_parameters(recurse=False) if n in names)
        for name in ordered:
            weight = getattr(module, name)
            experts, fan_out, fan_in = weight.shape
            shapes = ((experts, spec.rank, fan_in), (experts, fan_out, spec.rank))  # A, B
            for suffix, shape in zip(LORA_SUFFIXES, shapes, strict=True):
                adapter = torch.empty(shape, device=weight.device, dtype=adapter_dtype)
                setattr(module, f"{name}{suffix}", nn.Parameter(adapter))
        setattr(module, LORA_ATTR, ordered)
        module.lora_scaling = spec.scaling
        module.register_forward_pre_hook(_require_veomni_experts)


def adapted_experts(model: nn.Module) -> dict[str, nn.Module]:
    """The experts modules carrying LoRA adapters, by FQN."""
    return {n: m for n, m in model.named_modules() if getattr(m, LORA_ATTR, ())}


def expert_adapter_weights(model: nn.Module) -> dict[str, tuple[str, str]]:
    """``{projection FQN: (A key, B key)}`` for every adapted fused projection (what a merged export folds)."""
    return {
        f"{fqn}.{name}": (f"{fqn}.{name}{LORA_SUFFIXES[0]}", f"{fqn}.{name}{LORA_SUFFIXES[1]}")
        for fqn, module in adapted_experts(model).items()
        for name in getattr(module, LORA_ATTR)
    }


def lora_expert_plan(model: nn.Module, plan: ExpertPlan) -> ExpertPlan:
    """``plan`` plus, for each of its patterns, the adapters beside the parameters it names (``<pattern>_lora_A``,
    ``<pattern>_lora_B``, where they exist), so expert parallelism slices the adapters with their experts."""
    names = [n for n, _ in model.named_parameters()]
    extra = tuple(
        f"{pattern}{suffix}"
        for pattern in plan.patterns
        for suffix in LORA_SUFFIXES
        if any(compile_fqn_glob(f"{pattern}{suffix}").fullmatch(n) for n in names)
    )
    return ExpertPlan(patterns=plan.patterns + extra) if extra else plan


# ---- PEFT's layout -----------------------------------------------------------------------------------------


def peft_target_parameters(model: nn.Module) -> list[str]:
    """PEFT ``target_parameters``: the full FQNs of the adapted fused projections (full names, so PEFT's suffix
    match cannot reach another module's parameter of the same name)."""
    return sorted(expert_adapter_weights(model))


def peft_expert_keys(model: nn.Module) -> dict[str, tuple[str, str]]:
    """``{our key: (PEFT's key without the base_model.model. prefix, "A" or "B")}`` for every experts adapter,
    with PEFT's nesting (module doc)."""
    keys = {}
    for fqn, module in adapted_experts(model).items():
        names = getattr(module, LORA_ATTR)
        for i, name in enumerate(names):
            nest = "base_layer." * (len(names) - 1 - i)
            keys[f"{fqn}.{name}_lora_A"] = (f"{fqn}.{nest}lora_A.weight", "A")
            keys[f"{fqn}.{name}_lora_B"] = (f"{fqn}.{nest}lora_B.weight", "B")
    return keys


def to_peft_layout(tensor: torch.Tensor, which: str) -> torch.Tensor:
    """Ours -> PEFT's: ``A [E, r, in]`` -> ``[E*r, in]``; ``B [E, out, r]`` -> ``[out, r*E]`` (rank-major)."""
    if which == "A":
        return tensor.reshape(-1, tensor.shape[-1]).contiguous()
    experts, fan_out, rank = tensor.shape
    return tensor.permute(1, 2, 0).reshape(fan_out, rank * experts).contiguous()


def from_peft_layout(tensor: torch.Tensor, which: str, shape: tuple[int, ...], key: str) -> torch.Tensor:
    """PEFT's -> ours (`to_peft_layout` inverted) for a parameter of full ``shape``; ``key`` names it in errors.

    Raises:
        ValueError: ``tensor`` is not PEFT's layout of ``shape``.
    """
    experts, rows, cols = shape
    want = (experts * rows, cols) if which == "A" else (rows, cols * experts)
    if tuple(tensor.shape) != want:
        raise ValueError(
            f"{key}: PEFT stores this experts adapter as {list(want)} (ours {list(shape)}), found {list(tensor.shape)}"
        )
    if which == "A":
        return tensor.reshape(shape)
    return tensor.reshape(rows, cols, experts).permute(2, 0, 1).contiguous()
