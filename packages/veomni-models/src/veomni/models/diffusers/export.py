"""Export a (FSDP2-sharded) diffusers model as the checkpoint diffusers' ``save_pretrained`` writes.

Weights: ``diffusion_pytorch_model.safetensors`` (or ``diffusion_pytorch_model-0000i-of-0000n.safetensors``
plus ``diffusion_pytorch_model.safetensors.index.json`` when larger than ``max_shard_bytes``), the model's own
state-dict keys unchanged, gathered one tensor at a time by `veomni.models.export.write_checkpoint`.

Config: written by diffusers itself (``save_config`` of an unsharded twin of the model built on meta from the
model's config), so ``config.json`` is byte for byte what ``model.save_pretrained`` writes: ``_class_name``,
``_diffusers_version`` and the ``__init__`` arguments, nothing of veomni's. The twin is needed because
diffusers writes ``type(self).__name__`` as ``_class_name``, and FSDP2 renames the class (``FSDPWan...``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from veomni.core.parallel_state import ParallelState
from veomni.models.diffusers.build import DIFFUSERS_WEIGHTS_STEM, is_diffusers_model
from veomni.models.export.files import ExportSources
from veomni.models.export.hf import (
    DEFAULT_MAX_SHARD_BYTES,
    ExportReport,
    _out_dtype,
    write_gathered,
)
from veomni.models.loading.targets import model_targets, unwrapped_class
from veomni.models.registry import DiffusersConfig

logger = logging.getLogger(__name__)


def diffusers_config_json(model: nn.Module) -> str:
    """The ``config.json`` text diffusers' ``save_pretrained`` writes for ``model`` (possibly FSDP-wrapped)."""
    cls = unwrapped_class(model)
    with torch.device("meta"):
        twin = cls.from_config(dict(model.config))
    return twin.to_json_string()


def save_diffusers_config(model: nn.Module, out_dir: str | os.PathLike) -> Path:
    """Write `diffusers_config_json` to ``out_dir/config.json``; returns the path."""
    path = Path(out_dir) / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(diffusers_config_json(model))
    return path


def export_diffusers(
    model: nn.Module,
    out_dir: str | os.PathLike,
    *,
    parallel_state: ParallelState | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> ExportReport:
    """Write ``model`` (a diffusers ``ModelMixin``, plain or FSDP2-sharded) in diffusers' format.

    Collective when ``torch.distributed`` is initialised: call it on every rank; global rank 0 writes, each
    rank holding at most one full tensor at a time. ``from_pretrained`` of the result (or a pipeline holding
    it) gives the same state dict as ``model``.

    Args:
        model: the diffusers model, materialised.
        out_dir: the output directory (created); an older export's other shards / index there are removed.
        parallel_state: the state the model was sharded with (unused by dense DiTs; accepted for symmetry
            with `veomni.models.export.export_hf`, which dispatches here).
        dtype: cast every floating tensor to it (default: each tensor's own dtype).
        max_shard_bytes: safetensors file size limit (a single larger tensor gets a file of its own).
    Returns:
        an `ExportReport` (file names, ``{key: file}``, bytes written).
    """
    if not is_diffusers_model(model):
        raise TypeError(
            f"export_diffusers needs a diffusers ModelMixin, got {unwrapped_class(model).__name__}; "
            "use export_hf for transformers models"
        )
    targets = model_targets(model)
    shapes = {k: (t.full_shape, _out_dtype(t.tensor.dtype, dtype)) for k, t in targets.items()}
    report, is_writer = write_gathered(
        out_dir,
        targets,
        shapes,
        [],
        parallel_state,
        max_shard_bytes=max_shard_bytes,
        stem=DIFFUSERS_WEIGHTS_STEM,
    )
    distributed = dist.is_available() and dist.is_initialized()
    if is_writer:
        save_diffusers_config(model, out_dir)
        logger.info(
            "export_diffusers: wrote %d files, %.1f MiB to %s",
            len(report.files),
            report.total_bytes / 2**20,
            out_dir,
        )
    if distributed:
        dist.barrier()
    return report


def export_dcp_to_diffusers(
    dcp_dir: Path,
    out_dir: str | os.PathLike,
    config: DiffusersConfig,
    sources: ExportSources,
    *,
    given: object = None,
    prefix: str = "",
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    registry: object | None = None,
) -> ExportReport:
    """`veomni.models.export.export_dcp_to_hf` for a diffusers model (it dispatches here): the DCP checkpoint's
    ``prefix``-ed keys written as `export_diffusers` writes the live model, one tensor at a time in one process.

    Args:
        dcp_dir: the DCP directory (with ``.metadata``).
        out_dir: the output directory.
        config: the diffusers config to build the model with (the checkpoint's ``hf_files/config.json``, which the
            trainer writes with the run's config overrides, else the caller's).
        sources: where ``config`` came from (`veomni.models.export.files.export_sources`).
        given: the config the caller passed, compared with the checkpoint's own when both exist (differences are
            logged, the checkpoint's is used).
        prefix, dtype, max_shard_bytes, registry: as `veomni.models.export.export_dcp_to_hf`.
    """
    from torch.distributed.checkpoint import FileSystemReader

    from veomni.models.export.dcp import dcp_accounting, dcp_fetcher
    from veomni.models.export.files import config_differences
    from veomni.models.export.hf import plan_layout, write_checkpoint
    from veomni.models.registry import MODELS

    registry = MODELS if registry is None else registry
    if sources.from_checkpoint and given is not None:
        other = registry.load_config(given)  # type: ignore[attr-defined]
        diff = config_differences(
            dict(config.values), dict(getattr(other, "values", {})), ("checkpoint", "given")
        )
        if diff:
            logger.warning(
                "export: the checkpoint's trained config (%s) is used, not the given one (%s), which differs: %s",
                sources.config, given, "; ".join(diff),
            )  # fmt: skip
    cls = registry.model_class(config, "diffusion_transformer").cls  # type: ignore[attr-defined]
    with torch.device("meta"):
        model = cls.from_config(dict(config.values))
    targets = model_targets(model)
    stored = FileSystemReader(str(dcp_dir)).read_metadata().state_dict_metadata
    chosen = dcp_accounting(model, targets, stored, prefix, str(dcp_dir))
    shapes = {
        k: (targets[k].full_shape, _out_dtype(stored[chosen[k]].properties.dtype, dtype)) for k in chosen
    }

    fetch = dcp_fetcher(dcp_dir, stored, chosen, {k: dtype_ for k, (_, dtype_) in shapes.items()})
    report = write_checkpoint(
        out_dir, plan_layout(shapes, []), fetch, [], is_writer=True, max_shard_bytes=max_shard_bytes,
        stem=DIFFUSERS_WEIGHTS_STEM,
    )  # fmt: skip
    save_diffusers_config(model, out_dir)
    logger.info(
        "export_dcp_to_diffusers: wrote %d files, %.1f MiB to %s",
        len(report.files),
        report.total_bytes / 2**20,
        out_dir,
    )
    return report
