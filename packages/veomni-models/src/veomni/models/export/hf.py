"""Export to a plain HF checkpoint: sharded safetensors + index + config, in the model's original key layout.

`export_hf` gathers an FSDP / EP sharded model one tensor at a time (every rank joins each gather; only the
writer rank keeps the result, for as long as it takes to write it), converts it back to the layout
transformers' ``save_pretrained`` writes (per-expert keys for Qwen3-MoE, ``visual.`` / ``model.`` for
Qwen2-VL: the inverses of the conversion recipes the loader applies, sub-models included) and streams it into files whose headers were planned up front. `export_dcp_to_hf`
does the same offline from a ``torch.distributed.checkpoint`` directory. The result loads with plain
``transformers.AutoModelForCausalLM.from_pretrained``; nothing veomni-specific is written.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import torch
import torch.distributed as dist
from torch import nn
from transformers import PretrainedConfig

from veomni.core.parallel_state import ParallelState
from veomni.models.convert.converters import CheckpointConverter, KeyTransform, split_transforms
from veomni.models.convert.key_transforms import unrename_key
from veomni.models.export.dcp import dcp_directory, dcp_fetcher, dcp_model
from veomni.models.export.files import (
    copy_side_files,
    export_sources,
    save_config,
    save_model_files,
    warn_config_differs,
)
from veomni.models.loading.loader import converters_for
from veomni.models.loading.safetensors_io import SafetensorsStreamWriter
from veomni.models.loading.targets import Target, gather_target, model_targets, tie_groups, unwrapped_class
from veomni.models.lora.state import has_adapters, merge_fetcher

logger = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


@attrs.frozen
class ExportReport:
    """What an export wrote (on the writer rank; other ranks get the same names).

    Attributes:
        directory: the output directory.
        files: safetensors file names, in order.
        weight_map: ``{checkpoint key: file name}``.
        total_bytes: tensor bytes written.
    """

    directory: Path
    files: tuple[str, ...]
    weight_map: dict[str, str]
    total_bytes: int


@attrs.frozen
class LayoutItem:
    """One model tensor in an export.

    Attributes:
        key: the model key whose value is written (for tied tensors, the tie source).
        parts: ``(checkpoint key, shape, dtype)`` it is written as (several for split experts).
        nbytes: the bytes of all parts.
    """

    key: str
    parts: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]
    nbytes: int


def _out_dtype(stored: torch.dtype, requested: torch.dtype | None) -> torch.dtype:
    # Only floating tensors are cast: an integer buffer keeps its dtype.
    return requested if requested is not None and stored.is_floating_point else stored


def _keep_fp32(model: nn.Module) -> Callable[[str], bool]:
    """Whether a key keeps its stored dtype under ``dtype=``: the model's ``_keep_in_fp32_modules_strict``
    (DeepSeek-V3's router ``e_score_correction_bias``), which ``save_pretrained`` never casts either."""
    names = getattr(unwrapped_class(model), "_keep_in_fp32_modules_strict", None) or ()
    if not names:
        return lambda key: False
    # transformers' own match: the name as a whole component of the key.
    pattern = re.compile(r"(^|\.)(" + "|".join(re.escape(n) for n in names) + r")(\.|$)")
    return lambda key: pattern.search(key) is not None


def _natural(key: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key)]


def _tensor_parts(
    key: str, tensor: torch.Tensor, tensor_converters: Sequence[CheckpointConverter]
) -> list[tuple[str, torch.Tensor]]:
    # save_pretrained applies at most one reversed tensor converter, trying the last listed first.
    for conv in reversed(tensor_converters):
        parts = conv.revert(key, tensor)
        if parts is not None:
            return parts
    return [(key, tensor)]


def _revert(
    key: str, tensor: torch.Tensor, converters: Sequence[CheckpointConverter | KeyTransform]
) -> list[tuple[str, torch.Tensor]]:
    # save_pretrained's order: the tensor converter, then every rename's inverse (last rename first) on each
    # key it produced.
    renames, tensor_converters = split_transforms(converters)
    return [(unrename_key(name, renames), t) for name, t in _tensor_parts(key, tensor, tensor_converters)]


def plan_layout(
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
    converters: Sequence[CheckpointConverter | KeyTransform],
) -> list[LayoutItem]:
    """The checkpoint entries for ``{model key: (full shape, dtype)}``, in natural key order.

    Converters' ``revert`` runs on meta tensors, so the layout costs no memory.
    """
    items, seen = [], {}
    for key in sorted(shapes, key=_natural):
        shape, dtype = shapes[key]
        parts = _revert(key, torch.empty(shape, dtype=dtype, device="meta"), converters)
        planned = tuple((name, tuple(t.shape), t.dtype) for name, t in parts)
        for name, _, _ in planned:
            if name in seen:
                raise ValueError(
                    f"export: checkpoint key {name!r} would be written for both {seen[name]} and {key}"
                )
            seen[name] = key
        nbytes = sum(t.numel() * t.element_size() for _, t in parts)
        items.append(LayoutItem(key, planned, nbytes))
    return items


def _group_files(items: list[LayoutItem], max_shard_bytes: int) -> list[list[LayoutItem]]:
    files: list[list[LayoutItem]] = [[]]
    size = 0
    for item in items:
        if files[-1] and size + item.nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(item)
        size += item.nbytes
    return files


def write_checkpoint(
    out_dir: str | os.PathLike,
    items: list[LayoutItem],
    fetch: Callable[[str], torch.Tensor | None],
    converters: Sequence[CheckpointConverter | KeyTransform],
    *,
    is_writer: bool,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    stem: str = "model",
) -> ExportReport:
    """Write ``items`` as HF safetensors shards (+ index when more than one), one tensor at a time.

    ``fetch(key)`` is called for every item in order on every rank (so it may run collectives); it returns
    the full tensor (in the planned dtype) on the writer and may return None elsewhere. ``stem`` names the
    files: ``model`` (transformers) or ``diffusion_pytorch_model`` (diffusers), as ``<stem>.safetensors``,
    ``<stem>-00001-of-00002.safetensors`` and ``<stem>.safetensors.index.json``.
    """
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
    out = Path(out_dir)
    groups = _group_files(items, max_shard_bytes)
    index_name = f"{stem}.safetensors.index.json"
    names = (
        [f"{stem}.safetensors"]
        if len(groups) == 1
        else [f"{stem}-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    if is_writer:
        out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    _, tensor_converters = split_transforms(converters)
    for name, group in zip(names, groups, strict=True):
        entries = [part for item in group for part in item.parts]
        writer = SafetensorsStreamWriter(out / name, entries) if is_writer else None
        for item in group:
            full = fetch(item.key)
            if writer is not None:
                if full is None:
                    raise RuntimeError(f"export: the writer rank got no tensor for {item.key}")
                # Names come from the plan: renames run once per export (some of transformers' are stateful).
                tensors = [t for _, t in _tensor_parts(item.key, full, tensor_converters)]
                if len(tensors) != len(item.parts):
                    raise RuntimeError(
                        f"export: {item.key} split into {len(tensors)} tensors, planned {item.parts}"
                    )
                for (part_name, _, _), tensor in zip(item.parts, tensors, strict=True):
                    writer.write(part_name, tensor)
            del full
        if writer is not None:
            writer.close()
            total += writer.total_bytes
        weight_map.update({part[0]: name for item in group for part in item.parts})
    if is_writer:
        if len(names) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (out / index_name).write_text(json.dumps(index, indent=2) + "\n")
        _remove_stale(out, set(names) | ({index_name} if len(names) > 1 else set()), stem)
    return ExportReport(out, tuple(names), weight_map, total)


def _remove_stale(out: Path, written: set[str], stem: str = "model") -> None:
    # A previous export into the same directory may have had other shards (or an index): as transformers'
    # save_pretrained does, drop those, so the directory holds exactly one checkpoint.
    name = re.escape(stem)
    stale = re.compile(rf"{name}(-\d{{5}}-of-\d{{5}})?\.safetensors|{name}\.safetensors\.index\.json")
    for path in out.iterdir():
        if path.is_file() and stale.fullmatch(path.name) and path.name not in written:
            path.unlink()


def _leaders(model: nn.Module, targets: dict[str, Target]) -> list[str]:
    # transformers writes one key per tied group (the tie source); the others are re-tied on load.
    return [keys[0] for keys in tie_groups(model, targets)]


def export_hf(
    model: nn.Module,
    out_dir: str | os.PathLike,
    *,
    parallel_state: ParallelState | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> ExportReport:
    """Write ``model`` (plain, FSDP2- and/or EP-sharded) as an HF checkpoint that plain transformers loads.

    Collective when ``torch.distributed`` is initialised: call it on every rank. Global rank 0 writes; each
    rank holds at most one full tensor at a time. Keys follow transformers' ``save_pretrained`` (tied
    duplicates dropped, experts split back where the model's conversion recipe says the original checkpoint
    has them split).

    Args:
        model: an HF ``PreTrainedModel`` (possibly FSDP-wrapped), materialised.
        out_dir: the output directory (created).
        parallel_state: required when experts are EP-sharded (their gather runs over ``ep_group``).
        dtype: cast every tensor to this dtype (default: each tensor's own).
        max_shard_bytes: safetensors file size limit (a single tensor larger than it gets its own file).
    Returns:
        an `ExportReport`.
    """
    from veomni.models.diffusers.build import is_diffusers_model

    if is_diffusers_model(model):
        # One export entry point for every model the loop trains: diffusers models leave in their own format.
        from veomni.models.diffusers.export import export_diffusers

        return export_diffusers(
            model, out_dir, parallel_state=parallel_state, dtype=dtype, max_shard_bytes=max_shard_bytes
        )
    config = getattr(model, "config", None)
    if not isinstance(config, PretrainedConfig):
        raise TypeError(f"export_hf needs an HF PreTrainedModel (with a config), got {type(model).__name__}")
    targets = model_targets(model)
    merge = None
    if has_adapters(model):
        # A LoRA model exports merged (W + scaling * B @ A; per expert for fused experts), in the base model's own
        # key layout.
        adapter_keys, merge = merge_fetcher(model, parallel_state)
        targets = {k: t for k, t in targets.items() if k not in adapter_keys}
    leaders = _leaders(model, targets)
    fp32 = _keep_fp32(model)
    shapes = {
        k: (targets[k].full_shape, _out_dtype(targets[k].tensor.dtype, None if fp32(k) else dtype))
        for k in leaders
    }
    converters = converters_for(model, targets, for_export=True)
    report, is_writer = write_gathered(
        out_dir, targets, shapes, converters, parallel_state, max_shard_bytes=max_shard_bytes, transform=merge
    )
    distributed = dist.is_available() and dist.is_initialized()
    if is_writer:
        first = next(iter(shapes.values()))[1] if shapes else torch.float32
        save_model_files(model, out_dir, dtype or first)
        logger.info(
            "export_hf: wrote %d files, %.1f MiB to %s",
            len(report.files),
            report.total_bytes / 2**20,
            out_dir,
        )
    if distributed:
        dist.barrier()
    return report


def write_gathered(
    out_dir: str | os.PathLike,
    targets: dict[str, Target],
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
    converters: Sequence[CheckpointConverter | KeyTransform],
    parallel_state: ParallelState | None,
    *,
    max_shard_bytes: int,
    stem: str = "model",
    transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[ExportReport, bool]:
    """Gather each tensor in ``shapes`` whole (every rank takes part), ``transform(key, tensor)`` it if given (on
    every rank: it may gather too), cast it to its export dtype and write the safetensors shards on rank 0
    (`plan_layout` + `write_checkpoint`). Returns ``(report, this rank writes)``."""
    items = plan_layout(shapes, converters)
    distributed = dist.is_available() and dist.is_initialized()
    is_writer = not distributed or dist.get_rank() == 0

    def fetch(key: str) -> torch.Tensor | None:
        full = gather_target(targets[key], parallel_state)
        if transform is not None:
            full = transform(key, full)
        return full.to(shapes[key][1]) if is_writer else None

    with torch.no_grad():
        report = write_checkpoint(
            out_dir, items, fetch, converters, is_writer=is_writer, max_shard_bytes=max_shard_bytes, stem=stem
        )
    return report, is_writer


def export_dcp_to_hf(
    dcp_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    config: PretrainedConfig | str | os.PathLike | None = None,
    prefix: str = "",
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    task: str | None = None,
    registry: object | None = None,
) -> ExportReport:
    """Convert a DCP checkpoint of a model's state (FQN keys, optionally under ``prefix``) to an HF checkpoint.

    Runs in one process and reads one tensor at a time. Keys not starting with ``prefix`` (optimizer state,
    ...) are ignored; under it, the keys must be exactly the model's ``state_dict()`` keys with full,
    global shapes (tied duplicates optional).

    Config, generation config and tokenizer / processor files: a training checkpoint's own
    (``step_N/hf_files/`` beside ``step_N/dcp/``, what the in-loop export writes beside its weights), so the
    export is the in-loop one; else ``config`` and the tokenizer / processor files beside it
    (`veomni.models.export.files.export_sources`, which logs where they came from). A diffusers config (a DiT's
    checkpoint) is exported in diffusers' format instead (`veomni.models.diffusers.export.export_dcp_to_diffusers`).

    Args:
        dcp_dir: the ``torch.distributed.checkpoint`` directory.
        out_dir: the output directory.
        config: the model's config (object, directory or ``config.json``); it decides keys, shapes, layout. Needed
            only where the checkpoint has no ``hf_files/`` (one written before it had); a given one that differs
            from the checkpoint's is logged with the differences and not used.
        prefix: the prefix of the model's keys in the checkpoint, e.g. ``"model."``.
        dtype: cast to this dtype (default: as stored).
        max_shard_bytes: safetensors file size limit.
        task: the model class's task (see `veomni.models.registry.TASKS`). None infers it: the task whose class
            the config's ``architectures`` names (the trained class, in a checkpoint's ``hf_files/``), else the first
            of ``causal_lm``, ``image_text_to_text``, ``any_to_any`` the model supports; a candidate is taken only
            when its keys and shapes are exactly the checkpoint's.
        registry: a `ModelRegistry` (default `veomni.models.registry.MODELS`).
    """
    from torch.distributed.checkpoint import FileSystemReader

    from veomni.models.registry import DIFFUSERS_TASK, MODELS, DiffusersConfig

    registry = MODELS if registry is None else registry
    dcp_path = dcp_directory(dcp_dir)
    sources = export_sources(dcp_path, config)
    cfg = registry.load_config(sources.config)  # type: ignore[attr-defined]
    if isinstance(
        cfg, DiffusersConfig
    ):  # a DiT's checkpoint: written as diffusers' save_pretrained writes it
        from veomni.models.diffusers.export import export_dcp_to_diffusers

        if task not in (None, DIFFUSERS_TASK):
            raise ValueError(
                f"export_dcp_to_hf: {sources.config} is a diffusers config ({cfg.class_name}), which exports as "
                f"task {DIFFUSERS_TASK!r}; found task={task!r} (leave it out)"
            )

        return export_dcp_to_diffusers(
            dcp_path, out_dir, cfg, sources, given=config, prefix=prefix, dtype=dtype,
            max_shard_bytes=max_shard_bytes, registry=registry,
        )  # fmt: skip
    if sources.from_checkpoint and config is not None:
        warn_config_differs(cfg, registry.load_config(config), sources.config, config)  # type: ignore[attr-defined]
    stored = FileSystemReader(str(dcp_path)).read_metadata().state_dict_metadata
    model, cfg, chosen = dcp_model(cfg, registry, stored, prefix, str(dcp_dir), task)
    targets = model_targets(model)
    fp32 = _keep_fp32(model)
    shapes = {
        k: (targets[k].full_shape, _out_dtype(stored[chosen[k]].properties.dtype, None if fp32(k) else dtype))
        for k in chosen
    }
    converters = converters_for(model, targets, for_export=True)
    items = plan_layout(shapes, converters)

    fetch = dcp_fetcher(dcp_path, stored, chosen, {k: dtype_ for k, (_, dtype_) in shapes.items()})
    report = write_checkpoint(
        out_dir, items, fetch, converters, is_writer=True, max_shard_bytes=max_shard_bytes
    )
    first = next(iter(shapes.values()))[1] if shapes else torch.float32
    save_config(cfg, out_dir, unwrapped_class(model).__name__, dtype or first)
    if model.can_generate():
        # The source's own generation_config.json where there is one (EOS ids, sampling defaults; a checkpoint's
        # already holds the tokenizer's end token), as export_hf carries the live model's; else the one
        # transformers derives from the config.
        generation = model.generation_config
        if sources.folder is not None and (sources.folder / "generation_config.json").is_file():
            from transformers import GenerationConfig

            generation = GenerationConfig.from_pretrained(str(sources.folder))
        generation.save_pretrained(str(out_dir))
    copy_side_files(sources, out_dir)
    logger.info(
        "export_dcp_to_hf: wrote %d files, %.1f MiB to %s",
        len(report.files),
        report.total_bytes / 2**20,
        out_dir,
    )
    return report
