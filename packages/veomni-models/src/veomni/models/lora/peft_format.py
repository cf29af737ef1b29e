"""LoRA adapters in PEFT's own format: ``adapter_config.json`` (written and read by ``peft.LoraConfig``) and
``adapter_model.safetensors`` with PEFT's keys (``base_model.model.<module>.lora_A.weight``; modules trained in
full under their own names). ``peft.PeftModel.from_pretrained(plain transformers model, directory)`` loads what
`save_peft_adapter` writes, and `load_peft_adapter` reads adapters PEFT saved. Per-expert adapters on fused MoE
experts are PEFT's ``target_parameters`` (layout and key nesting: `veomni.models.lora.experts`).
"""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

from veomni.core.parallel_state import ParallelState
from veomni.models.loading.targets import model_targets
from veomni.models.lora.experts import (
    from_peft_layout,
    peft_expert_keys,
    peft_target_parameters,
    to_peft_layout,
)
from veomni.models.lora.layers import ADAPTER_PARAMS, adapted_layers
from veomni.models.lora.spec import LoraSpec
from veomni.models.lora.state import gather_trainable, load_trainable

log = logging.getLogger("veomni.models")

PEFT_PREFIX = "base_model.model."
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"


def _peft() -> Any:
    try:
        import peft
    except ImportError as e:
        raise ImportError(
            "LoRA adapters are written and read in PEFT's format with the peft package, which is not installed: "
            "pip install 'veomni-models[peft]'"
        ) from e
    return peft


def _peft_targets(adapted: list[str]) -> list[str]:
    # Full module names, never leaf names: PEFT also maps a leaf name such as down_proj onto fused MoE expert
    # parameters of that name (transformers' experts modules), which we did not adapt.
    return sorted(adapted)


def peft_config(model: nn.Module, spec: LoraSpec, base_model_name_or_path: str | None = None) -> Any:
    """The ``peft.LoraConfig`` equal to ``spec`` as applied to ``model`` (its adapted layers as ``target_modules``,
    its adapted fused experts projections as ``target_parameters``, and its saved modules)."""
    peft = _peft()
    adapted = list(adapted_layers(model))
    parameters = peft_target_parameters(model)
    if not adapted and not parameters:
        raise ValueError(f"{type(model).__name__} has no LoRA layers (inject_lora first)")
    saved = sorted(
        {
            n.rsplit(".", 1)[0]
            for n, p in model.named_parameters()
            if p.requires_grad and not n.endswith(ADAPTER_PARAMS)
        }
    )
    return peft.LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        use_rslora=spec.use_rslora,
        target_modules=_peft_targets(adapted),
        target_parameters=parameters or None,
        modules_to_save=[n.rsplit(".", 1)[-1] if "." in n else n for n in _module_names(saved)] or None,
        base_model_name_or_path=base_model_name_or_path,
        bias="none",
    )


def _module_names(param_owners: list[str]) -> list[str]:
    # Parameter owner modules -> the distinct modules, outermost first (lm_head, model.embed_tokens).
    out: list[str] = []
    for n in sorted(param_owners, key=len):
        if not any(n == o or n.startswith(o + ".") for o in out):
            out.append(n)
    return out


def save_peft_adapter(
    model: nn.Module,
    spec: LoraSpec,
    out_dir: str | os.PathLike,
    *,
    base_model_name_or_path: str | None = None,
    dtype: torch.dtype | None = None,
    parallel_state: ParallelState | None = None,
) -> Path:
    """Write the model's adapters (and modules trained in full) as a PEFT adapter directory.

    Collective under FSDP2 and EP (every rank gathers; global rank 0 writes); ``parallel_state``: the one the model
    was sharded with (needed for EP-sliced experts adapters). ``dtype``: cast the tensors (default: each one's
    stored dtype). Returns the directory.
    """
    config = peft_config(model, spec, base_model_name_or_path)
    _check_peft_keeps_targets(model, config)
    tensors = peft_state_dict(model, parallel_state)
    out = Path(out_dir)
    if not dist.is_initialized() or dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(str(out))
        payload = {k: (t.to(dtype) if dtype else t).contiguous() for k, t in tensors.items()}
        save_file(payload, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
        log.info("lora: wrote %d adapter tensors to %s (PEFT format)", len(payload), out)
    if dist.is_initialized():
        dist.barrier()
    return out


def peft_state_dict(model: nn.Module, parallel_state: ParallelState | None = None) -> dict[str, torch.Tensor]:
    """The trained tensors under PEFT's saved keys (``base_model.model.<key>``; experts adapters in PEFT's layout and
    nesting, `veomni.models.lora.experts`), whole, on CPU. Collective under FSDP2 and EP, as `gather_trainable`."""
    tensors = gather_trainable(model, parallel_state)
    for key, (peft_key, which) in peft_expert_keys(model).items():
        tensors[peft_key] = to_peft_layout(tensors.pop(key), which)
    return {PEFT_PREFIX + k: t for k, t in tensors.items()}


def _check_peft_keeps_targets(model: nn.Module, config: Any) -> None:
    # PEFT re-targets some MoE model types on load (its transformers v4 -> v5 conversion): a layer ending in
    # gate_proj / up_proj / down_proj becomes the fused experts' parameters. Run PEFT's own conversion on a copy
    # and refuse an adapter PEFT would load onto other layers than ours.
    from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers

    probe = copy.deepcopy(config)
    convert_peft_config_for_transformers(probe, model=model, conversions=None)
    moved_to = set(probe.target_parameters or ()) - set(config.target_parameters or ())
    if set(probe.target_modules or ()) != set(config.target_modules) or moved_to:
        moved = sorted(set(config.target_modules) - set(probe.target_modules or ()))
        raise ValueError(
            f"lora: PEFT would load this adapter onto other layers: for model_type "
            f"{getattr(model.config, 'model_type', None)!r} it maps {moved[:4]} ({len(moved)} layers) onto the fused "
            f"experts' {sorted(moved_to)}. Leave the dense MLP / shared-expert layers out of lora.targets "
            "(lora.exclude) to export a PEFT adapter (adapt the experts with the experts group), or export merged "
            "weights instead"
        )


def spec_differences(spec: LoraSpec, config: Any) -> list[str]:
    """What differs between ``spec`` and a ``peft.LoraConfig`` in what the adapter weights mean."""
    diffs = []
    for ours, theirs, name in (
        (spec.rank, config.r, "rank (r)"),
        (float(spec.alpha), float(config.lora_alpha), "alpha (lora_alpha)"),
        (spec.use_rslora, bool(config.use_rslora), "use_rslora"),
        (False, bool(config.use_dora), "use_dora"),
    ):
        if ours != theirs:
            diffs.append(f"{name}: ours {ours!r}, the adapter's {theirs!r}")
    if config.rank_pattern or config.alpha_pattern:
        diffs.append(
            f"per-layer rank/alpha patterns ({config.rank_pattern}, {config.alpha_pattern}) are not supported"
        )
    return diffs


def load_peft_adapter(model: nn.Module, spec: LoraSpec, adapter_dir: str | os.PathLike) -> None:
    """Fill the model's adapters (and modules trained in full) from a PEFT adapter directory.

    Raises:
        FileNotFoundError: no ``adapter_config.json`` / ``adapter_model.safetensors`` there.
        ValueError: the adapter's rank, alpha or scaling rule differs from ``spec``, or its tensors do not match
            the adapted layers (missing / unexpected names listed).
    """
    peft = _peft()
    d = Path(adapter_dir)
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (d / name).is_file():
            raise FileNotFoundError(f"lora.init_from: {d} has no {name} (expected a PEFT adapter directory)")
    config = peft.LoraConfig.from_pretrained(str(d))
    diffs = spec_differences(spec, config)
    if diffs:
        raise ValueError(
            f"lora.init_from {d}: the adapter was trained with another LoRA setup: {'; '.join(diffs)}"
        )
    raw = load_file(str(d / WEIGHTS_NAME))
    tensors = {}
    for k, t in raw.items():
        key = k.removeprefix(PEFT_PREFIX)
        # PEFT keeps the adapter name out of saved keys, but older files may carry ".default".
        tensors[key.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")] = t
    targets = model_targets(model)
    for key, (peft_key, which) in peft_expert_keys(model).items():
        if peft_key in tensors:
            # Back to ours; an absent one is reported missing (under our name) by load_trainable.
            tensors[key] = from_peft_layout(tensors.pop(peft_key), which, targets[key].full_shape, peft_key)
    load_trainable(model, tensors, source=f"the PEFT adapter in {d}")
    log.info("lora: loaded %d adapter tensors from %s", len(tensors), d)
