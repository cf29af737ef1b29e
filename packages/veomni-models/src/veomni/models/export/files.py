"""The files of an HF export beside its weights: ``config.json``, ``generation_config.json`` and the tokenizer /
processor files, and where an offline export (`veomni.models.export.export_dcp_to_hf`) takes them from.

A training checkpoint keeps them in ``step_N/hf_files/`` (`CHECKPOINT_FILES_DIR`) beside ``step_N/dcp/``: the
trainer writes there what its in-loop export writes beside the weights -- the *trained* config (with the run's
``model.config_overrides``), the generation config, the tokenizer with its chat template, the processor files -- so
a step directory describes its model with plain files. The offline export prefers them; a checkpoint written before
they existed falls back to the config the caller names (the source model's directory), and says so.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn
from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

CHECKPOINT_FILES_DIR = "hf_files"
"""The subdirectory of a training checkpoint's step directory (beside ``dcp/``) holding its model's HF files."""

# Attributes veomni sets on a config for training that plain transformers must not read back.
_RUNTIME_CONFIG_ATTRS = ("_attn_implementation", "_experts_implementation")

# Config entries that say how a model runs or where it came from, not what it is (left out of a comparison).
RUNTIME_CONFIG_KEYS = frozenset(
    {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "architectures", "use_cache",
     "output_attentions", "output_hidden_states", "return_dict", "output_router_logits", *_RUNTIME_CONFIG_ATTRS}
)  # fmt: skip

# The tokenizer / processor files transformers writes, which a source model directory may hold (the fallback for a
# checkpoint without `CHECKPOINT_FILES_DIR`).
SOURCE_SIDE_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "vocab.txt", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
    "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
)  # fmt: skip

# Written by the export itself from the config it builds the model with (dtype and architectures set).
_OWN_FILES = frozenset({"config.json", "generation_config.json"})


def save_config(
    config: PretrainedConfig, out_dir: str | os.PathLike, architecture: str, dtype: torch.dtype
) -> None:
    """Write ``config.json`` for plain transformers: ``architectures`` and ``dtype`` set (on every sub-config
    too), veomni's runtime attention / experts implementation choices left out."""
    config = copy.deepcopy(config)
    for attr in _RUNTIME_CONFIG_ATTRS:
        if hasattr(config, attr):
            setattr(config, attr, None)
    config.architectures = [architecture]
    config.dtype = dtype
    # As from_pretrained / _from_config do: a composite's sub-configs (text_config, vision_config, ...) carry the
    # weights' dtype too, else an export cast to bf16 would still say float32 (the build dtype) in them.
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if isinstance(sub, PretrainedConfig):
            sub.dtype = dtype
    config.save_pretrained(str(out_dir))


def save_model_files(model: nn.Module, out_dir: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
    """Write what `veomni.models.export.export_hf` writes beside the weights: ``config.json`` (`save_config`, with
    ``dtype``, default the first floating parameter's) and, for a generating model, its ``generation_config.json``
    (what ``from_pretrained``'s ``generate()`` will use). Local to the calling rank: no collectives, so a sharded
    model works too (only its config and class are read)."""
    from veomni.models.loading.targets import unwrapped_class

    if dtype is None:
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    save_config(model.config, out_dir, unwrapped_class(model).__name__, dtype)
    generation = getattr(model, "generation_config", None)
    if generation is not None and model.can_generate():
        generation.save_pretrained(str(out_dir))


def flatten_mapping(value: Any, prefix: str = "", out: dict[str, Any] | None = None) -> dict[str, Any]:
    """Nested mappings as one ``{"a.b.c": leaf}`` dict (config dicts, checkpoint payloads)."""
    out = {} if out is None else out
    if isinstance(value, Mapping):
        for key, item in value.items():
            flatten_mapping(item, f"{prefix}.{key}" if prefix else str(key), out)
    else:
        out[prefix] = value
    return out


def config_differences(
    first: Mapping[str, Any], second: Mapping[str, Any], labels: tuple[str, str] = ("saved", "now")
) -> list[str]:
    """``"key: <first label> A, <second label> B"`` for every entry (sub-configs as dotted keys) that differs between
    two config dicts, an absent side shown as ``<absent>``; entries that say how a model runs or where it came from
    (`RUNTIME_CONFIG_KEYS`: dtype, architectures, attention choice, ...) are left out. Empty: the same model."""
    a, b = flatten_mapping(first), flatten_mapping(second)
    absent = object()
    lines = []
    for key in sorted(set(a) | set(b)):
        if key.rsplit(".", 1)[-1] in RUNTIME_CONFIG_KEYS:
            continue
        mine, other = a.get(key, absent), b.get(key, absent)
        if mine is absent or other is absent or mine != other:
            shown = ["<absent>" if v is absent else repr(v) for v in (mine, other)]
            lines.append(f"{key}: {labels[0]} {shown[0]}, {labels[1]} {shown[1]}")
    return lines


def warn_config_differs(
    used: PretrainedConfig, given: PretrainedConfig, used_from: object, given_from: object
) -> None:
    """Warn, listing the differences, when the checkpoint's own config (``used``) is not what the caller passed."""
    if diff := config_differences(used.to_dict(), given.to_dict(), ("checkpoint", "given")):
        logger.warning(
            "export: the checkpoint's trained config (%s) is used, not the given one (%s), which differs: %s",
            used_from, given_from, "; ".join(diff),
        )  # fmt: skip


@attrs.frozen
class ExportSources:
    """Where an offline export takes its non-weight files from.

    Attributes:
        config: the config to build the model with (an object, or a directory / ``config.json``).
        folder: the directory whose ``generation_config.json`` and side files travel (None: none).
        side_files: the files of ``folder`` copied into the export as they are (tokenizer, processor, ...).
        from_checkpoint: whether they are the checkpoint's own (`CHECKPOINT_FILES_DIR`).
    """

    config: PretrainedConfig | Path
    folder: Path | None
    side_files: tuple[str, ...]
    from_checkpoint: bool


def export_sources(
    dcp_dir: str | os.PathLike, config: PretrainedConfig | str | os.PathLike | None
) -> ExportSources:
    """The checkpoint's own files when ``dcp_dir`` sits in a training step directory that has them
    (``<step>/hf_files/config.json``), else ``config`` and the tokenizer / processor files beside it
    (`SOURCE_SIDE_FILES`); logs which. (`warn_config_differs` compares a given ``config`` with the checkpoint's.)

    Raises:
        FileNotFoundError: neither the checkpoint nor ``config`` gives a config.
    """
    own = Path(dcp_dir).resolve().parent / CHECKPOINT_FILES_DIR
    if (own / "config.json").is_file():
        side = tuple(sorted(p.name for p in own.iterdir() if p.is_file() and p.name not in _OWN_FILES))
        logger.info(
            "export: config and %d tokenizer / processor files from the checkpoint, %s", len(side), own
        )
        return ExportSources(own, own, side, True)
    if config is None:
        raise FileNotFoundError(
            f"{own} holds no config.json (a checkpoint written before the trainer kept its model's files there, or "
            "not a training step directory): pass config= (--config), the model's config or source directory"
        )
    if isinstance(config, PretrainedConfig):
        logger.info(
            "export: %s has no %s; config from the given config object", own.parent, CHECKPOINT_FILES_DIR
        )
        return ExportSources(config, None, (), False)
    path = Path(config)
    folder = path if path.is_dir() else path.parent
    side = tuple(name for name in SOURCE_SIDE_FILES if (folder / name).is_file())
    logger.info(
        "export: %s has no %s (an older checkpoint, or not the trainer's); config from %s, tokenizer / processor "
        "files found there: %s (training-time config overrides are not in it)",
        own.parent, CHECKPOINT_FILES_DIR, config, list(side) or "none",
    )  # fmt: skip
    return ExportSources(path, folder, side, False)


def copy_side_files(sources: ExportSources, out_dir: str | os.PathLike) -> None:
    """Copy ``sources.side_files`` into ``out_dir``."""
    for name in sources.side_files:
        shutil.copyfile(sources.folder / name, Path(out_dir) / name)  # type: ignore[operator]
