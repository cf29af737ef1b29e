"""Adapter tensors of a (possibly FSDP2-sharded) model: seeded init, whole-tensor gather and load, and merging.

Every function here works on whole (checkpoint-shaped) tensors and lets `veomni.models.loading.targets` map them to
each rank's shard, so a plain model, an FSDP2 model and an EP-sliced one take the same values.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping

import torch
from torch import nn

from veomni.models.loading.targets import Target, gather_target, model_targets
from veomni.models.lora.layers import ADAPTER_PARAMS, LoraLinear, adapted_layers, adapter_init
from veomni.models.lora.spec import LoraSpec


def trainable_keys(model: nn.Module) -> list[str]:
    """State-dict keys of the parameters a LoRA run trains (adapters and modules to save), in model order."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def adapter_keys(model: nn.Module) -> list[str]:
    """State-dict keys of the ``lora_A`` / ``lora_B`` weights, in model order."""
    return [n for n, _ in model.named_parameters() if n.endswith(ADAPTER_PARAMS)]


@torch.no_grad()
def init_adapters(model: nn.Module, spec: LoraSpec, seed: int) -> None:
    """Fill every adapter with ``spec.init``, from a generator seeded by ``seed`` and the parameter's name, so the
    values do not depend on the sharding, the rank or the order in which parameters are visited."""
    targets = model_targets(model)
    for key in adapter_keys(model):
        target = targets[key]
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
        which = "A" if key.endswith("lora_A.weight") else "B"
        full = adapter_init(target.full_shape, which, spec.init, generator)
        target.local.copy_(full[target.region])


def _gather(target: Target) -> torch.Tensor:
    # FSDP shards (CPU-offloaded ones too) gathered whole; dense adapters are never EP-sliced.
    return gather_target(target, None)


def gather_trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    """Whole copies of every trained tensor (``{state-dict key: tensor}``, each in its stored dtype, on CPU).
    Collective under FSDP2: every rank calls it and gets the same tensors."""
    targets = model_targets(model)
    with torch.no_grad():
        return {key: _gather(targets[key]).cpu() for key in trainable_keys(model)}


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


def merge_fetcher(model: nn.Module) -> tuple[set[str], Callable[[str, torch.Tensor], torch.Tensor]]:
    """For a merged export: the adapter keys to leave out, and ``merge(key, whole base tensor)`` that returns
    ``W + scaling * B @ A`` for an adapted layer's weight (computed in fp32, returned in ``W``'s dtype) and any other
    tensor unchanged. ``merge`` gathers the layer's adapters: collective under FSDP2, like the export's gathers."""
    layers = adapted_layers(model)
    by_weight: dict[str, tuple[str, LoraLinear]] = {
        f"{name}.weight": (name, layer) for name, layer in layers.items()
    }
    targets = model_targets(model)

    def merge(key: str, full: torch.Tensor) -> torch.Tensor:
        hit = by_weight.get(key)
        if hit is None:
            return full
        name, layer = hit
        a = _gather(targets[f"{name}.lora_A.weight"]).float().to(full.device)
        b = _gather(targets[f"{name}.lora_B.weight"]).float().to(full.device)
        return (full.float() + layer.lora_scaling * (b @ a)).to(full.dtype)

    return set(adapter_keys(model)), merge
