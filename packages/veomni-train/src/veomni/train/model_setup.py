"""How the trainer builds the recipe's model: config, meta probe, FSDP2 policy and the one-rank paths
(`one_rank_path`: FSDP2, a plain module, or a bf16 module over fp32 master weights), kernels validated for the
training device. `veomni.train.loop.build_run` calls `build_recipe_model`; the dit setup and the benchmarks reuse
the pieces.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import attrs
import torch
from huggingface_hub.errors import StrictDataclassError
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from veomni.core.checkpointing import apply_activation_checkpointing
from veomni.core.master_weights import apply_master_weights
from veomni.core.parallel_state import ParallelState
from veomni.kernels import Hardware, detect_hardware
from veomni.models.build import build_model, default_fsdp_policy
from veomni.models.diffusers.build import is_diffusers_model
from veomni.models.hf.async_sp import check_async_ulysses, enable_async_ulysses
from veomni.models.registry import MODELS
from veomni.train.preflight import PreflightError
from veomni.train.recipe import Recipe
from veomni.train.tasks import task_class

log = logging.getLogger("veomni.train")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_config(recipe: Recipe) -> PretrainedConfig:
    """The recipe's model config, resolved: an inline mapping (with model_type), a path, or the weights' config."""
    config = recipe.model.config
    if isinstance(config, dict):
        values = dict(config)
        model_type = values.pop("model_type")
        try:
            return AutoConfig.for_model(model_type, **values)
        except StrictDataclassError as err:  # a value of the wrong type (transformers' configs are strict)
            raise PreflightError(f"model.config: {err}") from None
    source = config if config is not None else recipe.model.weights
    try:
        return MODELS.load_config(source, **recipe.model.config_overrides)
    except json.JSONDecodeError as err:  # a ValueError too, but the file's fault, not the overrides'
        field = "model.config" if config is not None else "model.weights"
        file = Path(source) / "config.json" if Path(source).is_dir() else Path(source)
        raise PreflightError(f"{field}: {file} is not valid JSON: {err}") from None
    except (ValueError, StrictDataclassError) as err:
        raise PreflightError(f"model.config_overrides: {err}") from None


def meta_instance(config: PretrainedConfig | str, task: str = "causal_lm") -> nn.Module:
    """The model class veomni builds for ``config`` and registry ``task``, on the meta device (no memory): for
    block patterns and parameter counts, which the sharded model no longer shows whole."""
    from veomni.models.registry import config_for_class

    loaded = MODELS.load_config(config)
    cls = MODELS.model_class(loaded, task).cls
    with torch.device("meta"):
        return cls._from_config(config_for_class(loaded, cls))


def _fsdp_policy(recipe: Recipe, probe: nn.Module, dtype: torch.dtype, param_dtype: torch.dtype) -> Any:
    # Mixed precision only when parameters are stored above the compute dtype; gradients are reduced in fp32
    # either way (for pure bf16 too: FSDP casts them back to the parameter dtype after the reduction). A diffusers
    # DiT takes float32 timesteps and rotary tables as diffusers' pipelines pass them (the dit task casts the latents
    # and contexts itself): casting its inputs would train on bf16-rounded timesteps that inference never uses.
    return attrs.evolve(
        default_fsdp_policy(probe, head_unit=recipe.parallel.lm_head_unit),
        activation_checkpointing=recipe.parallel.activation_checkpointing,
        ac_keep_attention=recipe.parallel.ac_keep_attention,
        reshard_after_forward=recipe.parallel.reshard_after_forward,
        param_dtype=dtype if dtype != param_dtype else None,
        reduce_dtype=torch.float32,
        cast_forward_inputs=not is_diffusers_model(probe),
    )


def one_rank_path(recipe: Recipe, world_size: int) -> str:
    """How `build_recipe_model` trains on ``world_size`` ranks: ``"fsdp2"`` (FSDP2, with mixed precision when
    ``model.param_dtype`` is above ``model.dtype``), ``"plain"`` (one rank, parameters in the compute dtype) or
    ``"master_weights"`` (one rank, a compute-dtype module over fp32 masters the optimizer steps:
    `veomni.core.master_weights`). ``parallel.force_fsdp2`` keeps FSDP2 on one rank."""
    if world_size > 1 or recipe.parallel.force_fsdp2:
        return "fsdp2"
    # LoRA: the frozen base has no masters to keep, and the adapters are stored in model.param_dtype themselves.
    plain = recipe.model.dtype == recipe.model.param_dtype or recipe.lora.enabled
    return "plain" if plain else "master_weights"


def build_recipe_model(
    recipe: Recipe, config: PretrainedConfig | str, probe: nn.Module, ops: Any, state: ParallelState,
    device: torch.device, *, from_checkpoint: bool = False,
) -> nn.Module:  # fmt: skip
    """The recipe's model as `build_run` builds it (`one_rank_path` says which): FSDP2 (and EP) on ``state``'s
    meshes with the recipe's precision, or on one rank a plain module -- in ``model.param_dtype`` when it equals
    ``model.dtype`` (nothing to shard or cast), else in ``model.dtype`` with fp32 masters attached
    (`veomni.core.master_weights.master_weights_of` finds them; optimizer and checkpoints take their module).
    ``probe`` is `meta_instance` of ``config`` (block patterns); ``ops`` a validated `OpsConfig`;
    ``from_checkpoint``: a resume fills every parameter next, so ``model.weights`` is not read
    (`veomni.models.build.build_model`)."""
    async_type = _async_ulysses_type(recipe, config)  # refused before anything is built
    dtype, param_dtype = DTYPES[recipe.model.dtype], DTYPES[recipe.model.param_dtype]
    policy = _fsdp_policy(recipe, probe, dtype, param_dtype)
    path = one_rank_path(recipe, state.dims.world_size)
    ops = ops_for_eager_only_features(recipe, ops)
    args = {**_build_args(recipe, ops), "from_checkpoint": from_checkpoint}
    if recipe.lora.enabled:
        # The frozen base is stored in the compute dtype (no fp32 copy of weights that never change); the adapters
        # in model.param_dtype, cast to the compute dtype by FSDP2's mixed precision like any trained parameter.
        args |= {"lora": recipe.lora.spec(), "lora_dtype": param_dtype, "lora_seed": recipe.train.seed}
        param_dtype = dtype
    if path == "fsdp2":
        if state.dims.world_size == 1:
            log.info("one rank, parallel.force_fsdp2: training through FSDP2 on a one-rank mesh")
        model = build_model(config, parallel_state=state, dtype=param_dtype, fsdp_policy=policy, **args)
        if async_type is not None:
            log.info("parallel.async_ulysses: %d attention layers overlap projections with the exchange",
                     enable_async_ulysses(model, async_type))  # fmt: skip
        return model
    # One rank: FSDP2 would only add per-block hooks and parameter copies (42% of the step time of Qwen3-1.7B on
    # one H100 in pure bf16, half the throughput with mixed precision; notebook/benchmarks-log.md), so the model stays a
    # plain module.
    if path == "plain":
        log.info("one rank, %s parameters = compute dtype: training without FSDP2", recipe.model.param_dtype)
        model = build_model(config, dtype=param_dtype, device=device, **args)
    else:
        log.info(
            "one rank, %s compute over %s master weights: training a plain %s module, the optimizer stepping "
            "%s masters (parallel.force_fsdp2=true trains through FSDP2 instead)",
            recipe.model.dtype, recipe.model.param_dtype, recipe.model.dtype, recipe.model.param_dtype,
        )  # fmt: skip
        # Built (and loaded) in fp32 like FSDP2's masters; kernels chosen for the compute dtype.
        model = build_model(config, dtype=param_dtype, device=device, compute_dtype=dtype, **args)
        apply_master_weights(model, dtype, policy.block_patterns, cast_inputs=policy.cast_forward_inputs)
    if policy.activation_checkpointing:
        apply_activation_checkpointing(model, policy.block_patterns, keep_attention=policy.ac_keep_attention)
    return model


def ops_for_eager_only_features(recipe: Recipe, ops: Any) -> Any:
    """``ops`` with eager blocks when the recipe turns on a feature that compiled blocks cannot run and the blocks
    would compile by default (``ops.compile: auto`` on CUDA); an explicit ``ops.compile: on`` with one is a
    `PreflightError`. The features: ``parallel.async_ulysses`` (its all-to-alls run with ``async_op=True`` work
    handles, which torch.compile cannot trace) and ``parallel.ac_keep_attention`` (checkpointing selects the
    attention call inside the block, which a compiled forward hides)."""
    if ops is None or not ops.compile_enabled:
        return ops
    reasons = {
        "async_ulysses": "overlaps the exchange with async_op=True collectives, which torch.compile cannot trace",
        "ac_keep_attention": "saves the attention output inside each block, which a compiled block cannot select",
    }
    # (ac_keep_attention without activation_checkpointing is a RecipeError already.)
    on = [name for name in reasons if getattr(recipe.parallel, name)]
    if not on:
        return ops
    if ops.compile == "on":
        raise PreflightError(
            "; ".join(f"parallel.{name}: true {reasons[name]}" for name in on)
            + ", but ops.compile is 'on'; set ops.compile to off or auto (auto keeps the blocks eager), or turn "
            + " / ".join(f"parallel.{name}" for name in on)
            + " off to keep compiled blocks"
        )
    log.info("decoder blocks stay eager (ops.compile auto): %s",
             "; ".join(f"parallel.{name} {reasons[name]}" for name in on))  # fmt: skip
    return ops.with_compile("off")


def _async_ulysses_type(recipe: Recipe, config: PretrainedConfig | str) -> str | None:
    # The model_type whose family's attention classes get the async path (a PreflightError giving the family's
    # reason when it has none); None when parallel.async_ulysses is off. SP (and so async_ulysses, which needs
    # sp > 1) exists only on the FSDP2 path.
    if not recipe.parallel.async_ulysses:
        return None
    model_type = MODELS.load_config(config).model_type if isinstance(config, str) else config.model_type
    try:
        check_async_ulysses(model_type)
    except ValueError as err:
        raise PreflightError(str(err)) from None
    return model_type


def _build_args(recipe: Recipe, ops: Any) -> dict[str, Any]:
    hf = recipe.model.backend == "hf"
    task = task_class(recipe.model.task)
    args = {
        "weights": recipe.model.weights, "ops": None if hf else ops, "backend": recipe.model.backend,
        "task": task.model_task, "freeze": recipe.model.freeze,
    }  # fmt: skip
    # A task may need more of the build (the reward task: a new head on a causal-LM checkpoint).
    extra = getattr(task, "build_args", None)
    return args if extra is None else {**args, **extra(recipe)}


def hand_aux_loss_to_loop(model: nn.Module) -> None:
    """Zero the model's own MoE aux-loss coefficient: the loop adds the aux term itself, scaled per micro-batch
    (`veomni.train.step`), so the model's returned loss must be the pure LM loss."""
    if hasattr(model, "router_aux_loss_coef"):
        model.router_aux_loss_coef = 0.0


def _hardware(device: torch.device) -> Hardware:
    # Kernels are validated against the device we train on (train.device=cpu on a GPU machine: CPU kernels).
    hardware = detect_hardware()
    if hardware.device_type != device.type:
        hardware = Hardware(device_type=device.type, triton_interpret=hardware.triton_interpret)
    return hardware
