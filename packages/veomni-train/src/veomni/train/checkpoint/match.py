"""Does a checkpoint hold this run's state? Names, global shapes and optimizer groups compared before any load.

A difference is a `CheckpointMismatchError` that lists it: a checkpoint of a 4-layer model never silently fills 2
layers of another, and a parameter never takes another optimizer group's settings. Used by `CheckpointManager.load`.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from veomni.models.export.files import config_differences, flatten_mapping
from veomni.train.recipe.lora_section import LORA_MEANING

log = logging.getLogger(__name__)

SHOWN = 8  # names listed per kind of difference in an error


def config_dict(config: Any) -> dict[str, Any]:
    """The model config as plain data (transformers ``to_dict``; a diffusers config's JSON values): what
    ``trainer.pt`` saves and `check_resumable` compares."""
    return config.to_dict() if hasattr(config, "to_dict") else dict(config.values)


class CheckpointMismatchError(ValueError):
    """A checkpoint does not hold the state of the model (or optimizer) it is being loaded into."""


def config_diff(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """``"key: saved X, now Y"`` for every config entry (nested sub-configs as dotted keys) that differs, leaving
    out `RUNTIME_CONFIG_KEYS`; empty when the two configs describe the same model (`config_differences`)."""
    return config_differences(saved, current, ("saved", "now"))


def _listing(names: list[str]) -> str:
    more = f" ... and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def _stated_params(tensors: Mapping[str, Any]) -> set[str]:
    # Optimizer state keys are ``optim.state.<parameter fqn>.<statistic>``: the parameters the optimizer holds state
    # for, which AdamW creates at a parameter's first gradient (a parameter no gradient reached yet has none).
    prefix = "optim.state."
    return {k[len(prefix) :].rsplit(".", 1)[0] for k in tensors if k.startswith(prefix)}


def _grouped_params(groups: Any) -> set[str] | None:
    # The parameters an optimizer trains, by name: its param_groups' ``params`` (None when it records none).
    if not groups:
        return None
    names = [group.get("params") for group in groups]
    if any(n is None for n in names):
        return None
    return {fqn for group_names in names for fqn in group_names}


def _param_of(key: str) -> str:
    return key[len("optim.state.") :].rsplit(".", 1)[0]


def check_payload_matches(dcp_dir: Path, payload: Mapping[str, Any]) -> list[str]:
    """Compare the tensors ``payload`` would load (names and global shapes) with what ``dcp_dir`` holds.

    The parameters each side trains are read from its optimizer's param groups (the model's trainable parameters),
    not from which parameters have optimizer state: AdamW keeps none for a parameter no gradient has reached yet (a
    token embedding only some rows use, a tower before its first image), and such a checkpoint is complete.

    Returns:
        the parameters both runs train that have no optimizer state in the checkpoint (sorted); `CheckpointManager.load`
        leaves them without state, as the saving run had them.
    Raises:
        CheckpointMismatchError: listing model tensors missing on either side and shape differences; only when
            the model matches are optimizer differences reported (a new optimizer key is then the real story). A
            tensor that is a parameter of its own on one side and tied (or frozen) on the other -- an untied
            ``lm_head`` -- is a model difference.
    """
    metadata = dcp.FileSystemReader(dcp_dir).read_metadata().state_dict_metadata
    saved = {key: tuple(md.size) for key, md in metadata.items() if hasattr(md, "size")}
    wanted = {k: tuple(v.shape) for k, v in flatten_mapping(payload).items() if isinstance(v, torch.Tensor)}
    saved_groups = _saved_groups(dcp_dir, metadata)
    groups_now = (payload.get("optim") or {}).get("param_groups")
    # A tied lm_head is in the state dict under both names but is one trained parameter: the model tensors of a
    # tied and an untied model match, and only the optimizer's parameters show it. That is a model difference.
    trained_now = _grouped_params(groups_now)
    trained_then = _grouped_params(saved_groups)
    if trained_now is None or trained_then is None:  # an optimizer without named groups: only its state shows
        trained_now, trained_then = _stated_params(wanted), _stated_params(saved)
    stateless = sorted((trained_now & trained_then) - _stated_params(saved))
    skipped = set(stateless)
    sharing = []
    if new := sorted(f"model.{p}" for p in trained_now - trained_then if f"model.{p}" in saved):
        sharing.append(
            f"{len(new)} model tensors are trained parameters of their own in this run but were not in the "
            f"checkpoint's run (tied to another tensor, e.g. tie_word_embeddings, or frozen by model.freeze): "
            f"{_listing(new)}"
        )
    if gone := sorted(f"model.{p}" for p in trained_then - trained_now if f"model.{p}" in wanted):
        sharing.append(
            f"{len(gone)} model tensors were trained parameters of their own in the checkpoint's run but are not "
            f"in this run (tied to another tensor, e.g. tie_word_embeddings, or frozen by model.freeze): "
            f"{_listing(gone)}"
        )
    for namespace, what in (("model.", "model"), ("optim.state.", "optimizer state")):
        mine = {k for k in wanted if k.startswith(namespace)}
        if namespace == "optim.state.":
            mine = {k for k in mine if _param_of(k) not in skipped}
        theirs = {k for k in saved if k.startswith(namespace)}
        problems = []
        if missing := sorted(mine - theirs):
            cause = (
                " (the checkpoint holds other statistics for these parameters: another optimizer or optimizer "
                "settings)"
                if namespace == "optim.state."
                else ""
            )
            problems.append(
                f"{len(missing)} {what} tensors are not in the checkpoint{cause}: {_listing(missing)}"
            )
        if extra := sorted(theirs - mine):
            problems.append(
                f"the checkpoint holds {len(extra)} {what} tensors this run does not: {_listing(extra)}"
            )
        shapes = [f"{k} saved {list(saved[k])}, now {list(wanted[k])}" for k in sorted(mine & theirs)
                  if saved[k] != wanted[k]]  # fmt: skip
        if shapes:
            problems.append(f"{len(shapes)} {what} tensors changed shape: {_listing(shapes)}")
        if namespace == "model.":
            problems += sharing
        if problems:
            raise CheckpointMismatchError(
                f"checkpoint {dcp_dir.parent} does not hold this run's {what}:\n  - "
                + "\n  - ".join(problems)
                + "\nIt was written by a different model or optimizer setup; resume it with the recipe it was "
                "saved with (its recipe is in trainer.pt), or start fresh (another checkpoint.dir, or "
                "checkpoint.resume=never)."
            )
    _check_param_groups(dcp_dir, saved_groups, payload)
    return stateless


def _saved_groups(dcp_dir: Path, metadata: Mapping[str, Any]) -> list[dict[str, Any]]:
    # The checkpoint's optimizer param groups: their parameter names, weight decay and lr multiplier.
    prefix = "optim.param_groups."
    count = len({k[len(prefix) :].split(".", 1)[0] for k in metadata if k.startswith(prefix)})
    keys = ("params", "weight_decay", "lr_multiplier")
    saved = {
        f"{prefix}{i}.{key}": None for i in range(count) for key in keys if f"{prefix}{i}.{key}" in metadata
    }
    if saved:
        with warnings.catch_warnings():  # one process reading a few small entries is the intent here
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(saved, checkpoint_id=dcp_dir, no_dist=True)
    return [
        {key: saved[f"{prefix}{i}.{key}"] for key in keys if f"{prefix}{i}.{key}" in saved}
        for i in range(count)
    ]


def _check_param_groups(
    dcp_dir: Path, saved_groups: list[dict[str, Any]], payload: Mapping[str, Any]
) -> None:
    # The saved param_groups are matched to this run's by parameter name (torch's set_state_dict), and a group takes
    # the hyperparameters of the saved group its parameters were in: each parameter must sit in a group of the same
    # kind as before (decayed or not, same lr multiplier), or another group's settings would land on it without a
    # word. The values themselves (the weight decay, the lr) are optimizer state and resume as saved. Groups may be
    # coarser than saved (EP experts merged back with the dense parameters); a finer split cannot load.
    groups = (payload.get("optim") or {}).get("param_groups") if isinstance(payload, Mapping) else None
    if groups is None:
        return
    count = len(saved_groups)

    def kind(weight_decay: Any, multiplier: Any) -> dict[str, Any]:
        return {"decayed": bool(weight_decay), "lr_multiplier": multiplier}

    then = {fqn: kind(group.get("weight_decay"), group.get("lr_multiplier"))
            for group in saved_groups for fqn in group.get("params") or ()}  # fmt: skip
    now = {
        fqn: kind(group.get("weight_decay"), group.get("lr_multiplier"))
        for group in groups
        for fqn in group["params"]
    }
    changed = [f"{fqn} saved {then[fqn]}, now {now[fqn]}" for fqn in sorted(then.keys() & now.keys())
               if then[fqn] != now[fqn]]  # fmt: skip
    problems = [f"{len(changed)} parameters changed optimizer group: {_listing(changed)}"] if changed else []
    if len(groups) > count:
        problems.append(
            f"the checkpoint has {count} optimizer param groups, this run {len(groups)} (a finer split, e.g. "
            "expert parallelism where the checkpoint had none, cannot take the saved groups' hyperparameters)"
        )
    if problems:
        raise CheckpointMismatchError(
            f"checkpoint {dcp_dir.parent} groups the optimizer's parameters differently:\n  - "
            + "\n  - ".join(problems)
            + "\nThe groups come from optim.lr_multipliers, which parameters are decayed and the device mesh; "
            "resume with the recipe the checkpoint was saved with (its recipe is in trainer.pt), or start fresh."
        )


def saved_param_group_slots(dcp_dir: Path) -> list[dict[str, Any]] | None:
    """One empty slot per saved optimizer param group, with the keys it was saved with (what `dcp.load` fills);
    None when the checkpoint holds no param groups."""
    prefix = "optim.param_groups."
    metadata = dcp.FileSystemReader(dcp_dir).read_metadata().state_dict_metadata
    slots: dict[int, dict[str, Any]] = {}
    for key in metadata:
        if key.startswith(prefix):
            index, name = key[len(prefix) :].split(".", 1)
            slots.setdefault(int(index), {})[name] = None
    if not slots:
        return None
    return [slots.get(i, {}) for i in range(max(slots) + 1)]


def _check_same_adapters(path: Path, saved: Mapping[str, Any], now: Mapping[str, Any]) -> None:
    # A LoRA checkpoint holds adapters of one shape and target set, a full one every weight: neither resumes as the
    # other, and adapters of another rank or on other layers are other parameters.
    was, is_ = bool(saved.get("enabled")), bool(now.get("enabled"))
    if was != is_:
        kinds = {True: "LoRA adapters only (lora.enabled: true)", False: "every weight (lora.enabled: false)"}
        raise CheckpointMismatchError(
            f"checkpoint {path} holds {kinds[was]}, but this run trains {kinds[is_]}; resume with the saved "
            "lora.enabled, or start fresh (another checkpoint.dir, or checkpoint.resume=never)"
        )
    diff = [
        f"lora.{k}: saved {saved.get(k)!r}, now {now.get(k)!r}"
        for k in LORA_MEANING
        if saved.get(k) != now.get(k)
    ]
    if was and diff:
        raise CheckpointMismatchError(
            f"checkpoint {path} holds other adapters than this run's:\n  - "
            + "\n  - ".join(diff)
            + "\nResume with the saved lora settings, or start from its exported adapter with lora.init_from and a "
            "fresh checkpoint.dir"
        )


def check_resumable(
    path: Path,
    trainer_state: Mapping[str, Any],
    *,
    model_config: Mapping[str, Any],
    recipe: Mapping[str, Any],
) -> None:
    """Check a checkpoint's ``trainer.pt`` against the resuming run before any tensor is read.

    Args:
        path: the step directory (for messages).
        trainer_state: its rank-0 trainer state (`read_trainer_state`).
        model_config: this run's model config as plain data.
        recipe: this run's resolved recipe as plain data (`recipe_to_dict`).

    Raises:
        CheckpointMismatchError: the saved model config describes another model, or the saved LoRA setup
            (enabled, rank, alpha, scaling rule, targets, modules to save) differs.

    A changed ``model`` section of the same model, and optimizer hyperparameters that will keep their saved values
    (the optimizer's param groups and the scheduler's base lrs are state), are warned about, not refused.
    """
    saved_config = trainer_state.get("model_config")
    if saved_config is None:
        log.warning("%s records no model config (an older checkpoint): only its tensors are compared", path)
    elif diff := config_diff(saved_config, model_config):
        raise CheckpointMismatchError(
            f"checkpoint {path} was saved by another model; its config differs from this run's:\n  - "
            + "\n  - ".join(diff)
            + "\nResume it with the recipe it was saved with, or start fresh (another checkpoint.dir, or "
            "checkpoint.resume=never)."
        )
    saved_recipe = trainer_state.get("recipe") or {}
    _check_same_adapters(path, saved_recipe.get("lora") or {}, recipe.get("lora") or {})
    if (saved_model := saved_recipe.get("model")) is not None:
        now = recipe["model"]
        changed = [f"model.{k}: saved {saved_model.get(k)!r}, now {now[k]!r}" for k in now
                   if k != "config" and saved_model.get(k) != now[k]]  # fmt: skip
        if changed:
            log.warning(
                "resuming %s with a changed model section (same model, so allowed): %s", path, changed
            )
    if (saved_optim := saved_recipe.get("optim")) is not None:
        now = recipe["optim"]
        restored = [f"optim.{k}: saved {saved_optim.get(k)!r}, recipe {now[k]!r}"
                    for k in ("lr", "betas", "eps", "weight_decay") if saved_optim.get(k) != now[k]]  # fmt: skip
        if restored and now.get("on_resume") == "recipe":
            log.info(
                "resuming %s with the recipe's optimizer values (optim.on_resume=recipe): %s", path, restored
            )
        elif restored:
            log.warning(
                "resuming %s: the checkpoint's optimizer and schedule state keep the saved values of %s (the "
                "schedule's shape, warmup and max_grad_norm follow the recipe); set optim.on_resume=recipe to "
                "take the recipe's",
                path, restored,
            )  # fmt: skip
