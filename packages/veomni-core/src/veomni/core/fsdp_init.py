"""Materialising a model sharded on the meta device, and loading a full (unsharded) state dict into it.

The flow for large models: build on ``torch.device("meta")`` (no memory), `apply_fsdp2` (shards metadata
only), `materialize_sharded` (allocates this rank's shards and runs an explicit init), then optionally
`load_full_state_dict`. Nothing here initialises silently: values are written only by the caller's ``init_fn``
or by a state dict that must match the model key for key and shape for shape.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from veomni.core.ep.plan import expert_shard_of


class StateDictMismatchError(ValueError):
    """A full state dict does not match the model: missing keys, unexpected keys or wrong shapes.

    Attributes:
        missing: model keys absent from the state dict.
        unexpected: state-dict keys the model does not have.
        mismatched: ``(key, expected full shape, found shape)`` for every wrong shape.
    """

    def __init__(
        self,
        missing: list[str],
        unexpected: list[str],
        mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]],
    ) -> None:
        self.missing = missing
        self.unexpected = unexpected
        self.mismatched = mismatched
        lines = ["the state dict does not match the model:"]
        if missing:
            lines.append(f"  missing keys ({len(missing)}): {missing}")
        if unexpected:
            lines.append(f"  unexpected keys ({len(unexpected)}): {unexpected}")
        for key, expected, found in mismatched:
            lines.append(f"  {key}: expected full shape {list(expected)}, found {list(found)}")
        super().__init__("\n".join(lines))


def materialize_sharded(
    model: nn.Module,
    device: torch.device | str,
    init_fn: Callable[[nn.Module], None],
    *,
    cpu_offload: bool = False,
) -> nn.Module:
    """Allocate a meta-built (sharded) model's tensors on ``device`` and initialise them with ``init_fn``.

    ``to_empty`` leaves every parameter and buffer uninitialised (garbage, not zeros), so ``init_fn`` is
    required: it is called once per module, children before parents (like ``nn.Module.apply``), under
    ``torch.no_grad()``, and must write every parameter and buffer the module owns directly, including
    non-persistent buffers (e.g. rotary ``inv_freq``), which no checkpoint restores. If a full checkpoint will
    be loaded next, an ``init_fn`` that only fills the non-persistent buffers is enough. Parameters are
    DTensor shards at this point: in-place ops on them (``fill_``, ``copy_`` of a DTensor, ``nn.init``
    functions) act on the local shard.

    `ExpertShard` records on the parameters survive (``to_empty`` would otherwise drop them).

    Args:
        model: the module after `apply_fsdp2` (or any module built on meta).
        device: the compute device (``state.device``).
        init_fn: ``init_fn(module)`` initialises ``module``'s own parameters and buffers in place.
        cpu_offload: True when the policy offloads: parameters are allocated on the CPU, buffers on ``device``
            (FSDP never moves buffers).

    Returns:
        ``model``, materialised in place.
    """
    if not callable(init_fn):
        raise TypeError(
            f"materialize_sharded: init_fn must be a callable taking a module, got {init_fn!r}; there is no "
            "default initialisation (uninitialised memory is never trained silently)"
        )
    device = torch.device(device)
    metadata = {name: dict(p.__dict__) for name, p in model.named_parameters() if p.__dict__}
    model.to_empty(device=torch.device("cpu") if cpu_offload else device)
    if cpu_offload:
        for module in model.modules():
            for name, buf in module.named_buffers(recurse=False):
                module._buffers[name] = buf.to(device)
    for name, p in model.named_parameters():
        for key, value in metadata.get(name, {}).items():
            if key not in p.__dict__:
                setattr(p, key, value)
    with torch.no_grad():
        model.apply(init_fn)
    return model


def _expected_full_shape(target: torch.Tensor) -> tuple[int, ...]:
    shape = tuple(target.shape)  # the DTensor's global shape: [E/ep, ...] for experts
    shard = expert_shard_of(target)
    if shard is not None:
        shape = shape[: shard.dim] + (shard.num_experts,) + shape[shard.dim + 1 :]
    return shape


def load_full_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy a full, unsharded state dict that every rank holds into the (sharded) model, in place.

    Expert parameters (tagged by `expert_shard_of`) take this EP rank's dim-0 slice ``[E/ep, ...]`` of the
    full ``[E, ...]`` tensor; each DTensor then takes its FSDP shard with ``distribute_tensor(...,
    src_data_rank=None)``, a local slice with no communication (every rank already has the data). Values are
    cast to the parameter dtype (e.g. a bf16 checkpoint into fp32 master weights). Everything is checked
    before anything is written.

    Args:
        model: the module (FSDP-sharded or plain), materialised (not on meta).
        state_dict: ``{fqn: full tensor}`` for every parameter and persistent buffer of ``model``, with the
            full (pre-EP, pre-FSDP) shapes; any device and floating dtype.

    Raises:
        StateDictMismatchError: keys missing or unexpected, or shapes different from the full shapes.
    """
    targets = model.state_dict(keep_vars=True)
    missing = sorted(set(targets) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(targets))
    mismatched = []
    for key, target in targets.items():
        if (target.to_local() if isinstance(target, DTensor) else target).is_meta:
            raise ValueError(
                f"load_full_state_dict: {key} is on the meta device; call materialize_sharded first"
            )
        if key in state_dict:
            expected = _expected_full_shape(target)
            if tuple(state_dict[key].shape) != expected:
                mismatched.append((key, expected, tuple(state_dict[key].shape)))
    if missing or unexpected or mismatched:
        raise StateDictMismatchError(missing, unexpected, mismatched)
    with torch.no_grad():
        for key, target in targets.items():
            full = state_dict[key]
            shard = expert_shard_of(target)
            if shard is not None:
                full = full.narrow(shard.dim, shard.start, shard.local_experts)
            if isinstance(target, DTensor):
                full = full.to(dtype=target.dtype)
                local = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
                target.to_local().copy_(local.to_local())
            else:
                target.copy_(full)
