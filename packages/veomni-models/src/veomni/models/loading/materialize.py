"""Filling a model built without initialisation: the model's own (HF) init, and recomputed buffers.

`hf_init_fn` mirrors transformers' ``initialize_weights`` one module at a time (each module is initialised by
its nearest ``PreTrainedModel``'s ``_initialize_weights``, children before parents), so it can run as the
``init_fn`` of `veomni.core.fsdp.materialize_sharded` on DTensor shards. Tied parameters take their tie
source's initialisation, as in transformers (which initialises both, then ties).

`buffers_init_fn` does the minimum before a checkpoint is loaded: it recomputes non-persistent buffers
(rotary ``inv_freq``), which no checkpoint holds, through the same ``_init_weights``. Both check afterwards
that every non-persistent buffer was actually written (it is first filled with a sentinel), so a buffer the
model's init does not know how to rebuild is an error, not garbage.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from veomni.models.loading.targets import dtensor_region

HF_FLAG = "_is_hf_initialized"


def _owners(model: nn.Module) -> dict[int, PreTrainedModel]:
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"expected a transformers PreTrainedModel, got {type(model).__name__}")
    owners: dict[int, PreTrainedModel] = {}

    def walk(module: nn.Module, owner: PreTrainedModel) -> None:
        owner = module if isinstance(module, PreTrainedModel) else owner
        owners[id(module)] = owner
        for child in module.children():
            walk(child, owner)

    walk(model, model)
    return owners


def _sentinel(buf: torch.Tensor) -> float | int:
    if buf.is_floating_point() or buf.is_complex():
        return float("nan")
    if buf.dtype == torch.bool:
        raise TypeError("a non-persistent bool buffer cannot be checked for recomputation")
    return torch.iinfo(buf.dtype).min


def _unwritten(buf: torch.Tensor, sentinel: float | int) -> bool:
    return bool(torch.isnan(buf).any()) if sentinel != sentinel else bool((buf == sentinel).any())


def _guard_buffers(module: nn.Module, qualname: Callable[[str], str], init: Callable[[], None]) -> None:
    names = [n for n in module._non_persistent_buffers_set if module._buffers.get(n) is not None]
    marks = {}
    for name in names:
        buf = module._buffers[name]
        marks[name] = _sentinel(buf)
        buf.fill_(marks[name])
    init()
    stale = [qualname(n) for n in names if _unwritten(module._buffers[n], marks[n])]
    if stale:
        raise RuntimeError(
            f"non-persistent buffers {stale} of {type(module).__name__} were not recomputed by the model's "
            "_init_weights; veomni cannot restore them after building on the meta device (build with "
            "init_device set to a real device, or teach _init_weights to compute them)"
        )


def _zero_sharded_padding_row(module: nn.Module, prefix: str) -> None:
    # transformers zeroes an embedding's padding row with `init.zeros_(weight[padding_idx])`. On a row-sharded
    # DTensor that index returns a gathered copy, so the zeros never reach the shard: write them to it here.
    weight = getattr(module, "weight", None)
    pad = getattr(module, "padding_idx", None)
    if not isinstance(module, nn.Embedding) or pad is None or not isinstance(weight, DTensor):
        return
    if getattr(weight, HF_FLAG, False):
        return  # a tie target: transformers leaves it to the tie source
    rows = dtensor_region(f"{prefix}.weight", weight)[0]
    if rows.start <= pad < rows.stop:
        weight.to_local()[pad - rows.start].zero_()


def _module_names(model: nn.Module) -> dict[int, str]:
    return {id(m): n for n, m in model.named_modules(remove_duplicate=False)}


def hf_init_fn(model: PreTrainedModel, *, check_buffers: bool = True) -> Callable[[nn.Module], None]:
    """``init_fn(module)`` initialising ``module`` exactly as transformers' ``initialize_weights`` would.

    Call it on every module, children before parents (``model.apply`` order), under ``torch.no_grad()``.
    ``check_buffers`` (for models built on meta, whose buffers hold garbage) requires the init to rewrite
    every non-persistent buffer.
    """
    owners = _owners(model)
    names = _module_names(model)
    mapping = model.get_expanded_tied_weights_keys(all_submodels=True)  # {target: source}
    params = dict(model.named_parameters(remove_duplicate=False))
    # Only tie targets that really share the source's tensor are skipped; an untied copy gets its own init.
    tied_targets = {t for t, s in mapping.items() if t in params and s in params and params[t] is params[s]}

    def init_fn(module: nn.Module) -> None:
        prefix = names.get(id(module), "")

        def qual(name: str) -> str:
            return f"{prefix}.{name}" if prefix else name

        skip = [p for n, p in module.named_parameters(recurse=False) if qual(n) in tied_targets]
        owner = owners[id(module)]
        for p in skip:
            setattr(p, HF_FLAG, True)  # transformers.initialization leaves flagged tensors alone

        def run() -> None:
            owner._initialize_weights(module, owner.is_custom_code())
            _zero_sharded_padding_row(module, prefix)

        try:
            if check_buffers:
                _guard_buffers(module, qual, run)
            else:
                run()
        finally:
            for p in skip:
                if HF_FLAG in p.__dict__:
                    delattr(p, HF_FLAG)

    return init_fn


def buffers_init_fn(model: PreTrainedModel) -> Callable[[nn.Module], None]:
    """``init_fn(module)`` that only recomputes ``module``'s non-persistent buffers (parameters are left as
    they are, for a checkpoint to fill)."""
    owners = _owners(model)
    names = _module_names(model)

    def init_fn(module: nn.Module) -> None:
        if not any(module._buffers.get(n) is not None for n in module._non_persistent_buffers_set):
            return
        prefix = names.get(id(module), "")
        owner = owners[id(module)]
        _guard_buffers(
            module,
            lambda n: f"{prefix}.{n}" if prefix else n,
            lambda: owner._init_weights(module),
        )

    return init_fn
