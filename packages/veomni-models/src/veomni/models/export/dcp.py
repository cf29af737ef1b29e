"""The offline export's reading side (`veomni.models.export.export_dcp_to_hf`): finding a DCP directory, choosing
the model class its keys belong to, and checking them against that model.

The task (which class of the config's model type) is given, or inferred: the class the config's ``architectures``
names (a training checkpoint's ``hf_files/config.json`` records the trained class), else the tasks a training run
builds; a candidate is taken only when its state-dict keys and shapes are exactly the checkpoint's.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig

from veomni.models.loading.loader import DEFAULT_IGNORED_UNEXPECTED, CheckpointMismatchError
from veomni.models.loading.targets import Target, model_targets, tie_groups, unwrapped_class

logger = logging.getLogger(__name__)


def dcp_accounting(
    model: nn.Module, targets: dict[str, Target], stored: dict[str, object], prefix: str, where: str
) -> dict[str, str]:
    """``{model key: checkpoint key}`` for each tie group of ``model`` (its leader), from the DCP keys under
    ``prefix``; raises `CheckpointMismatchError` for missing, unexpected or misshapen keys (``where`` names the
    checkpoint)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ours = {k[len(prefix) :]: k for k in stored if k.startswith(prefix)}
    ignore = [re.compile(p) for p in DEFAULT_IGNORED_UNEXPECTED]
    chosen, missing, mismatched = {}, [], []
    for keys in tie_groups(model, targets):
        present = [k for k in keys if k in ours]
        if not present:
            missing.append(keys[0])
            continue
        meta = stored[ours[present[0]]]
        want = targets[keys[0]].full_shape
        got = tuple(meta.size) if isinstance(meta, TensorStorageMetadata) else ("not a tensor",)
        if got != want:
            mismatched.append((ours[present[0]], want, got))
        chosen[keys[0]] = ours[present[0]]
    unexpected = sorted(ours[k] for k in ours if k not in targets and not any(p.search(k) for p in ignore))
    if missing or unexpected or mismatched:
        lines = [
            f"the DCP checkpoint in {where} (keys under prefix {prefix!r}) does not match {unwrapped_class(model).__name__}:"
        ]
        if missing:
            lines.append(f"  missing keys ({len(missing)}): {missing}")
        if unexpected:
            lines.append(f"  unexpected keys ({len(unexpected)}): {unexpected}")
        for key, want, got in mismatched:
            hint = ""
            if len(want) == len(got) and want[1:] == got[1:] and got[0] and want[0] % got[0] == 0:
                hint = " (an EP rank's local experts: save the global [E, ...] tensors)"
            lines.append(
                f"  {key}: the model expects shape {list(want)}, the checkpoint has {list(got)}{hint}"
            )
        if not ours:
            sample = sorted(stored)[:5]
            lines.append(f"  no key starts with {prefix!r}; the checkpoint's keys look like {sample}")
        raise CheckpointMismatchError("\n".join(lines), missing, unexpected, mismatched)
    return chosen


def dcp_directory(dcp_dir: str | os.PathLike) -> Path:
    """``dcp_dir`` when it holds a DCP ``.metadata`` file; else `FileNotFoundError`, naming a ``*/`` child with one."""
    # A training run keeps its DCP files in step_N/dcp/ beside the trainer state: name that directory when the
    # step directory itself is given, instead of torch's bare "No such file ... .metadata".
    path = Path(dcp_dir)
    if (path / ".metadata").is_file():
        return path
    nested = sorted(p.parent for p in path.glob("*/.metadata")) if path.is_dir() else []
    hint = f"; {nested[0]} holds one: pass that directory" if len(nested) == 1 else ""
    raise FileNotFoundError(
        f"{path} is not a torch.distributed.checkpoint directory (it has no .metadata file){hint}"
    )


# The tasks a training run builds (text, vlm, omni), tried in this order after the one the config's architectures name.
_TRAINED_TASKS = ("causal_lm", "image_text_to_text", "any_to_any")


def _candidate_tasks(config: PretrainedConfig, registry: object) -> list[str]:
    """The tasks an offline export tries for ``config``, in order: the one its ``architectures`` names (a training
    checkpoint's ``hf_files/config.json`` records the trained class), then the trained tasks it supports."""
    supported = registry.supported_tasks(config)  # type: ignore[attr-defined]
    named = registry.architecture_task(config)  # type: ignore[attr-defined]
    candidates = [named] if named is not None else []
    candidates += [t for t in _TRAINED_TASKS if t in supported and t not in candidates]
    if not candidates:
        raise ValueError(
            f"export: cannot infer the task of {type(config).__name__} (architectures "
            f"{getattr(config, 'architectures', None)}); pass task= (--task), one of {supported}"
        )
    return candidates


def dcp_model(
    config: PretrainedConfig,
    registry: object,
    stored: dict[str, object],
    prefix: str,
    where: str,
    task: str | None,
) -> tuple[nn.Module, PretrainedConfig, dict[str, str]]:
    """The model (on meta) whose keys the DCP checkpoint ``stored`` holds under ``prefix``.

    Args:
        config: the model's config (a composite's text config is used for a text-only class).
        registry: a `veomni.models.registry.ModelRegistry`.
        stored: the checkpoint's ``state_dict_metadata``.
        prefix: the prefix of the model's keys in it.
        where: the checkpoint, for messages.
        task: the task, or None to infer it (`_candidate_tasks`).
    Returns:
        ``(model, the config it was built from, {model key: checkpoint key})``.
    Raises:
        CheckpointMismatchError: the keys match no candidate (the first candidate's mismatch is reported).
    """
    from transformers.initialization import no_init_weights

    from veomni.models.registry import config_for_class

    candidates = [task] if task is not None else _candidate_tasks(config, registry)
    failures: list[CheckpointMismatchError] = []
    for candidate in candidates:
        resolved = registry.model_class(config, candidate)  # type: ignore[attr-defined]
        model_config = config_for_class(config, resolved.cls)
        with torch.device("meta"), no_init_weights():
            model = resolved.cls._from_config(model_config)
        model.tie_weights()
        try:
            chosen = dcp_accounting(model, model_targets(model), stored, prefix, where)
        except CheckpointMismatchError as err:
            if task is not None:
                raise
            failures.append(err)
            continue
        if task is None:
            logger.info("export: task %r inferred (%s)", candidate, resolved.cls.__name__)
        return model, model_config, chosen
    # The first candidate is the one the config names: its mismatch is the one to read.
    first = failures[0]
    raise CheckpointMismatchError(
        f"{first}\n  (task inferred: none of {candidates} matches the checkpoint's keys; pass task= / --task)",
        first.missing, first.unexpected, first.mismatched,
    )  # fmt: skip


def dcp_fetcher(
    dcp_dir: str | os.PathLike, stored: Mapping[str, object], chosen: Mapping[str, str],
    dtypes: Mapping[str, torch.dtype],
) -> Callable[[str], torch.Tensor]:  # fmt: skip
    """``fetch(model key)``: that tensor read whole from ``dcp_dir`` in one process (its checkpoint key
    ``chosen[key]``, stored shape and dtype from ``stored``), cast to ``dtypes[key]``; what the export's writer
    asks for one tensor at a time."""

    def fetch(key: str) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp

        meta = stored[chosen[key]]
        tensor = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)  # type: ignore[attr-defined]
        with warnings.catch_warnings():  # DCP warns that it loads in one process, which is the intent here
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load({chosen[key]: tensor}, checkpoint_id=str(dcp_dir), no_dist=True)
        return tensor.to(dtypes[key])

    return fetch
