"""Streaming a safetensors checkpoint into a (FSDP / EP sharded) model, in place, with strict accounting.

Two modes:

* ``"sharded"`` (default): every rank reads the headers, runs the converters lazily, checks the accounting,
  then reads only its own region of each tensor (``safe_open(...).get_slice``) and copies it into its local
  shard. No communication at all; every rank reaches the same verdict from the same headers.
* ``"rank0_broadcast"``: for slow shared filesystems. Only rank 0 of ``group`` touches the files; it sends
  the verdict, then each full tensor in turn (one at a time) and every rank keeps its region.

Accounting: every parameter and persistent buffer must come from the checkpoint (a tied group needs one of
its keys, as transformers' symmetric tying allows; if several are present they must be equal), and every
checkpoint key must land in the model, except keys matching the ignore patterns (``rotary_emb.inv_freq``,
the model class's ``_keys_to_ignore_on_load_unexpected``, and the caller's).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Sequence

import attrs
import torch
import torch.distributed as dist
from torch import nn

from veomni.models.convert.converters import (
    CheckpointConverter,
    IncompleteCheckpointError,
    KeyTransform,
    UnsupportedRecipeError,
    apply_converters,
)
from veomni.models.convert.recipes import model_converters
from veomni.models.loading.diagnosis import dense_moe_diagnosis, submodel_diagnosis
from veomni.models.loading.lazy import LazyTensor, TensorLike, as_lazy, shape_of
from veomni.models.loading.quantized import check_not_quantized
from veomni.models.loading.safetensors_io import CheckpointFileError, CheckpointFiles
from veomni.models.loading.targets import Target, model_targets, tie_groups, unwrapped_class

logger = logging.getLogger(__name__)

DEFAULT_IGNORED_UNEXPECTED: tuple[str, ...] = (r"(^|\.)rotary_emb\.inv_freq$",)
"""Checkpoint keys that are known to be harmless: old checkpoints saved the (recomputed) rotary buffer."""

MODES = ("sharded", "rank0_broadcast")


class CheckpointMismatchError(ValueError):
    """The checkpoint does not match the model: missing keys, unexpected keys, wrong shapes, unequal ties."""

    def __init__(
        self,
        message: str,
        missing: Sequence[str] = (),
        unexpected: Sequence[str] = (),
        mismatched: Sequence[tuple[str, tuple, tuple]] = (),
    ) -> None:
        super().__init__(message)
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mismatched = list(mismatched)

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.missing, self.unexpected, self.mismatched))


class WrongModelError(ValueError):
    """The checkpoint's ``config.json`` names another model type than the model being loaded."""


@attrs.frozen
class LoadReport:
    """What `load_weights` did on this rank.

    Attributes:
        mode: ``"sharded"`` or ``"rank0_broadcast"``.
        loaded: model keys written (tied keys included).
        ignored: checkpoint keys skipped because they matched an ignore pattern.
        sources: ``{model key: checkpoint key or converter}`` for every written group leader.
        bytes_read: tensor bytes this rank read from disk.
    """

    mode: str
    loaded: tuple[str, ...]
    ignored: tuple[str, ...]
    sources: dict[str, str]
    bytes_read: int


@attrs.frozen
class _Plan:
    groups: list[tuple[list[str], list[str]]]  # (model keys sharing a tensor, the ones the checkpoint has)
    tensors: dict[str, TensorLike]
    origin: dict[str, str]
    ignored: list[str]


def converters_for(
    model: nn.Module, targets: dict[str, Target] | None = None, *, for_export: bool = False
) -> list[CheckpointConverter | KeyTransform]:
    """Fresh converters and key renames for ``model``, from transformers' recipes for it and its sub-models
    (see `veomni.models.convert.recipes.model_converters`; ``for_export`` picks what export reverts)."""
    if getattr(model, "config", None) is None:
        return []
    targets = model_targets(model) if targets is None else targets
    return model_converters(model, {k: t.full_shape for k, t in targets.items()}, for_export=for_export)


def _check_model_type(model: nn.Module, files: CheckpointFiles) -> None:
    ckpt = files.config()
    ours = getattr(getattr(model, "config", None), "model_type", None)
    if ckpt is None or ours is None or "model_type" not in ckpt:
        return
    # A sub-model of a composite checkpoint (the text model of a VLM) is loaded from it, as transformers does;
    # its recipe maps the keys (e.g. qwen3_5_text's PrefixChange) and the other towers' keys stay unexpected.
    parts = [v.get("model_type") for v in ckpt.values() if isinstance(v, dict)]
    if ckpt["model_type"] != ours and ours not in parts:
        raise WrongModelError(
            f"the checkpoint in {files.directory} is a {ckpt['model_type']!r} model "
            f"(architectures {ckpt.get('architectures')}), but the model being loaded is {ours!r} "
            f"({unwrapped_class(model).__name__}); pass the weights of a {ours!r} model"
        )


def _ignore_patterns(model: nn.Module, extra: Sequence[str]) -> list[re.Pattern[str]]:
    if isinstance(extra, str):
        raise TypeError(f"ignore_unexpected must be a sequence of regexes, got the string {extra!r}")
    patterns = list(DEFAULT_IGNORED_UNEXPECTED) + list(
        getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []
    )
    return [re.compile(p) for p in patterns + list(extra)]


def _make_plan(
    model: nn.Module,
    files: CheckpointFiles,
    targets: dict[str, Target],
    converters: Sequence[CheckpointConverter | KeyTransform] | None,
    ignore: list[re.Pattern[str]],
    check_config: bool,
) -> _Plan:
    if check_config:
        _check_model_type(model, files)
    # Before any converter or cast sees them: FP8 values read without their block scales would be garbage.
    check_not_quantized(
        files.config() if check_config else None,
        ((k, t.dtype) for k, t in files.tensors.items()),
        where=f"the checkpoint in {files.directory}",
    )
    convs = converters_for(model, targets) if converters is None else list(converters)
    tensors, origin = apply_converters(
        files.tensors.items(),
        convs,
        model_keys=targets,
        base_model_prefix=getattr(model, "base_model_prefix", None) or None,
    )
    groups, missing, mismatched = [], [], []
    for keys in tie_groups(model, targets):
        present = [k for k in keys if k in tensors]
        if not present:
            missing.append(keys[0] if len(keys) == 1 else f"{keys[0]} (tied with {keys[1:]})")
        for k in present:
            if shape_of(tensors[k]) != targets[k].full_shape:
                mismatched.append((k, targets[k].full_shape, shape_of(tensors[k])))
        groups.append((keys, present))
    extra = sorted(k for k in tensors if k not in targets)
    ignored = [k for k in extra if any(p.search(k) for p in ignore)]
    unexpected = [k for k in extra if k not in ignored]
    if missing or unexpected or mismatched:
        lines = [f"the checkpoint in {files.directory} does not match {unwrapped_class(model).__name__}:"]
        lines += submodel_diagnosis(model, targets, tensors, origin, unexpected, convs)
        lines += dense_moe_diagnosis(missing, unexpected)
        if missing:
            lines.append(f"  missing keys ({len(missing)}): {missing}")
        if unexpected:
            named = [k if origin.get(k, k) == k else f"{k} (checkpoint key {origin[k]})" for k in unexpected]
            lines.append(f"  unexpected keys ({len(unexpected)}): {named}")
        for key, want, got in mismatched:
            lines.append(f"  {key}: the model expects shape {list(want)}, the checkpoint has {list(got)}")
        if unexpected:
            lines.append("  (pass ignore_unexpected=[regex, ...] for keys that are known to be harmless)")
        raise CheckpointMismatchError("\n".join(lines), missing, unexpected, mismatched)
    return _Plan(groups, tensors, origin, ignored)


def _tie_mismatch(keys: list[str], present: list[str]) -> CheckpointMismatchError:
    return CheckpointMismatchError(
        f"the model ties {keys} (the config's tie_word_embeddings / tied weights), but the checkpoint holds "
        f"different values for {present}; set tie_word_embeddings=False in the config to load them separately",
        mismatched=[(k, (), ()) for k in present],
    )


def _read(tensor: TensorLike, region: tuple[slice, ...]) -> torch.Tensor:
    return as_lazy(tensor).read(region) if isinstance(tensor, LazyTensor) else tensor[region]


def _load_sharded(targets: dict[str, Target], plan: _Plan) -> None:
    with torch.no_grad():
        for keys, present in plan.groups:
            target = targets[keys[0]]
            data = _read(plan.tensors[present[0]], target.region)
            for other in present[1:]:
                if not torch.equal(data, _read(plan.tensors[other], target.region)):
                    raise _tie_mismatch(keys, present)
            target.local.copy_(data)


def _comm_device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_REMOTE_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        CheckpointMismatchError,
        CheckpointFileError,
        WrongModelError,
        IncompleteCheckpointError,
        UnsupportedRecipeError,
        ValueError,
        FileNotFoundError,
        NotImplementedError,
    )
}


def _load_broadcast(
    model: nn.Module,
    weights: str | os.PathLike,
    targets: dict[str, Target],
    make_plan: Callable[[CheckpointFiles], _Plan],
    group: dist.ProcessGroup | None,
) -> tuple[list[str], dict[str, str], int]:
    src = dist.get_global_rank(group, 0) if group is not None else 0
    is_src = dist.get_rank(group) == 0
    files, plan, error = None, None, None
    verdict: list[object] = [None]
    if is_src:
        try:
            files = CheckpointFiles(weights)
            plan = make_plan(files)
            for keys, present in plan.groups:
                if len(present) > 1:
                    first = as_lazy(plan.tensors[present[0]]).materialize()
                    if any(
                        not torch.equal(first, as_lazy(plan.tensors[k]).materialize()) for k in present[1:]
                    ):
                        raise _tie_mismatch(keys, present)
            leaders = [(present[0], plan.tensors[present[0]].dtype) for _, present in plan.groups]
            verdict[0] = ("ok", leaders, plan.ignored, plan.origin)
        except Exception as err:  # noqa: BLE001 - every rank must learn why before anyone raises
            error = err
            cls = next((c for c in type(err).__mro__ if c.__name__ in _REMOTE_ERRORS), RuntimeError)
            verdict[0] = ("error", cls.__name__, str(err))
    dist.broadcast_object_list(verdict, src=src, group=group)
    status = verdict[0]
    if status[0] == "error":  # type: ignore[index]
        if files is not None:
            files.close()
        if error is not None:
            raise error
        _, name, message = status  # type: ignore[misc]
        raise _REMOTE_ERRORS.get(name, RuntimeError)(f"(reported by rank {src}) {message}")
    _, leaders, ignored, origin = status  # type: ignore[misc]
    device = _comm_device(group)
    groups = tie_groups(model, targets)
    try:
        with torch.no_grad():
            for keys, (ckpt_key, dtype) in zip(groups, leaders, strict=True):
                target = targets[keys[0]]
                if is_src:
                    full = as_lazy(plan.tensors[ckpt_key]).materialize().to(device)  # type: ignore[union-attr]
                else:
                    full = torch.empty(target.full_shape, dtype=dtype, device=device)
                dist.broadcast(full, src=src, group=group)
                target.local.copy_(full[target.region])
                del full
    finally:
        if files is not None:
            files.close()
    return (
        ignored,
        {keys[0]: origin[leader[0]] for keys, leader in zip(groups, leaders, strict=True)},
        (files.bytes_read if files is not None else 0),
    )


def load_weights(
    model: nn.Module,
    weights: str | os.PathLike,
    *,
    mode: str = "sharded",
    converters: Sequence[CheckpointConverter | KeyTransform] | None = None,
    ignore_unexpected: Sequence[str] = (),
    check_config: bool = True,
    group: dist.ProcessGroup | None = None,
    not_in_checkpoint: Sequence[str] = (),
) -> LoadReport:
    """Copy a safetensors checkpoint into ``model``'s parameters and persistent buffers, in place.

    ``model`` may be plain, EP-sliced (`veomni.core.ep.apply_expert_plan`) and/or FSDP2-sharded, and must be
    materialised (not on meta). Each local shard receives its region of the full tensor, cast to its dtype.
    Non-persistent buffers are not touched. Everything is checked (headers only) before anything is written.

    Args:
        model: the module to fill.
        weights: a ``.safetensors`` file, an index ``.json``, or a directory with either.
        mode: ``"sharded"`` (every rank reads its own slices) or ``"rank0_broadcast"`` (rank 0 of ``group``
            reads, broadcasts tensor by tensor; collective over ``group``).
        converters: checkpoint converters; None chooses them from transformers' recipe for the model.
        ignore_unexpected: extra regexes (``re.search``) of checkpoint keys to skip.
        check_config: refuse a checkpoint whose ``config.json`` has another ``model_type`` (and no sub-config,
            such as ``text_config``, of the model's type).
        group: the group of ``"rank0_broadcast"`` (default: the world).
        not_in_checkpoint: model keys the checkpoint does not hold and that are filled otherwise (LoRA adapters):
            neither read nor reported missing.
    Returns:
        a `LoadReport`.
    Raises:
        CheckpointMismatchError: missing / unexpected keys, wrong shapes, unequal tied tensors.
        WrongModelError: the checkpoint's config is another model type.
        QuantizedCheckpointError: FP8 / scale tensors, or a ``quantization_config`` (says how to convert).
        IncompleteCheckpointError, UnsupportedRecipeError: from the converters.
    """
    if mode not in MODES:
        raise ValueError(f"load_weights: mode must be one of {MODES}, got {mode!r}")
    skip = set(not_in_checkpoint)
    targets = {k: t for k, t in model_targets(model).items() if k not in skip}
    meta = [k for k, t in targets.items() if t.local.is_meta]
    if meta:
        raise ValueError(f"load_weights: {meta[:4]} are on the meta device; materialise the model first")
    ignore = _ignore_patterns(model, ignore_unexpected)

    def make_plan(files: CheckpointFiles) -> _Plan:
        return _make_plan(model, files, targets, converters, ignore, check_config)

    if mode == "rank0_broadcast":
        if not dist.is_initialized():
            raise ValueError("load_weights: mode='rank0_broadcast' needs an initialised process group")
        ignored, sources, nbytes = _load_broadcast(model, weights, targets, make_plan, group)
    else:
        with CheckpointFiles(weights) as files:
            plan = make_plan(files)
            _load_sharded(targets, plan)
            ignored, nbytes = plan.ignored, files.bytes_read
            sources = {keys[0]: plan.origin[present[0]] for keys, present in plan.groups}
    if ignored:
        logger.info("load_weights: skipped %d known-harmless checkpoint keys: %s", len(ignored), ignored[:8])
    return LoadReport(mode, tuple(targets), tuple(ignored), sources, nbytes)
