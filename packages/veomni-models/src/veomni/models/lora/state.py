"""Adapter tensors of a (possibly FSDP2-sharded) model: seeded init, whole-tensor gather and load, and merging.

Every function here works on whole (checkpoint-shaped) tensors and lets `veomni.models.loading.targets` map them to
each rank's shard, so a plain model, an FSDP2 model and an EP-sliced one take the same values (per-expert adapters
are EP-sliced with their experts: the gathers take the ``parallel_state`` the model was sharded with).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping

import torch
from torch import nn

from veomni.core.parallel_state import ParallelState
from veomni.models.loading.targets import gather_target, model_targets
from veomni.models.lora.experts import adapted_experts, expert_adapter_weights
from veomni.models.lora.layers import ADAPTER_PARAMS, adapted_layers, adapter_init
from veomni.models.lora.spec import LoraSpec


def trainable_keys(model: nn.Module) -> list[str]:
    """State-dict keys of the parameters a LoRA run trains (adapters and modules to save), in model order."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def adapter_keys(model: nn.Module) -> list[str]:
    """State-dict keys of the ``lora_A`` / ``lora_B`` weights (and the experts' ``*_lora_A`` / ``*_lora_B``), in
    model order."""
    return [n for n, _ in model.named_parameters() if n.endswith(ADAPTER_PARAMS)]


@torch.no_grad()
def init_adapters(model: nn.Module, spec: LoraSpec, seed: int) -> None:
    """Fill every adapter with ``spec.init``, from a generator seeded by ``seed`` and the parameter's name, so the
    values do not depend on the sharding, the rank or the order in which parameters are visited."""
    targets = model_targets(model)
    for key in adapter_keys(model):
        target = targets[key]
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
        which = "A" if key.endswith(("lora_A.weight", "_lora_A")) else "B"
        full = adapter_init(target.full_shape, which, spec.init, generator)
        target.local.copy_(full[target.region])


def has_adapters(model: nn.Module) -> bool:
    """Whether ``model`` carries LoRA adapters (on linear layers or fused experts)."""
    return bool(adapted_layers(model) or adapted_experts(model))


def gather_trainable(
    model: nn.Module, parallel_state: ParallelState | None = None
) -> dict[str, torch.Tensor]:
    """Whole copies of every trained tensor (``{state-dict key: tensor}``, each in its stored dtype, on CPU).
    Collective under FSDP2 and EP: every rank calls it and gets the same tensors (``parallel_state``: the one the
    model was sharded with, needed when experts adapters are EP-sliced)."""
    targets = model_targets(model)
    with torch.no_grad():
        return {key: gather_target(targets[key], parallel_state).cpu() for key in trainable_keys(model)}


@torch.no_grad()
def load_trainable(model: nn.Module, tensors: Mapping[str, torch.Tensor], *, source: str) -> None:
    """Copy whole tensors into the model's trained parameters (each rank takes its shard).

    Raises:
        ValueError: missing or unexpected keys, or a wrong shape (all named, with ``source``).
    """
    targets = model_targets(model)
    want = trainable_keys(model)
    missing = [k for k in want if k not in tensors]
    unexpected = [k for k in tensors if k not in want]
    wrong = [
        f"{k}: expected {list(targets[k].full_shape)}, found {list(tensors[k].shape)}"
        for k in want
        if k in tensors and tuple(tensors[k].shape) != targets[k].full_shape
    ]
    if missing or unexpected or wrong:
        raise ValueError(
            f"{source} does not fit this model's adapters: missing {missing[:8]} ({len(missing)}), unexpected "
            f"{unexpected[:8]} ({len(unexpected)}), wrong shapes {wrong[:4]}"
        )
    for k in want:
        target = targets[k]
        target.local.copy_(tensors[k][target.region].to(target.local.dtype))


def merge_fetcher(
    model: nn.Module, parallel_state: ParallelState | None = None
) -> tuple[set[str], Callable[[str, torch.Tensor], torch.Tensor]]:
    """For a merged export: the adapter keys to leave out, and ``merge(key, whole base tensor)`` that returns
    ``W + scaling * B @ A`` for an adapted layer's weight, and per expert ``W[e] + scaling * B[e] @ A[e]`` for an
    adapted fused experts projection (computed in fp32, returned in ``W``'s dtype); any other tensor unchanged.
    ``merge`` gathers the adapters: collective under FSDP2 and EP (``parallel_state``), like the export's gathers."""
    # {weight key: (A key, B key, scaling)}
    by_weight = {
        f"{name}.weight": (f"{name}.lora_A.weight", f"{name}.lora_B.weight", layer.lora_scaling)
        for name, layer in adapted_layers(model).items()
    }
    for weight, (a_key, b_key) in expert_adapter_weights(model).items():
        by_weight[weight] = (a_key, b_key, model.get_submodule(weight.rpartition(".")[0]).lora_scaling)
    targets = model_targets(model)

    def merge(key: str, full: torch.Tensor) -> torch.Tensor:
        hit = by_weight.get(key)
        if hit is None:
            return full
        a_key, b_key, scaling = hit
        a = gather_target(targets[a_key], parallel_state).float().to(full.device)
        b = gather_target(targets[b_key], parallel_state).float().to(full.device)
        # [out, r] @ [r, in], or per expert [E, out, r] @ [E, r, in].
        return (full.float() + scaling * (b @ a)).to(full.dtype)

    return set(adapter_keys(model)), merge
