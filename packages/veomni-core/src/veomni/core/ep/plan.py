"""Expert-parallel sharding of fused expert parameters.

An `ExpertPlan` names, by glob, the fused expert parameters of a model: tensors shaped ``[E, ...]`` whose
dim 0 indexes experts (for example ``layers.*.moe.experts.gate_up_proj`` shaped ``[E, 2I, H]``).
`apply_expert_plan` keeps on each EP rank only its contiguous block of experts, ``[r*E/ep, (r+1)*E/ep)``,
as a plain local ``nn.Parameter``. The EP dimension is deliberately not kept in tensor metadata (no DTensor
over ``ep``): FSDP2 later shards the local block over ``ep_fsdp``, and a DTensor cannot carry both meshes.
The global layout is recorded instead as side metadata, an `ExpertShard`, which checkpointing uses to
rebuild the ``[E, ...]`` tensor.

Glob syntax: FQNs are split on ``.``; ``*`` matches within a single component and never crosses a dot, so
``layers.*.w`` matches ``layers.10.w`` but not ``layers.1.0.w``, and ``layers.1.*`` never matches under
``layers.10``. A pattern must match the whole FQN.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from veomni.core.fqn import compile_fqn_glob

_SHARD_ATTR = "_veomni_expert_shard"
# The same records, {param name: ExpertShard}, kept on the owning module too: the parameter object does not
# survive `to_empty` from meta (nor FSDP2, which swaps in DTensor parameters), while the module does.
_MODULE_ATTR = "_veomni_expert_shards"


def _check_patterns(instance: object, attribute: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
    if not value:
        raise ValueError("ExpertPlan.patterns must name at least one fused expert parameter, got ()")
    for pattern in value:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"ExpertPlan.patterns must be non-empty strings, got {pattern!r}")
        parts = pattern.split(".")
        if any(not part for part in parts):
            raise ValueError(f"ExpertPlan pattern {pattern!r} has an empty FQN component (stray '.')")
        if "**" in pattern:
            raise ValueError(
                f"ExpertPlan pattern {pattern!r} uses '**'; '*' matches exactly one FQN component, "
                "write one '*' per component"
            )
        if any(ch.isspace() for ch in pattern):
            raise ValueError(f"ExpertPlan pattern {pattern!r} contains whitespace")


def _to_tuple(value: object) -> tuple[Any, ...]:
    # A bare string would otherwise become a tuple of characters, each a valid one-letter pattern.
    if isinstance(value, str):
        raise TypeError(f"ExpertPlan.patterns must be a sequence of strings, got the string {value!r}")
    return tuple(value)  # type: ignore[arg-type]


@attrs.frozen(kw_only=True)
class ExpertPlan:
    """Which parameters are fused expert tensors, sharded on dim 0 across the EP group.

    Attributes:
        patterns: glob FQNs (relative to the model `apply_expert_plan` receives) of parameters shaped
            ``[E, ...]``; ``*`` matches exactly one FQN component.
    """

    patterns: tuple[str, ...] = attrs.field(converter=_to_tuple, validator=_check_patterns)

    def matches(self, fqn: str) -> bool:
        """Whether the parameter FQN ``fqn`` is matched by any pattern."""
        return any(compile_fqn_glob(p).fullmatch(fqn) for p in self.patterns)


@attrs.frozen(kw_only=True)
class ExpertShard:
    """Where a local expert parameter sits in its global ``[E, ...]`` tensor.

    Attributes:
        fqn: the parameter's FQN in the model the plan was applied to.
        num_experts: ``E``, the global size of dim ``dim``.
        ep_size: EP degree; each rank holds ``E / ep_size`` experts.
        ep_rank: this rank's index in the EP group; it holds experts ``[start, stop)``.
        dim: the sharded dimension (always 0: experts are the leading dim of fused tensors).
    """

    fqn: str
    num_experts: int
    ep_size: int
    ep_rank: int
    dim: int = 0

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def start(self) -> int:
        return self.ep_rank * self.local_experts

    @property
    def stop(self) -> int:
        return self.start + self.local_experts


def expert_shard_of(param: torch.Tensor) -> ExpertShard | None:
    """The `ExpertShard` recorded on ``param`` by `apply_expert_plan`, or None for a non-expert tensor.

    The record lives on the parameter object, so it is gone once something replaces that object (``to_empty``
    from meta, FSDP2's ``fully_shard``); use `expert_shards` on the model, which reads the owning modules.
    """
    return getattr(param, _SHARD_ATTR, None)


def expert_shards(model: nn.Module) -> dict[str, ExpertShard]:
    """``{fqn: ExpertShard}`` for every EP-sharded parameter under ``model`` (FQNs relative to ``model``).

    Read from the owning modules, so it survives ``to_empty`` and FSDP2 wrapping. ``ExpertShard.fqn`` keeps
    the FQN relative to the model the plan was applied to.
    """
    found: dict[str, ExpertShard] = {}
    for module_fqn, module in model.named_modules():
        for name, shard in getattr(module, _MODULE_ATTR, {}).items():
            found[f"{module_fqn}.{name}" if module_fqn else name] = shard
    return found


def _match_parameters(model: nn.Module, plan: ExpertPlan) -> list[tuple[str, nn.Parameter]]:
    """``(fqn, param)`` for every planned parameter; raises if a pattern matches nothing or one is tied."""
    all_named = list(model.named_parameters(remove_duplicate=False))
    names_by_id: dict[int, list[str]] = {}
    for fqn, param in all_named:
        names_by_id.setdefault(id(param), []).append(fqn)
    compiled = [(p, compile_fqn_glob(p)) for p in plan.patterns]
    hits: dict[str, int] = {p: 0 for p in plan.patterns}
    matched: list[tuple[str, nn.Parameter]] = []
    for fqn, param in all_named:
        patterns = [p for p, rx in compiled if rx.fullmatch(fqn)]
        if not patterns:
            continue
        for p in patterns:
            hits[p] += 1
        aliases = names_by_id[id(param)]
        if len(aliases) > 1:
            # Slicing one alias would leave the others holding the full tensor (or a different slice).
            raise ValueError(
                f"expert parameter {fqn!r} is tied to {aliases}; tied expert weights are not supported"
            )
        matched.append((fqn, param))
    missing = [p for p, n in hits.items() if n == 0]
    if missing:
        sample = [fqn for fqn, _ in all_named[:8]]
        more = ", ..." if len(all_named) > 8 else ""
        raise ValueError(
            f"ExpertPlan pattern(s) {missing} matched no parameter of {type(model).__name__} "
            f"('*' matches exactly one FQN component); its parameters are {sample}{more}"
        )
    return matched


def apply_expert_plan(
    model: nn.Module, plan: ExpertPlan, ep_size: int, ep_rank: int
) -> dict[str, ExpertShard]:
    """Replace every planned ``[E, ...]`` parameter with this EP rank's slice ``[E/ep_size, ...]``, in place.

    Each replacement is a plain ``nn.Parameter`` (same dtype, device and ``requires_grad``) holding a
    contiguous copy of experts ``[ep_rank*E/ep_size, (ep_rank+1)*E/ep_size)``, registered on the owning module
    under the same name; the full tensor is released once nothing else references it. On the meta device no
    data is touched. Call this before FSDP is applied (parameters must not be DTensors) and before the
    optimizer is built (it holds the old parameter objects).

    Args:
        model: the module tree; modified in place.
        plan: which parameters to shard.
        ep_size: EP degree, at least 1 (1 keeps every expert but still records the metadata).
        ep_rank: this rank's index in the EP group, ``0 <= ep_rank < ep_size``.

    Returns:
        ``{fqn: ExpertShard}`` for every sharded parameter, in ``named_parameters`` order. The same record is
        attached to each new parameter (read with `expert_shard_of`) and to its owning module (read with
        `expert_shards`, which survives ``to_empty`` and FSDP2).
    """
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"apply_expert_plan: ep_size must be a positive int, got {ep_size!r}")
    if isinstance(ep_rank, bool) or not isinstance(ep_rank, int) or not 0 <= ep_rank < ep_size:
        raise ValueError(f"apply_expert_plan: ep_rank must be an int in [0, {ep_size}), got {ep_rank!r}")
    matched = _match_parameters(model, plan)
    # Check everything before changing anything, so that an error leaves the model untouched.
    for fqn, param in matched:
        owner_fqn, _, name = fqn.rpartition(".")
        owner_records = getattr(model.get_submodule(owner_fqn), _MODULE_ATTR, {})
        existing = expert_shard_of(param) or owner_records.get(name)
        if existing is not None:
            raise ValueError(
                f"expert parameter {fqn!r} is already EP-sharded ({existing}); apply the plan once"
            )
        if isinstance(param, DTensor):
            raise ValueError(
                f"expert parameter {fqn!r} is already a DTensor ({param.placements}); apply the expert plan "
                "before FSDP/tensor parallelism"
            )
        if param.dim() == 0:
            raise ValueError(f"expert parameter {fqn!r} is 0-dim; expected a fused tensor shaped [E, ...]")
        num_experts = param.shape[0]
        if num_experts == 0 or num_experts % ep_size != 0:
            raise ValueError(
                f"expert parameter {fqn!r} has shape {tuple(param.shape)}: its {num_experts} experts (dim 0) "
                f"cannot be split evenly across ep_size={ep_size} ranks"
            )
    shards: dict[str, ExpertShard] = {}
    for fqn, param in matched:
        shard = ExpertShard(fqn=fqn, num_experts=param.shape[0], ep_size=ep_size, ep_rank=ep_rank)
        # clone: a view would pin the whole [E, ...] storage in memory.
        local = param.detach()[shard.start : shard.stop].clone(memory_format=torch.contiguous_format)
        new_param = nn.Parameter(local, requires_grad=param.requires_grad)
        setattr(new_param, _SHARD_ATTR, shard)
        owner_fqn, _, name = fqn.rpartition(".")
        owner = model.get_submodule(owner_fqn)
        setattr(owner, name, new_param)
        setattr(owner, _MODULE_ATTR, {**getattr(owner, _MODULE_ATTR, {}), name: shard})
        shards[fqn] = shard
    return shards


def expert_module_fqns(model: nn.Module, plan: ExpertPlan) -> list[str]:
    """FQNs of the modules that own planned parameters, sorted and de-duplicated.

    Each of these modules must become its own FSDP unit on the ``ep_fsdp`` mesh: left inside a dense unit, its
    already EP-sliced parameters would be sharded over the dense mesh. ``""`` denotes ``model`` itself. Works
    before and after `apply_expert_plan` (names do not change); raises like it when a pattern matches nothing.
    """
    return sorted({fqn.rpartition(".")[0] for fqn, _ in _match_parameters(model, plan)})
