"""Weight loading: safetensors files read by region into (FSDP / EP sharded) models, lazily converted.

See `veomni.models.loading.loader.load_weights` and docs/models.md.
"""

from veomni.models.loading.lazy import LazyTensor, full_region
from veomni.models.loading.loader import (
    DEFAULT_IGNORED_UNEXPECTED,
    CheckpointMismatchError,
    LoadReport,
    WrongModelError,
    converters_for,
    load_weights,
)
from veomni.models.loading.safetensors_io import CheckpointFileError, CheckpointFiles, SafetensorsStreamWriter
from veomni.models.loading.targets import Target, model_targets, tie_groups

__all__ = [
    "DEFAULT_IGNORED_UNEXPECTED",
    "CheckpointFileError",
    "CheckpointFiles",
    "CheckpointMismatchError",
    "LazyTensor",
    "LoadReport",
    "SafetensorsStreamWriter",
    "Target",
    "WrongModelError",
    "converters_for",
    "full_region",
    "load_weights",
    "model_targets",
    "tie_groups",
]
