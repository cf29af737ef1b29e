"""FSDP2 application: which modules become FSDP units, on which mesh, with which gradient scaling.

`apply_fsdp2` wraps bottom-up, because each ``fully_shard`` call claims the parameters not already claimed:

1. every expert module (owner of `ExpertPlan` parameters) on the ``ep_fsdp`` mesh, after EP slicing;
2. every block matched by `FSDPPolicy.block_patterns` on the dense FSDP mesh (optionally checkpointed);
3. the output head named by `FSDPPolicy.head`, when given (an untied LM head);
4. the root, which collects what is left (embeddings, final norm, a tied head).

Code that reads a unit's parameters without calling the module (a fused linear-cross-entropy takes the head's
weight) goes through `forward_through`, so that FSDP gathers them and reduces their gradients as for a call.

Meta-device construction, materialisation and loading of full checkpoints are in `veomni.core.fsdp_init`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import attrs
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import Shard

from veomni.core.checkpointing import _checkpoint_forward, _KeptAttention
from veomni.core.ep.plan import ExpertPlan, apply_expert_plan, expert_module_fqns, expert_shard_of
from veomni.core.fqn import match_blocks, pattern_tuple
from veomni.core.fsdp_head import _check_head, _prefetch_head, forward_through
from veomni.core.fsdp_init import StateDictMismatchError, load_full_state_dict, materialize_sharded
from veomni.core.parallel_state import ParallelState

__all__ = [
    "FSDPPolicy",
    "StateDictMismatchError",
    "apply_fsdp2",
    "forward_through",
    "load_full_state_dict",
    "materialize_sharded",
    "set_grad_sync",
]

def _float_dtype_or_none(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise ValueError(f"FSDPPolicy.{attribute.name} must be a floating torch.dtype or None, got {value!r}")


def _check_block_patterns(
    instance: object, attribute: attrs.Attribute[Any], value: tuple[object, ...]
) -> None:
    if not value:
        raise ValueError("FSDPPolicy.block_patterns must name at least one block, e.g. ('layers.*',), got ()")
    for pattern in value:
        if not isinstance(pattern, str) or not pattern or any(ch.isspace() for ch in pattern):
            raise ValueError(f"FSDPPolicy.block_patterns entries must be non-empty strings, got {pattern!r}")
        if any(not part for part in pattern.split(".")):
            raise ValueError(f"FSDPPolicy block pattern {pattern!r} has an empty FQN component (stray '.')")


_BOOL = attrs.validators.instance_of(bool)


@attrs.frozen(kw_only=True)
class FSDPPolicy:
    """How `apply_fsdp2` shards a model.

    Attributes:
        block_patterns: glob FQNs (relative to the model) of the modules that become FSDP units, e.g.
            ``("layers.*",)``. ``*`` matches within one FQN component and never crosses a ``.``. Every pattern
            must match at least one module, and matched modules must not nest.
        param_dtype: dtype of the all-gathered parameters used in forward/backward (None: the stored dtype).
            When set, the stored (master) parameters must all be fp32: `apply_fsdp2` raises rather than cast.
        reduce_dtype: dtype of gradient reduce-scatter / all-reduce (None: ``param_dtype``).
        output_dtype: dtype each unit casts its floating outputs to (None: no cast).
        reshard_after_forward: free gathered block/expert parameters after forward and re-gather in backward.
            The root and head units never reshard after forward (see `apply_fsdp2`).
        head: FQN of an output head to make its own FSDP unit (e.g. ``"lm_head"``), or None to leave it in the
            root. Its own unit is gathered while the last blocks still compute, and its gradient -- an LM head's
            is as large as the embedding's -- is reduce-scattered as soon as the loss's backward is done, under
            the blocks' backward, instead of with the root's after the whole backward. It must share no
            parameter with the rest of the model (a tied head stays in the root).
        activation_checkpointing: recompute each block's forward in backward (non-reentrant checkpoint).
        ac_keep_attention: with ``activation_checkpointing``, save the attention kernels' outputs instead of
            recomputing them (see `apply_activation_checkpointing`).
        cpu_offload: keep sharded parameters, gradients and optimizer state on the CPU.
        pin_memory: pin the offloaded shards (faster copies; pinned memory counts against a container's memory
            limit). Used only with ``cpu_offload``.
        cast_forward_inputs: with ``param_dtype``, every unit casts the floating tensors of its forward inputs to
            it (FSDP2's default). False for models that take inputs of other dtypes on purpose, such as diffusers'
            DiTs: a float32 timestep (rounded to bf16, 910.4 becomes 912) and float32 rotary tables; their callers
            pass the other inputs in ``param_dtype`` themselves.
    """

    block_patterns: tuple[str, ...] = attrs.field(
        converter=pattern_tuple, validator=_check_block_patterns
    )
    param_dtype: torch.dtype | None = attrs.field(default=torch.bfloat16, validator=_float_dtype_or_none)
    reduce_dtype: torch.dtype | None = attrs.field(default=torch.float32, validator=_float_dtype_or_none)
    output_dtype: torch.dtype | None = attrs.field(default=None, validator=_float_dtype_or_none)
    reshard_after_forward: bool = attrs.field(default=True, validator=_BOOL)
    activation_checkpointing: bool = attrs.field(default=False, validator=_BOOL)
    ac_keep_attention: bool = attrs.field(default=False, validator=_BOOL)
    cpu_offload: bool = attrs.field(default=False, validator=_BOOL)
    pin_memory: bool = attrs.field(default=True, validator=_BOOL)
    head: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(str))
    )
    cast_forward_inputs: bool = attrs.field(default=True, validator=_BOOL)

    def __attrs_post_init__(self) -> None:
        if self.ac_keep_attention and not self.activation_checkpointing:
            raise ValueError(
                "FSDPPolicy: ac_keep_attention=True selects what activation checkpointing saves, but "
                "activation_checkpointing is False; set both or neither"
            )
        if self.head is not None and (not self.head or any(not part for part in self.head.split("."))):
            raise ValueError(f"FSDPPolicy.head must be a module FQN such as 'lm_head', got {self.head!r}")

    def mp_policy(self) -> MixedPrecisionPolicy:
        """The ``fully_shard`` mixed-precision policy (floating inputs cast to ``param_dtype`` unless
        ``cast_forward_inputs`` is False)."""
        return MixedPrecisionPolicy(
            param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype, output_dtype=self.output_dtype,
            cast_forward_inputs=self.cast_forward_inputs,
        )  # fmt: skip

    def offload_policy(self) -> OffloadPolicy:
        """``CPUOffloadPolicy`` when ``cpu_offload``, else the no-offload policy."""
        return CPUOffloadPolicy(pin_memory=self.pin_memory) if self.cpu_offload else OffloadPolicy()


def _check_master_dtype(model: nn.Module, policy: FSDPPolicy) -> None:
    if policy.param_dtype is None:
        return
    bad = [
        (n, p.dtype)
        for n, p in model.named_parameters()
        if p.is_floating_point() and p.dtype != torch.float32
    ]
    if bad:
        listed = ", ".join(f"{n} ({d})" for n, d in bad[:6]) + (", ..." if len(bad) > 6 else "")
        raise ValueError(
            f"apply_fsdp2: mixed precision (param_dtype={policy.param_dtype}) keeps fp32 master parameters, "
            f"but {len(bad)} parameter(s) are not fp32: {listed}. Build the model in fp32 (or call "
            "model.float() yourself), or set param_dtype=None to train in the stored dtype"
        )


def _prepare_experts(model: nn.Module, state: ParallelState, plan: ExpertPlan | None) -> list[str]:
    """EP-slice the planned parameters unless already sliced; return the expert module FQNs."""
    if plan is None:
        tagged = [n for n, p in model.named_parameters() if expert_shard_of(p) is not None]
        if tagged:
            raise ValueError(
                f"apply_fsdp2: parameters {tagged[:4]} are EP-sliced expert shards but no expert_plan was "
                "given; pass the ExpertPlan so they get their own units on the ep_fsdp mesh"
            )
        if state.ep_enabled:
            raise ValueError(
                f"apply_fsdp2: expert parallelism is on (ep={state.dims.ep}) but no expert_plan was given; "
                "pass the model's ExpertPlan, or build the ParallelState with ep=1"
            )
        return []
    if not state.ep_enabled:
        raise ValueError(
            "apply_fsdp2: an expert_plan was given but expert parallelism is off (ep=1); without EP, expert "
            "weights are ordinary dense parameters: pass expert_plan=None, or build the ParallelState with "
            "ep>1"
        )
    planned = [(n, p) for n, p in model.named_parameters() if plan.matches(n)]
    shards = [expert_shard_of(p) for _, p in planned]
    if planned and all(s is None for s in shards):
        apply_expert_plan(model, plan, state.dims.ep, state.ep_rank)
    else:
        for (name, _), shard in zip(planned, shards, strict=True):
            if shard is None or (shard.ep_size, shard.ep_rank) != (state.dims.ep, state.ep_rank):
                raise ValueError(
                    f"apply_fsdp2: expert parameter {name!r} has EP shard {shard}, expected every planned "
                    f"parameter sliced for ep_size={state.dims.ep}, ep_rank={state.ep_rank} (or none "
                    "sliced yet)"
                )
    fqns = expert_module_fqns(model, plan)
    for fqn in fqns:
        module = model.get_submodule(fqn)
        stray = [n for n, p in module.named_parameters() if expert_shard_of(p) is None]
        if stray:
            # They would be sharded over ep_fsdp only, although every EP rank holds and updates a full copy:
            # their gradients would miss the other EP ranks' contributions.
            raise ValueError(
                f"apply_fsdp2: expert module {fqn or '<root>'!r} also owns non-expert parameters {stray}; an "
                "expert unit may hold only EP-sliced parameters: move them to another module"
            )
    return fqns


def _experts_by_block(blocks: list[str], expert_fqns: list[str]) -> dict[str, list[str]]:
    owned: dict[str, list[str]] = {b: [] for b in blocks}
    for expert in expert_fqns:
        owner = [b for b in blocks if expert.startswith(b + ".")]
        if not owner:
            raise ValueError(
                f"apply_fsdp2: expert module {expert!r} is not inside any block matched by block_patterns "
                f"{blocks[:4]}...; expert units must nest in a block (prefetch order is set per block)"
            )
        owned[owner[0]].append(expert)
    return owned


def _expert_placement(param: nn.Parameter, shard_size: int) -> Shard:
    # Experts are few per EP rank: dim 0 (E/ep) often does not divide by ep_fsdp, and uneven dim-0 sharding
    # would leave some ranks with empty shards. Take the first dim that splits evenly (FSDP2 needs even splits
    # off dim 0).
    for dim, size in enumerate(param.shape):
        if size % shard_size == 0:
            return Shard(dim)
    raise ValueError(
        f"apply_fsdp2: no dim of the expert parameter shaped {tuple(param.shape)} divides evenly by the "
        f"ep_fsdp size {shard_size}"
    )


def _fully_shard_keep_metadata(
    module: nn.Module,
    *,
    mesh: DeviceMesh,
    reshard_after_forward: bool,
    shard_placement_fn: Callable[[nn.Parameter], Shard],
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
) -> FSDPModule:
    """``fully_shard`` that carries Python attributes (e.g. the `ExpertShard` record) to sharded params."""
    before = {name: p.__dict__ for name, p in module.named_parameters() if p.__dict__}
    sharded = fully_shard(
        module,
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        shard_placement_fn=shard_placement_fn,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
    )
    for name, p in module.named_parameters():
        for key, value in before.get(name, {}).items():
            if key not in p.__dict__:
                setattr(p, key, value)
    return sharded


def _set_prefetch(model: nn.Module, owned: dict[str, list[str]], head: FSDPModule | None) -> None:
    # Nested units blur FSDP2's implicit order (an expert's post-forward comes before its block's), so spell
    # it out, assuming modules run in registration order. Forward: a block gathers its experts and the next
    # block; the first one also the head (see `_prefetch_head`). Experts prefetch nothing in forward: under
    # activation checkpointing they run again inside backward, where a forward prefetch would re-gather the
    # already finished next block. Backward: the head first, then a block, its experts in reverse, then the
    # previous block.
    # Every module named here went through fully_shard, which swapped its class for an FSDPModule subclass.
    blocks = [cast(FSDPModule, model.get_submodule(b)) for b in owned]
    experts = [[cast(FSDPModule, model.get_submodule(e)) for e in owned[b]] for b in owned]
    if head is not None and blocks:
        head.set_modules_to_backward_prefetch([blocks[-1]])
    for i, block in enumerate(blocks):
        early_head = [head] if head is not None and i == 0 else []
        block.set_modules_to_forward_prefetch(experts[i] + blocks[i + 1 : i + 2] + early_head)
        chain = [block, *reversed(experts[i]), *([blocks[i - 1]] if i > 0 else [])]
        for cur, after in zip(chain, chain[1:], strict=False):
            cur.set_modules_to_backward_prefetch([after])


def apply_fsdp2(
    model: nn.Module, state: ParallelState, policy: FSDPPolicy, expert_plan: ExpertPlan | None = None
) -> nn.Module:
    """Shard ``model`` in place with FSDP2 (and EP for the planned expert parameters); return it.

    Build the model in fp32 (on the meta device for large models, then `materialize_sharded`). Expert
    parameters ``[E, ...]`` are first sliced to this EP rank's ``[E/ep, ...]`` with `apply_expert_plan`
    (skipped if that was already done with the same ``ep``/rank). Afterwards every parameter is a DTensor:
    dense ones on ``state.fsdp_mesh``, expert ones on ``state.ep_fsdp_mesh`` (still tagged for
    `expert_shard_of`).

    Gradient scaling: dense gradients are averaged over the whole world (the loss on each rank must be its
    local token sum times ``world / global_tokens``). Expert units divide by the world size too, not by their
    own mesh size: an expert shard's gradient already sums the tokens of every rank of its EP group (they
    reached it through the all-to-all), and the ep_fsdp reduce-scatter (and ep_replicate all-reduce) sums over
    the ranks holding the same experts, so the reduced sum spans all ``world`` ranks exactly once, like a
    dense gradient.

    Args:
        model: fp32 module (any device, or meta) whose blocks match ``policy.block_patterns``.
        state: the parallel state; ``state.device`` is the compute device.
        policy: dtypes, block patterns, resharding, checkpointing and offload.
        expert_plan: the fused expert parameters, required exactly when ``state.ep_enabled``.

    Returns:
        ``model``, now an ``FSDPModule``.

    Raises:
        ValueError: mixed precision with non-fp32 parameters; a block pattern matching nothing or nested
            blocks; an expert plan without EP or EP without a plan; an expert module outside every block or
            owning non-expert parameters; an expert parameter no dim of which divides by ``ep_fsdp``.
    """
    if isinstance(model, FSDPModule):
        raise ValueError("apply_fsdp2: the model already has FSDP applied")
    _check_master_dtype(model, policy)
    expert_fqns = _prepare_experts(model, state, expert_plan)
    blocks = match_blocks(model, policy.block_patterns, expert_fqns)
    owned = _experts_by_block(blocks, expert_fqns)
    mp_policy, offload_policy = policy.mp_policy(), policy.offload_policy()

    for fqn in expert_fqns:
        module = model.get_submodule(fqn)
        reduce = policy.reduce_dtype or policy.param_dtype or next(module.parameters()).dtype
        if state.dims.ep_fsdp == 1 and reduce not in (torch.float32, torch.bfloat16):
            # torch then splits the divide factor into a pre- and a post-divide, and with a one-rank group also
            # divides once more on its copy path: the expert gradients would come out divided by world_size twice.
            raise ValueError(
                f"apply_fsdp2: expert module {fqn} is reduced in {reduce} over a one-rank ep_fsdp group (ep = "
                f"dp_shard * sp = {state.dims.ep}); FSDP2 divides such gradients twice unless the reduce dtype is "
                "float32 or bfloat16: set FSDPPolicy.reduce_dtype to one of them"
            )
        sharded = _fully_shard_keep_metadata(
            module,
            mesh=state.ep_fsdp_mesh,
            reshard_after_forward=policy.reshard_after_forward,
            shard_placement_fn=functools.partial(_expert_placement, shard_size=state.dims.ep_fsdp),
            mp_policy=mp_policy,
            offload_policy=offload_policy,
        )
        sharded.set_gradient_divide_factor(float(state.dims.world_size))  # why: see the docstring
        if state.device.type == "cpu" and state.dims.ep_fsdp > 1:
            # gloo has no PREMUL_SUM, which a custom factor otherwise uses: reduce with SUM, then divide. Not
            # with one shard: FSDP then skips the reduce-scatter but divides twice (before and after).
            sharded.set_force_sum_reduction_for_comms(True)

    tally = _KeptAttention() if policy.activation_checkpointing and policy.ac_keep_attention else None
    if tally is not None:
        tally.watch(model)
    for fqn in blocks:
        block = model.get_submodule(fqn)
        if policy.activation_checkpointing:
            _checkpoint_forward(block, policy.ac_keep_attention, tally)
        fully_shard(
            block,
            mesh=state.fsdp_mesh,
            reshard_after_forward=policy.reshard_after_forward,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
        )

    head_module = _check_head(model, policy.head, blocks, expert_fqns)
    head: FSDPModule | None = None
    if head_module is not None:
        # Last in forward, first in backward: resharding after forward would only gather it again at once.
        head = fully_shard(
            head_module,
            mesh=state.fsdp_mesh,
            reshard_after_forward=False,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
        )
    # The root's parameters (embeddings, final norm, a tied head) are the first needed when backward starts, and
    # fused linear-cross-entropy kernels save the head weight for backward: resharding it would free that
    # storage.
    fully_shard(
        model,
        mesh=state.fsdp_mesh,
        reshard_after_forward=False,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
    )
    if expert_fqns:
        _set_prefetch(model, owned, head)
    elif head is not None and blocks:
        _prefetch_head(cast(FSDPModule, model.get_submodule(blocks[0])), head)
    return model


def set_grad_sync(model: nn.Module, is_last_microstep: bool, *, defer_reduce_scatter: bool = False) -> None:
    """Configure gradient communication for one micro-step of gradient accumulation.

    Call before each micro-step's backward. The HSDP all-reduce across replicas runs only on the last
    micro-step (reduce-scattered shards accumulate until then). With ``defer_reduce_scatter`` the
    reduce-scatter is also skipped until the last micro-step: less communication, but unsharded gradients
    (in ``reduce_dtype``) stay in memory.

    Args:
        model: the root returned by `apply_fsdp2` (applies to every unit inside it).
        is_last_microstep: True for the micro-step after which the optimizer steps.
        defer_reduce_scatter: also skip the reduce-scatter on non-last micro-steps.
    """
    if not isinstance(model, FSDPModule):
        raise TypeError(f"set_grad_sync expects the FSDP root from apply_fsdp2, got {type(model).__name__}")
    if not isinstance(is_last_microstep, bool):
        raise TypeError(f"set_grad_sync: is_last_microstep must be a bool, got {is_last_microstep!r}")
    model.set_requires_gradient_sync(is_last_microstep or not defer_reduce_scatter)
    model.set_requires_all_reduce(is_last_microstep)
