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
from veomni.models.diffusers_build import DIFFUSERS_WEIGHTS_STEM, is_diffusers_model
from veomni.models.export import (
    DEFAULT_MAX_SHARD_BYTES,
    ExportReport,
    _out_dtype,
    write_gathered,
)
from veomni.models.loading.targets import model_targets, unwrapped_class

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
