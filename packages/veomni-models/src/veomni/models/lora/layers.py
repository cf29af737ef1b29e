"""LoRA on ``nn.Linear`` layers, in place: the layer keeps its name and its ``weight`` (so checkpoints, FSDP2
plans and kernels that find it by name still do) and gains ``lora_A`` / ``lora_B`` children, as PEFT names them.

The layer's class is swapped for `LoraLinear` (the way FSDP2's ``fully_shard`` swaps a module's class), which
computes ``x @ W.T + b + scaling * B(A(dropout(x)))``. The adapter branch runs in the adapters' dtype, as PEFT's does:
fp32 adapters on a bf16 base compute their branch in fp32; under FSDP2 mixed precision both are cast to the
compute dtype first.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from veomni.models.hf.experts import LORA_SUFFIXES
from veomni.models.lora.experts import inject_expert_lora, split_expert_target
from veomni.models.lora.spec import LoraSpec, select_modules

log = logging.getLogger("veomni.models")

ADAPTER_PARAMS = ("lora_A.weight", "lora_B.weight", *LORA_SUFFIXES)
"""Name endings of adapter parameters: a `LoraLinear`'s, and the per-expert ones beside fused MoE projections."""


class LoraLinear(nn.Linear):
    """An ``nn.Linear`` plus a low-rank update. Made by `inject_lora` from a plain ``nn.Linear``, never built."""

    lora_A: nn.Linear  # [r, in]
    lora_B: nn.Linear  # [out, r]
    lora_dropout: nn.Module
    lora_scaling: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., in]`` in the compute dtype; returns ``[..., out]`` in the base output's dtype."""
        out = F.linear(x, self.weight, self.bias)
        branch = self.lora_B(self.lora_A(self.lora_dropout(x.to(self.lora_A.weight.dtype))))
        return out + (branch * self.lora_scaling).to(out.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora_rank={self.lora_A.out_features}, lora_scaling={self.lora_scaling:g}"


def inject_lora(
    model: nn.Module,
    spec: LoraSpec,
    targets: list[str],
    *,
    adapter_dtype: torch.dtype = torch.float32,
) -> list[str]:
    """Turn every module named in ``targets`` into a `LoraLinear` (a fused MoE projection named there gets per-expert
    adapters: `veomni.models.lora.experts.inject_expert_lora`) and freeze everything but the adapters and
    ``spec.modules_to_save``.

    Call it on the built model before FSDP2 / compilation (meta device is fine: the adapters are created where
    each layer's weight lives, uninitialised; `init_adapters` fills them once the model is materialised).

    Args:
        model: the model (plain, possibly on meta).
        spec: the LoRA configuration (rank, scaling, dropout, modules to save).
        targets: FQNs of plain ``nn.Linear`` modules and of fused experts projections (`select_modules` finds
            them).
        adapter_dtype: the dtype of ``lora_A`` / ``lora_B`` (fp32 by default: small, and the optimizer steps them).
    Returns:
        the FQNs of the trainable parameters (adapters and modules to save), in ``named_parameters`` order.
    Raises:
        TypeError: a target that is not exactly ``nn.Linear`` (already adapted, or a subclass whose forward
            this would bypass).
        ValueError: a module to save that matches nothing, or shares its weight with a frozen module (tied
            embeddings: PEFT would save a copy and untie them).
    """
    model.requires_grad_(False)
    experts: dict[str, list[str]] = {}
    for name in targets:
        projection = split_expert_target(model, name)
        if projection is not None:
            experts.setdefault(projection[0], []).append(projection[1])
            continue
        layer = model.get_submodule(name)
        if type(layer) is not nn.Linear:
            raise TypeError(
                f"lora: {name} is a {type(layer).__name__}; only plain nn.Linear layers are adapted"
            )
        device = layer.weight.device
        layer.lora_A = nn.Linear(layer.in_features, spec.rank, bias=False, device=device, dtype=adapter_dtype)
        layer.lora_B = nn.Linear(
            spec.rank, layer.out_features, bias=False, device=device, dtype=adapter_dtype
        )
        layer.lora_dropout = nn.Dropout(spec.dropout) if spec.dropout > 0 else nn.Identity()
        layer.lora_scaling = spec.scaling
        layer.__class__ = LoraLinear
    inject_expert_lora(model, spec, experts, adapter_dtype)
    saved = _unfreeze_modules_to_save(model, spec) if spec.modules_to_save else []
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    n_adapter = sum(p.numel() for n, p in model.named_parameters() if n.endswith(ADAPTER_PARAMS))
    log.info(
        "lora: %d layers / fused expert projections adapted (rank %d, scaling %g), %d adapter parameters; trained "
        "in full: %s", len(targets), spec.rank, spec.scaling, n_adapter, saved or "nothing else",
    )  # fmt: skip
    return trainable


def _unfreeze_modules_to_save(model: nn.Module, spec: LoraSpec) -> list[str]:
    entries = [(s, (s,)) for s in spec.modules_to_save]
    names = select_modules(model, entries, what="lora.modules_to_save", kinds=(nn.Module,))
    chosen = {id(p) for n in names for p in model.get_submodule(n).parameters()}
    for n in names:
        model.get_submodule(n).requires_grad_(True)
    # A tied tensor appears under two names; one of them outside the saved modules means it is shared.
    for pname, p in model.named_parameters(remove_duplicate=False):
        if id(p) in chosen and not any(pname.startswith(n + ".") for n in names):
            raise ValueError(
                f"lora.modules_to_save: {names} share a weight with {pname} (tied embeddings); train the tied "
                "pair in full with tie_word_embeddings=False in the model config, or save neither"
            )
    return names


def adapted_layers(model: nn.Module) -> dict[str, LoraLinear]:
    """The model's `LoraLinear` layers by FQN."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLinear)}


def adapter_init(shape: tuple[int, ...], which: str, init: str, generator: torch.Generator) -> torch.Tensor:
    """The initial value of one adapter matrix (``which``: ``"A"`` ``[r, in]`` or ``"B"`` ``[out, r]``; experts'
    ``[E, r, in]`` / ``[E, out, r]``), fp32 on CPU.

    ``default`` is ``nn.Linear``'s own init for A (Kaiming-uniform with ``a=sqrt(5)``: bound ``1/sqrt(in)``) and
    zeros for B; ``gaussian`` draws A from ``N(0, 1/r)``; ``zeros`` zeroes both (PEFT's inits, per expert too). B = 0
    makes the adapted model start equal to the base one.
    """
    if which == "B" or init == "zeros":
        return torch.zeros(shape)
    if init == "gaussian":
        return torch.randn(shape, generator=generator) / shape[-2]
    bound = 1.0 / math.sqrt(shape[-1])
    return (torch.rand(shape, generator=generator) * 2 - 1) * bound
