"""LoRA adapters over any veomni model, in PEFT's format.

- `LoraSpec`: the configuration (rank, alpha, targets, rsLoRA, dropout, modules to save, init).
- Fused MoE experts get per-expert adapters applied inside the grouped-GEMM experts kernels
  (`veomni.models.lora.experts`), saved as PEFT's ``target_parameters``.
- `apply_lora`: on the built model, before FSDP2 and compilation: adapt the family's (or the spec's) target
  layers and freeze the rest. `init_lora`: once materialised and loaded: fill the adapters (seeded, sharding-
  independent) or read a PEFT adapter.
- `save_peft_adapter` / `load_peft_adapter`: PEFT's ``adapter_config.json`` + ``adapter_model.safetensors``.
- A merged export is `veomni.models.export.hf.export_hf` of the adapted model (``W + scaling * B @ A``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import nn

from veomni.models.families import lora_targets
from veomni.models.lora.experts import adapted_experts
from veomni.models.lora.layers import LoraLinear, adapted_layers, inject_lora
from veomni.models.lora.peft_format import load_peft_adapter, peft_config, peft_state_dict, save_peft_adapter
from veomni.models.lora.spec import LoraSpec, select_targets
from veomni.models.lora.state import gather_trainable, init_adapters, load_trainable, trainable_keys

log = logging.getLogger("veomni.models")

__all__ = [
    "LoraLinear",
    "LoraSpec",
    "adapted_experts",
    "adapted_layers",
    "apply_lora",
    "disabled_adapters",
    "gather_trainable",
    "init_lora",
    "load_peft_adapter",
    "load_trainable",
    "peft_config",
    "peft_state_dict",
    "save_peft_adapter",
    "trainable_keys",
]


def apply_lora(model: nn.Module, spec: LoraSpec, *, adapter_dtype: torch.dtype = torch.float32) -> list[str]:
    """Adapt ``model`` in place (before FSDP2 / compilation; meta is fine) and freeze everything else.

    Targets come from ``spec.targets`` or, when empty, the default groups of the family of ``model.config``'s
    ``model_type`` (`veomni.models.family.LoraTargets`). Returns the adapted module FQNs (and fused experts
    projections, ``<experts>.gate_up_proj``).
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    declared = lora_targets(model_type) if isinstance(model_type, str) else None
    targets = select_targets(model, spec, declared)
    inject_lora(model, spec, targets, adapter_dtype=adapter_dtype)
    return targets


@contextlib.contextmanager
def disabled_adapters(model: nn.Module) -> Iterator[None]:
    """Within the block, ``model``'s adapters add nothing (each adapted layer's and experts module's scaling is 0):
    the model computes its frozen base, as PEFT's ``disable_adapter`` does -- the reference model of preference
    training with LoRA, without a second copy of the weights. ``lora.modules_to_save`` copies are not reverted, so
    a caller that needs the exact base refuses them."""
    adapted = [*adapted_layers(model).values(), *adapted_experts(model).values()]
    saved = [m.lora_scaling for m in adapted]
    for module in adapted:
        module.lora_scaling = 0.0
    try:
        yield
    finally:
        for module, scaling in zip(adapted, saved, strict=True):
            module.lora_scaling = scaling


def init_lora(model: nn.Module, spec: LoraSpec, seed: int) -> None:
    """Fill the adapters of a materialised (and loaded) model: from ``spec.init_from`` (a PEFT adapter directory)
    when set, else with ``spec.init`` seeded by ``seed`` (the same values on any sharding)."""
    if spec.init_from is not None:
        load_peft_adapter(model, spec, spec.init_from)
    else:
        init_adapters(model, spec, seed)
