"""AdamW with one parameter group per (device mesh, weight decay, lr multiplier), and the learning-rate schedules.

FSDP2 makes every parameter a DTensor on its mesh: dense parameters on the FSDP mesh, EP experts on the
``ep_fsdp`` mesh. Fused/foreach AdamW kernels batch tensors of a group together, and DTensor refuses to mix
meshes in one multi-tensor op, so each mesh gets its own groups. Norm weights, biases and other 1-D tensors are
not decayed. Frozen parameters (``requires_grad=False``) are left out.

Learning-rate multipliers (``optim.lr_multipliers``, e.g. ``{"model.visual": 0.1}``) are keyed by
`veomni.core.fqn` globs of module or parameter names; a parameter takes the multiplier of the deepest name on its
path that a pattern matches (its own name first, then its module, its parent module, ...). The schedule scales
every group alike, so a group's lr is always ``multiplier x`` the scheduled lr.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from veomni.core.clip import clip_coefficient, clip_grad_norm, scale_gradients_
from veomni.core.fqn import fqn_matches
from veomni.core.master_weights import master_weights_of
from veomni.core.parallel_state import ParallelState
from veomni.train.numerics import DynamicLossScale

SCHEDULES = ("cosine", "linear", "constant")


def _mesh_key(param: torch.Tensor) -> tuple:
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        return (mesh.device_type, tuple(mesh.mesh.flatten().tolist()), mesh.mesh_dim_names or ())
    return (param.device.type, (), ())


def lr_multiplier(name: str, multipliers: Mapping[str, float]) -> float:
    """The multiplier of parameter ``name``: the pattern matching the deepest name on its path, else 1.0.

    Raises:
        ValueError: two patterns with different multipliers match the same name.
    """
    parts = name.split(".")
    for depth in range(len(parts), 0, -1):
        prefix = ".".join(parts[:depth])
        hits = {pattern: m for pattern, m in multipliers.items() if fqn_matches(pattern, prefix)}
        if len(set(hits.values())) > 1:
            raise ValueError(
                f"optim.lr_multipliers: {sorted(hits)} all match {prefix!r} with different values"
            )
        if hits:
            return next(iter(hits.values()))
    return 1.0


def unmatched_multipliers(
    model: nn.Module, lr_multipliers: Mapping[str, float]
) -> tuple[list[str], list[str]]:
    """The ``optim.lr_multipliers`` patterns that reach no trainable parameter of ``model``: ``(unmatched, moot)``,
    those matching no parameter or module at all (an error) and those matching only frozen ones (a multiplier on a
    module ``model.freeze`` froze whole: no effect)."""
    trained: set[str] = set()
    frozen: set[str] = set()
    for name, param in model.named_parameters():
        parts = name.split(".")
        hits = {
            p for p in lr_multipliers for d in range(1, len(parts) + 1) if fqn_matches(p, ".".join(parts[:d]))
        }
        (trained if param.requires_grad else frozen).update(hits)
    idle = set(lr_multipliers) - trained
    return sorted(idle - frozen), sorted(idle & frozen)


def param_groups(
    model: nn.Module, weight_decay: float, lr: float | None = None, lr_multipliers: Mapping[str, float] = {}
) -> list[dict]:
    """Trainable parameters grouped by (mesh, decayed or not, lr multiplier), in a deterministic order.

    Args:
        lr: the peak lr; with it each group gets ``lr * multiplier`` (without it, groups carry no lr).
        lr_multipliers: see the module docstring; a pattern matching no parameter is an error, one matching only
            frozen parameters has no effect (`unmatched_multipliers`).
    Returns:
        ``[{"params": [...], "weight_decay": wd, "names": [...], "lr_multiplier": m (, "lr")}, ...]``;
        ``names`` is kept for logging.
    """
    if master_weights_of(model) is not None:
        # Its parameters are compute-dtype copies whose gradients the masters take: stepping them trains nothing.
        raise ValueError(
            f"{type(model).__name__} trains over fp32 master weights (veomni.core.master_weights): build the "
            "optimizer on master_weights_of(model).module"
        )
    groups: dict[tuple, dict] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        # Matrices decay; norms and biases do not, fused per-expert biases ([E, out], gpt-oss) included.
        decay = param.dim() >= 2 and not name.endswith("bias")
        scale = lr_multiplier(name, lr_multipliers) if lr_multipliers else 1.0
        key = (_mesh_key(param), decay, scale)
        group = groups.setdefault(
            key,
            {
                "params": [],
                "names": [],
                "weight_decay": weight_decay if decay else 0.0,
                "lr_multiplier": scale,
            },
        )
        if lr is not None:
            group["lr"] = lr * scale
        group["params"].append(param)
        group["names"].append(name)
    if not groups:
        raise ValueError(f"{type(model).__name__} has no trainable parameters (all frozen?)")
    if unmatched := unmatched_multipliers(model, lr_multipliers)[0]:
        raise ValueError(
            f"optim.lr_multipliers: {unmatched} match no parameter or module of {type(model).__name__}"
        )
    return list(groups.values())


def build_adamw(
    model: nn.Module,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    lr_multipliers: Mapping[str, float] = {},
) -> torch.optim.AdamW:
    """AdamW over `param_groups`; the fused implementation wherever torch has it (CUDA and CPU)."""
    groups = param_groups(model, weight_decay, lr, lr_multipliers)
    device_types = {p.device.type for g in groups for p in g["params"]}
    fused = device_types <= {"cuda", "cpu"}
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused)


@attrs.frozen(kw_only=True)
class Schedule:
    """Linear warmup from 0 to the peak lr, then ``kind`` decay to ``min_lr_ratio * peak`` at ``total_steps``.

    Attributes:
        kind: ``cosine``, ``linear`` or ``constant`` (no decay after warmup).
        warmup_steps: steps of linear warmup (step ``s < warmup`` uses ``(s + 1) / warmup``).
        total_steps: the step count the decay ends at.
        min_lr_ratio: the floor as a fraction of the peak lr.
    """

    kind: str = attrs.field(validator=attrs.validators.in_(SCHEDULES))
    warmup_steps: int = attrs.field(validator=attrs.validators.ge(0))
    total_steps: int = attrs.field(validator=attrs.validators.ge(1))
    min_lr_ratio: float = attrs.field(
        default=0.0, validator=[attrs.validators.ge(0.0), attrs.validators.le(1.0)]
    )

    def __attrs_post_init__(self) -> None:
        if self.warmup_steps > self.total_steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} exceeds total_steps={self.total_steps}")

    def factor(self, step: int) -> float:
        """Multiplier of the peak lr for 0-based ``step``."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        decay = 1.0 - progress if self.kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * decay


def build_scheduler(optimizer: torch.optim.Optimizer, schedule: Schedule) -> LambdaLR:
    """A ``LambdaLR`` applying ``schedule`` (its state_dict is the step counter, so DCP/torch.save resume it)."""

    # A plain function: LambdaLR's state_dict skips functions, so only the step counter is saved (the schedule
    # itself comes from the recipe on resume).
    def factor(step: int) -> float:
        return schedule.factor(step)

    return LambdaLR(optimizer, factor)


def load_scheduler_state(scheduler: LambdaLR, state: Mapping[str, Any]) -> None:
    """Restore a `build_scheduler` scheduler from its saved ``state_dict``, after the optimizer has been restored.

    The saved state holds per-group lists (``base_lrs``, the last lrs) in the saving run's group order, and a run
    may resume with other groups: an EP checkpoint resumed without EP has its expert groups merged into the dense
    ones. Those lists are rebuilt from this optimizer's groups, whose ``initial_lr`` was restored with their
    parameters (by name); the step counter comes from ``state``. The groups' current ``lr`` is then this scheduler's
    schedule at that step: the schedule's shape follows the resuming recipe (a run extended to more steps, another
    warmup), while the restored ``lr`` is what the saving run's schedule had set.
    """
    scheduler.load_state_dict(dict(state))  # a copy: load_state_dict pops and puts back a key of its argument
    groups = scheduler.optimizer.param_groups
    scheduler.base_lrs = [group["initial_lr"] for group in groups]
    # LambdaLR's own expression, so an unchanged schedule gives the restored value bit for bit.
    for group, base_lr, factor in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        group["lr"] = base_lr * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in groups]


def take_recipe_hyperparameters(
    scheduler: LambdaLR, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float
) -> None:
    """After `load_scheduler_state`: put the recipe's peak ``lr`` (times each group's ``lr_multiplier``), betas,
    eps and weight decay (on the decayed groups) on the restored optimizer, and re-derive the groups' current lr
    from the schedule at the restored step (``optim.on_resume: recipe``). AdamW's moments are kept."""
    groups = scheduler.optimizer.param_groups
    for group in groups:
        group["initial_lr"] = lr * group["lr_multiplier"]
        group["betas"], group["eps"] = tuple(betas), eps
        if group["weight_decay"] != 0.0:  # the no-decay groups (norms, biases) stay at 0
            group["weight_decay"] = weight_decay
    scheduler.base_lrs = [group["initial_lr"] for group in groups]
    for group, base_lr, factor in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        group["lr"] = base_lr * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in groups]


def clip_and_step(
    optimizer: torch.optim.Optimizer, trained: nn.Module, max_norm: float | None, state: ParallelState,
    loss_scale: DynamicLossScale | None = None,
) -> tuple[torch.Tensor, bool]:  # fmt: skip
    """Clip ``trained``'s gradients to ``max_norm`` (None: no clipping) and step ``optimizer``.

    With torch's fused AdamW on CUDA (one rank: plain tensors) the clipping coefficient goes into the optimizer's
    ``grad_scale`` (the kernel divides each gradient by it as it reads it) instead of a separate pass that
    rewrites every gradient: one read and write of all gradients less per step (2.9 ms of a 108 ms Qwen3-1.7B
    step on an H100).

    With ``loss_scale`` (fp16, `veomni.train.numerics`) the gradients are those of ``loss x S``: they are divided
    by ``S`` in the same multiply as the clipping, and a non-finite norm (an overflow) skips the step and halves
    ``S`` -- the one host read of this path.

    Returns:
        The global gradient norm before clipping (0-d fp32 on the device; of the unscaled gradients), and whether
        the optimizer stepped (always True without ``loss_scale``).
    """
    fold = _fused_on_cuda(optimizer)
    limit = math.inf if max_norm is None else max_norm
    if loss_scale is None:
        norm = clip_grad_norm(trained, limit, state, scale_gradients=not fold)
        if fold:
            optimizer.grad_scale = 1.0 / clip_coefficient(norm, limit)  # type: ignore[attr-defined]
        optimizer.step()
        return norm, True
    scaled_norm = clip_grad_norm(trained, limit, state, scale_gradients=False)
    finite = bool(torch.isfinite(scaled_norm).item())
    scale = loss_scale.value
    loss_scale.update(finite)
    if not finite:
        return scaled_norm, False
    norm = scaled_norm / scale
    coefficient = clip_coefficient(norm, limit) / scale
    if fold:
        optimizer.grad_scale = 1.0 / coefficient  # type: ignore[attr-defined]
    else:
        scale_gradients_(trained, coefficient)
    optimizer.step()
    return norm, True


def _fused_on_cuda(optimizer: torch.optim.Optimizer) -> bool:
    # grad_scale is read by torch's fused Adam/AdamW only (its foreach and single-tensor paths refuse it), and a
    # plain grad_scale tensor cannot join DTensor (FSDP2) parameters in one call: the one-rank paths only.
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) or not optimizer.defaults.get("fused"):
        return False
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return all(p.device.type == "cuda" and not isinstance(p, DTensor) for p in params)
