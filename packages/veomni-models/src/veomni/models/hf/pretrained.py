"""``from_pretrained`` / ``save_pretrained`` on veomni's generated classes, as on transformers' own.

transformers applies its checkpoint conversion recipes (``transformers.conversion_mapping``: Qwen3-MoE's
per-expert weights merged into fused tensors, Qwen2-VL's ``model.`` / ``visual.`` renamed under
``model.language_model.`` / ``model.visual.``, ...) only to classes it does not take for custom code.
``get_model_conversion_mapping`` skips every sub-model whose ``is_custom_code()`` is true, and
``PreTrainedModel.is_custom_code`` is true for any class whose ``__module__`` is outside ``transformers.``,
which is where patchgen writes ours (``veomni.models.<family>.generated``). So loading a released checkpoint
through our class left the converted weights randomly initialised (only the load report said so) and
``save_pretrained`` wrote our fused layout instead of the released one.

A generated class is upstream's modeling with its forwards patched: its parameters, names and initialisation
are upstream's, so it should share upstream's recipes. `upstream_checkpoint_io` (one line in a family's patch
config) injects two class methods into the family's ``PreTrainedModel`` base classes:

- ``is_custom_code``: false unless the class is really remote code (``register_for_auto_class``), exactly as
  for upstream's class; transformers then applies the recipe on load and reverts it on save.
- ``from_pretrained``: transformers' own, then `check_backbone_loaded` on its loading info, so a checkpoint
  that leaves backbone weights (anything outside the task head) uninitialised is a `CheckpointMismatchError`
  naming them, never a silently random model.
"""

from __future__ import annotations

import os
from typing import Any

from veomni.models.loading.loader import CheckpointMismatchError

__all__ = [
    "CheckpointMismatchError",
    "backbone_keys",
    "check_backbone_loaded",
    "from_pretrained",
    "is_custom_code",
    "upstream_checkpoint_io",
]

_SHOWN = 8


# Injected into the family's PreTrainedModel base (veomni.models.hf.pretrained): a generated class is upstream's
# modeling, so transformers applies upstream's checkpoint conversion recipes to it on load and save.
@classmethod
def is_custom_code(cls) -> bool:
    """Only remote code is custom: this class is transformers' modeling, generated under ``veomni.models``."""
    return cls.is_remote_code()


# Injected into the family's PreTrainedModel base (veomni.models.hf.pretrained): refuses a checkpoint that leaves
# backbone weights uninitialised instead of returning a partly random model.
@classmethod
def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
    """transformers' ``from_pretrained``; a `CheckpointMismatchError` if backbone weights were not in the checkpoint."""
    output_loading_info = kwargs.pop("output_loading_info", False)
    model, loading_info = super().from_pretrained(
        pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs
    )
    check_backbone_loaded(model, loading_info["missing_keys"], pretrained_model_name_or_path)
    return (model, loading_info) if output_loading_info else model


def backbone_keys(model: Any, keys: Any) -> list[str]:
    """The ``keys`` of ``model``'s state dict that belong to its backbone, sorted.

    The backbone is the sub-module named by ``base_model_prefix`` (``model.`` for a ``...ForCausalLM``); a model
    that is its own base model (``...Model``, or one without that sub-module) is all backbone. Keys outside it
    are the task head (``lm_head``, ``score``, ``qa_outputs``...), which a fine-tuning run may start fresh.
    """
    prefix = getattr(model, "base_model_prefix", "")
    if not prefix or getattr(model, prefix, None) is None:
        return sorted(keys)
    return sorted(k for k in keys if k.startswith(prefix + "."))


def check_backbone_loaded(model: Any, missing_keys: Any, source: str | os.PathLike[str]) -> None:
    """Raise if transformers' ``from_pretrained`` initialised any backbone weight instead of loading it.

    Args:
        model: the loaded model.
        missing_keys: its ``loading_info["missing_keys"]`` (tied weights already removed by transformers).
        source: the checkpoint path or hub id, for the message.

    Raises:
        CheckpointMismatchError: listing the missing backbone keys (``.missing`` holds them all).
    """
    missing = backbone_keys(model, missing_keys)
    if not missing:
        return
    shown = ", ".join(missing[:_SHOWN]) + (
        f", ... ({len(missing) - _SHOWN} more)" if len(missing) > _SHOWN else ""
    )
    raise CheckpointMismatchError(
        f"{type(model).__name__}.from_pretrained({str(source)!r}): expected every backbone weight in the "
        f"checkpoint, found {len(missing)} missing (they would be randomly initialised): {shown}. Is it a "
        f"checkpoint of another model type or layout than {getattr(model.config, 'model_type', '?')!r}?",
        missing=missing,
    )


def upstream_checkpoint_io(patch_config: Any, *base_classes: str) -> None:
    """Make a generated module's classes load and save checkpoints as transformers' own classes do.

    Args:
        patch_config: a ``patchgen.config.PatchConfig``.
        base_classes: the upstream module's ``PreTrainedModel`` base classes (``"Qwen3MoePreTrainedModel"``);
            every model class of the module derives from one of them.
    """
    if not base_classes or any(not name.endswith("PreTrainedModel") for name in base_classes):
        raise ValueError(
            f"upstream_checkpoint_io: expected the module's ...PreTrainedModel base classes, got {list(base_classes)}"
        )
    patch_config.add_import("from veomni.models.hf.pretrained import check_backbone_loaded")
    for name in base_classes:
        patch_config.override_method(
            f"{name}.is_custom_code",
            description="not custom code (veomni.models.hf.pretrained): transformers applies upstream's checkpoint "
            "conversion recipes on from_pretrained and reverts them on save_pretrained",
        )(is_custom_code)
        patch_config.override_method(
            f"{name}.from_pretrained",
            description="transformers' from_pretrained, refusing a checkpoint that leaves backbone weights "
            "uninitialised (veomni.models.hf.pretrained.check_backbone_loaded)",
        )(from_pretrained)
