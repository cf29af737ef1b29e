"""Explaining a checkpoint that does not fit a composite model, one sub-model at a time.

A flat list of hundreds of missing and unexpected keys hides the usual cause: one tower (``model.visual``,
``model.audio_tower``) is stored under names that no recipe maps onto the model. `submodel_diagnosis` names
each sub-model none of whose keys was found, with what it expected and what the checkpoint has instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn

from veomni.models.loading.targets import unwrapped_class

_SHOWN = 3


def _submodels(model: nn.Module) -> list[tuple[str, str]]:
    from transformers import PreTrainedModel

    return [
        (name, unwrapped_class(m).__name__)
        for name, m in model.named_modules()
        if name and isinstance(m, PreTrainedModel)
    ]


def submodel_diagnosis(
    model: nn.Module,
    model_keys: Mapping[str, object],
    found: Mapping[str, object],
    origin: Mapping[str, str],
    unexpected: Sequence[str],
    converters: Sequence[object],
) -> list[str]:
    """Message lines for the outermost sub-models none of whose keys the (converted) checkpoint holds.

    Args:
        model: the model being loaded.
        model_keys: its keys (state-dict order).
        found: the checkpoint's tensors by model key, after the recipes.
        origin: the checkpoint key each converted key came from.
        unexpected: converted checkpoint keys the model does not have.
        converters: the converters and renames used (their recipe names are quoted).
    """
    recipes = sorted({r for r in (getattr(c, "recipe_name", None) for c in converters) if r})
    empty: list[str] = []
    lines = []
    for name, cls in _submodels(model):
        if any(name.startswith(outer + ".") for outer in empty):
            continue
        prefix = name + "."
        keys = [k for k in model_keys if k.startswith(prefix)]
        if not keys or any(k in found for k in keys):
            continue
        empty.append(name)
        stray = [origin.get(k, k) for k in unexpected]
        hint = (
            f"the checkpoint's unexpected keys look like {stray[:_SHOWN]}"
            if stray
            else "the checkpoint has no unexpected keys: this sub-model's weights are absent"
        )
        lines.append(
            f"  sub-model {name} ({cls}): none of its {len(keys)} keys was found after applying transformers' "
            f"conversion recipes {recipes or '(none for this model)'}; it expects keys like {keys[:_SHOWN]}, "
            f"{hint}"
        )
    return lines
