"""Explaining a checkpoint that does not fit a composite model, one sub-model at a time.

A flat list of hundreds of missing and unexpected keys hides the usual cause: one tower (``model.visual``,
``model.audio_tower``) is stored under names that no recipe maps onto the model. `submodel_diagnosis` names
each sub-model none of whose keys was found, with what it expected and what the checkpoint has instead.
"""

from __future__ import annotations

import re
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


_DENSE_MLP = re.compile(r"^(.*\.mlp)\.(gate_proj|up_proj|down_proj)\.weight$")
_MOE_MLP = re.compile(r"^(.*\.mlp)\.(experts\.|gate\.weight$|router\.)")


def dense_moe_diagnosis(missing: Sequence[str], unexpected: Sequence[str]) -> list[str]:
    """A message line when the checkpoint has dense MLPs where the model has routed experts (or the reverse):
    the weights of a dense model (``qwen3_vl``) given to its MoE sibling (``qwen3_vl_moe``), which no key rename
    can fix.

    Args:
        missing: model keys the checkpoint lacks (a tied group may carry a ``" (tied with ...)"`` suffix).
        unexpected: converted checkpoint keys the model does not have.
    Returns:
        zero or one line.
    """
    missing_keys = [k.split(" ")[0] for k in missing]
    moe_missing = {m.group(1) for k in missing_keys if (m := _MOE_MLP.match(k))}
    dense_extra = {m.group(1) for k in unexpected if (m := _DENSE_MLP.match(k))}
    moe_extra = {m.group(1) for k in unexpected if (m := _MOE_MLP.match(k))}
    dense_missing = {m.group(1) for k in missing_keys if (m := _DENSE_MLP.match(k))}
    both = sorted(moe_missing & dense_extra)
    if both:
        return [
            f"  the checkpoint has a dense MLP (gate_proj/up_proj/down_proj) where the model has MoE experts and a "
            f"router, at {both[:_SHOWN]}{' ...' if len(both) > _SHOWN else ''}: these are the weights of a dense "
            "model (e.g. qwen3_vl) given to its MoE sibling (e.g. qwen3_vl_moe); pass an MoE checkpoint, or build "
            "the dense model"
        ]
    reverse = sorted(dense_missing & moe_extra)
    if reverse:
        return [
            f"  the checkpoint has MoE experts where the model has a dense MLP, at {reverse[:_SHOWN]}: these are the "
            "weights of an MoE model given to its dense sibling; pass a dense checkpoint, or build the MoE model"
        ]
    return []
