"""Training tasks: what the loop asks of a model, so that the loop itself never branches on model type or family.

A task prepares its run (tokenizer, config, data), turns a packed batch into the model's keyword arguments, the
model's outputs into the loss the loop back-propagates, a step into its FLOPs, and a finished model into an export.
Built in: ``text`` (causal language modelling on packed documents), ``vlm`` and ``omni`` (`veomni.train.tasks.vision`),
``dit`` (`veomni.train.tasks.dit`), ``dpo`` (preference pairs, `veomni.train.tasks.preference`), ``reward`` (a
Bradley-Terry reward model on the same pairs, `veomni.train.tasks.reward`). Family-specific rules (a VLM's position rule and video layout, say) come from the
model's family declaration (`veomni.models.families`), never from a family name here.

Tasks are registered by name: `register_task` (a decorator) adds a class, an installed package may declare one in
the ``veomni.tasks`` entry-point group, and a recipe's ``model.task`` names a registered task or a class by import
path (``my_pkg.tasks:RewardTask``), so a user's own task runs from the CLI without editing this package (worked
example: ``examples/custom_task/bits_task.py``; docs/guides/add-a-data-format-or-task.md).

Everything read from the model config goes through ``config.get_text_config()``: a composite model (a VLM, an
omni thinker) keeps its language model's settings -- layers, heads, MoE router coefficient -- in a sub-config,
and reading them from the root would silently drop them (the aux loss coefficient of a VLM-MoE, say).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import attrs
import torch
from torch import nn

from veomni.core.parallel_state import ParallelState
from veomni.train.data import Step

if TYPE_CHECKING:
    from veomni.train.recipe import Recipe


@attrs.frozen(kw_only=True)
class TaskSetup:
    """What a task brings to `veomni.train.loop.build_run` before the model is built, everything checkable checked.

    Attributes:
        tokenizer: saved with exports (text, vlm) or the condition model's (dit).
        config: the model config (transformers ``PretrainedConfig`` or a diffusers `DiffusersConfig`).
        probe: a meta instance of the model class (block patterns, FLOPs, freeze checks).
        ops: the validated `OpsConfig`, or None where no kernels are bound (diffusers models).
        task: the run's `Task`.
        train_data, eval_data: the data iterators (eval None when there is none).
    """

    tokenizer: Any
    config: Any
    probe: nn.Module
    ops: Any
    task: Task
    train_data: Any
    eval_data: Any


class Task(Protocol):
    """The seams of one training task (see the module docstring).

    Attributes:
        name: the recipe's ``model.task`` value.
        data_kinds: the ``data.kind`` values it trains on.
        model_task: the registry task whose class is built (``causal_lm``, ``image_text_to_text``, ...).
        aux_loss_coef: weight of the model's auxiliary (MoE load-balancing) loss; 0 when it has none.
    """

    name: str
    model_task: str
    aux_loss_coef: float
    data_kinds: tuple[str, ...]

    @classmethod
    def prepare(cls, recipe: Recipe, state: ParallelState, device: torch.device) -> TaskSetup:
        """Everything the run needs before the model is built (tokenizer, config, meta probe, kernels, data, the
        task itself), every checkable input checked."""
        ...

    def model_kwargs(
        self, batch: Mapping[str, Any], device: torch.device, num_items: torch.Tensor
    ) -> dict[str, Any]:
        """The keyword arguments of ``model(**kwargs)`` for one micro-batch; ``num_items`` (0-d int64) is the
        loss normaliser: the model returns its token-loss sum over it."""
        ...

    def forward(
        self, model: nn.Module, batch: Mapping[str, Any], device: torch.device, num_items: torch.Tensor
    ) -> Any:
        """Run ``model`` on one micro-batch (usually ``model(**self.model_kwargs(...))``); the outputs go to `loss`."""
        ...

    def trained_tokens(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """Trained positions of one micro-batch on this rank, a 0-d int64 tensor (evaluation's denominator)."""
        ...

    def loss(self, outputs: Any, aux_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(reported, objective)`` from the model's outputs: the 0-d loss that is logged, and the 0-d term that
        is back-propagated (the reported loss plus ``aux_loss_coef * aux_scale`` times the auxiliary loss)."""
        ...

    def export(self, model: nn.Module, out: Path, tokenizer: Any, parallel_state: ParallelState) -> None:
        """Write the trained model to ``out`` in its upstream format (every rank calls it)."""
        ...

    def checkpoint_files(self, model: nn.Module, out: Path, tokenizer: Any) -> None:
        """Write into ``out`` what `export` writes beside the weights (config, generation config, tokenizer,
        processor files), for a checkpoint's ``hf_files/`` (`veomni.models.export.files`); called on one rank,
        so no collectives. Nothing where the offline export does not read them."""
        ...

    def step_flops(self, step: Step) -> float:
        """Useful training FLOPs of a whole step over all ranks (the MFU numerator, `veomni.train.metrics`)."""
        ...



BUILTIN_TASKS: Mapping[str, str] = {
    "text": "veomni.train.tasks.text:TextTask",
    "vlm": "veomni.train.tasks.vision:VlmTask",
    "omni": "veomni.train.tasks.vision:OmniTask",
    "dit": "veomni.train.tasks.dit:DitTask",
    "dpo": "veomni.train.tasks.preference:DpoTask",
    "reward": "veomni.train.tasks.reward:RewardTask",
}
"""veomni's tasks by name, imported on first use (a text run imports no vision or DiT module)."""

ENTRY_POINT_GROUP = "veomni.tasks"
"""The entry-point group where an installed package declares its tasks by name (``name = "pkg.mod:Class"``)."""

_REGISTERED: dict[str, type] = {}
"""Tasks registered at import by `register_task` (users' own)."""

_REQUIRED = ("name", "model_task", "data_kinds", "prepare", "forward", "loss", "step_flops", "export")

T = TypeVar("T", bound=type)


def register_task(name: str) -> Callable[[T], T]:
    """Class decorator: make the task class available as ``model.task: <name>``; the class's ``name`` must be
    ``name``. Registering a taken name (a built-in one included) is an error."""

    def register(cls: T) -> T:
        if name in BUILTIN_TASKS or name in _REGISTERED:
            taken = BUILTIN_TASKS.get(name) or f"{_REGISTERED[name].__module__}:{_REGISTERED[name].__qualname__}"
            raise ValueError(f"task name {name!r} is already registered ({taken})")
        _check_task_class(cls, name)
        if cls.name != name:
            raise ValueError(f"register_task({name!r}) on {cls.__qualname__}, whose name is {cls.name!r}")
        _REGISTERED[name] = cls
        return cls

    return register


def task_names() -> list[str]:
    """Every registered task name (built in and `register_task`'s), sorted."""
    return sorted({*BUILTIN_TASKS, *_REGISTERED})


def task_class(name: str) -> type:
    """The task class ``model.task`` names: a registered name, or ``"package.module:Class"`` (imported now).

    Errors name the registered tasks, or what the import path holds instead of a task class."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    target = BUILTIN_TASKS.get(name) or _entry_point(name) or name
    if ":" not in target:
        raise ValueError(
            f"model.task: expected one of {task_names()} or a task class as 'package.module:Class', found {name!r}"
        )
    module_name, _, attribute = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"model.task={name!r}: cannot import {module_name!r}: {err}") from err
    cls = getattr(module, attribute, None)
    if not isinstance(cls, type):
        raise ValueError(f"model.task={name!r}: {module_name} has no class {attribute!r}")
    _check_task_class(cls, name)
    return cls


def _entry_point(name: str) -> str | None:
    """The ``module:Class`` an installed package declares for ``name`` in the ``veomni.tasks`` entry-point group."""
    from importlib.metadata import entry_points

    found = [point.value for point in entry_points(group=ENTRY_POINT_GROUP) if point.name == name]
    if len(found) > 1:
        raise ValueError(f"model.task={name!r}: several installed packages declare it ({found})")
    return found[0] if found else None


def _check_task_class(cls: type, where: str) -> None:
    missing = [attribute for attribute in _REQUIRED if not hasattr(cls, attribute)]
    if missing:
        raise ValueError(
            f"model.task={where!r}: {cls.__module__}:{cls.__qualname__} is not a task: it lacks {missing} "
            "(the protocol is veomni.train.tasks.Task)"
        )


def build_task(name: str, probe: nn.Module) -> Task:
    """The task ``name`` (a registered name or an import path) for the model ``probe`` (a meta instance)."""
    return task_class(name).for_model(probe)  # type: ignore[no-any-return]
