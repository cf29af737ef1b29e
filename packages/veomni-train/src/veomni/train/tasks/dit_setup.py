"""What the dit task prepares before the model is built (`veomni.train.tasks.dit.DitTask.prepare`): the diffusers
transformer config and its meta probe, the condition side, the data, the `veomni.train.tasks.dit.DitTask`.

Everything model-specific is asked of the transformer's family (`veomni.models.family.DiffusionRules`, found by
the config's ``_class_name``): its condition models and config, how its condition directory is read, what its
transformer config must match, how its training inputs are made. A diffusers model no family declares rules for
is refused, naming the ones veomni has.

Online (``data.kind: dit``) the frozen condition models are loaded on the compute device. Offline
(``data.kind: dit_latents``, files written by ``veomni-dit-embed``) only the condition directory's configs are
read (VAE statistics, schedule, model widths) plus the stored empty-prompt embeddings: no text encoder or VAE
takes GPU memory. Everything that can be checked is checked here, before the model is built.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist

from veomni.core.parallel_state import ParallelState
from veomni.models.family import resolve
from veomni.train.data import DataTopology
from veomni.train.data.sources import RowSource
from veomni.train.model_setup import _hardware
from veomni.train.preflight import PreflightError, check_ops_backend, check_parallel_fit, check_trainable
from veomni.train.recipe import Recipe
from veomni.train.tasks.dit import DitFlops, DitTask

if TYPE_CHECKING:
    from veomni.models.diffusers.rules import ConditionConfigs
    from veomni.models.family import DiffusionRules

log = logging.getLogger(__name__)


def transformer_config(recipe: Recipe) -> Any:
    """The recipe's diffusers transformer config (`veomni.models.registry.DiffusersConfig`), or a
    `PreflightError` naming the file when it is a transformers checkpoint or a whole pipeline directory."""
    from veomni.models.diffusers.rules import diffusion_models
    from veomni.models.registry import MODELS, DiffusersConfig

    source = recipe.model.config if recipe.model.config is not None else recipe.model.weights
    path = Path(source)
    if (path / "model_index.json").is_file():
        raise PreflightError(
            f"{path} is a diffusers pipeline directory (model_index.json); model.task=dit takes the transformer "
            f"itself: set model.weights (or model.config) to {path / 'transformer'} and dit.condition to {path}"
        )
    try:
        config = MODELS.load_config(source, **recipe.model.config_overrides)
    except (ValueError, OSError) as err:
        raise PreflightError(
            f"model.task=dit: cannot read the transformer config from {source}: {err}"
        ) from None
    if not isinstance(config, DiffusersConfig):
        raise PreflightError(
            f"{source} is a transformers checkpoint (model_type {config.model_type!r}), but model.task=dit trains "
            "a diffusers DiT: expected a diffusers config.json with _class_name (a pipeline's transformer/ "
            f"subfolder; _class_name one of {sorted(diffusion_models())})"
        )
    return config


def dit_rules(config: Any) -> DiffusionRules:
    """The `veomni.models.family.DiffusionRules` of the transformer ``config``'s family, or a `PreflightError`
    naming its ``_class_name`` and the diffusion transformers veomni's families declare."""
    from veomni.models.diffusers.rules import diffusion_rules

    try:
        return diffusion_rules(config.class_name, f"model.task=dit ({config.source})")
    except ValueError as err:
        raise PreflightError(str(err)) from None


def with_condition_mode(recipe: Recipe, rules: DiffusionRules) -> Recipe:
    """``recipe`` with ``dit.mode`` resolved by the family (`DiffusionRules.condition_mode`: null takes its first
    mode), or a `PreflightError` listing the modes it trains. Everything after reads the resolved mode."""
    try:
        mode = rules.condition_mode(recipe.dit.mode)
    except ValueError as err:
        raise PreflightError(f"dit.mode: {err}") from None
    return attrs.evolve(recipe, dit=attrs.evolve(recipe.dit, mode=mode))


def noising_config(recipe: Recipe, rules: DiffusionRules) -> Any:
    """The recipe's condition config (the family's `DiffusionRules.condition_config`)."""
    d = recipe.dit
    return resolve(rules.condition_config)(
        mode=d.mode, max_sequence_length=d.max_sequence_length, latent_sample_mode=d.latent_sample_mode,
        prompt_dropout_prob=d.prompt_dropout_prob, shift=d.shift,
    )  # fmt: skip


def load_condition(recipe: Recipe, rules: DiffusionRules, device: torch.device) -> Any:
    """The frozen condition models of ``dit.condition`` on ``device`` (the family's
    `DiffusionRules.condition_model`; a missing component or weight file: a `PreflightError` naming it)."""
    d = recipe.dit
    condition_error = resolve(rules.condition_error)
    try:
        return resolve(rules.condition_model).from_pretrained(
            d.condition, noising_config(recipe, rules), device=device,
            text_encoder_dtype=getattr(torch, d.text_encoder_dtype), init=d.condition_init, seed=recipe.train.seed,
        )  # fmt: skip
    except condition_error as err:
        # Bad input, said by the message: the CLI prints it without a traceback.
        raise PreflightError(f"dit.condition: {err}") from None


def condition_configs(recipe: Recipe, rules: DiffusionRules) -> ConditionConfigs:
    """Read the condition side (`veomni.models.diffusers.rules.ConditionConfigs`) from ``dit.condition`` without
    building any model (a missing component: a `PreflightError` naming it)."""
    condition_error = resolve(rules.condition_error)
    try:
        return resolve(rules.condition_configs)(recipe.dit.condition, recipe.dit.mode, recipe.dit.shift)
    except condition_error as err:
        raise PreflightError(f"dit.condition: {err}") from None


# The compatibility keys that are recipe settings, not transformer config keys.
_RECIPE_KEYS = {"max_sequence_length": "dit.max_sequence_length"}


def check_compatible(config: Any, cond: ConditionConfigs, recipe: Recipe, rules: DiffusionRules) -> None:
    """The transformer's channels and context widths must be those the condition models produce (the family's
    `DiffusionRules.compatibility`)."""
    misfits = resolve(rules.compatibility)(
        config.values, cond, mode=recipe.dit.mode, max_sequence_length=recipe.dit.max_sequence_length
    )
    bad = [f"{_RECIPE_KEYS.get(m.key, m.key)}={m.found} (expected {m.expected}: {m.why})" for m in misfits]
    if bad:
        raise PreflightError(
            f"the transformer config {config.source} does not fit the condition models in {recipe.dit.condition}: "
            + "; ".join(bad)
        )


def shape_rule(config: Any, cond: ConditionConfigs) -> Any:
    """The `veomni.train.data.dit.ShapeRule` of this transformer and VAE."""
    from veomni.train.data.dit import ShapeRule

    return ShapeRule(
        temporal=cond.temporal_compression, spatial=cond.spatial_compression,
        patch=tuple(int(p) for p in config.values["patch_size"]),
    )  # fmt: skip


def _probe(recipe: Recipe, config: Any, sp: int) -> torch.nn.Module:
    from veomni.models.registry import MODELS

    cls = MODELS.model_class(config, "diffusion_transformer").cls
    with torch.device("meta"):
        probe = cls.from_config(dict(config.values))
    check_trainable(probe, recipe.model.freeze, recipe.optim.lr_multipliers)
    heads = int(config.values["num_attention_heads"])
    if heads % sp:
        raise PreflightError(
            f"parallel.sp={sp} does not divide the transformer's {heads} attention heads ({config.source})"
        )
    return probe


def dit_setup(recipe: Recipe, state: ParallelState, device: torch.device) -> Any:
    """The dit task's `veomni.train.tasks.TaskSetup`: the tokenizer (the condition's UMT5; None offline), the
    diffusers config, a meta probe, the task with its condition side, and the training data."""
    from veomni.train.data.dit import MEDIA_COLUMNS, DitData
    from veomni.train.dit_embed import check_latents, load_empty_prompt
    from veomni.train.tasks import TaskSetup

    # veomni's RMSNorm / rotary / attention kernels bound by the family's DiffusionRules.bind_kernels, blocks
    # compiled per ops.compile; validated for the training device like the text tasks' ops. backend=hf binds none
    # (diffusers' own processors), so ops must then stay unset.
    check_ops_backend(recipe)
    ops = recipe.ops.to_ops_config(hardware=_hardware(device))
    config = transformer_config(recipe)
    rules = dit_rules(config)
    recipe = with_condition_mode(recipe, rules)
    probe = _probe(recipe, config, state.dims.sp)
    # Ulysses SP is the family's DiffusionRules.sequence_parallel, applied by the diffusers build; the registry's
    # fast paths say whether it has one.
    from veomni.models.registry import MODELS

    fast_paths = MODELS.model_class(config, "diffusion_transformer").fast_paths
    check_parallel_fit(probe, fast_paths, backend=recipe.model.backend, sp=state.dims.sp, ep=state.dims.ep)
    cond = condition_configs(recipe, rules)
    check_compatible(config, cond, recipe, rules)
    offline = recipe.data.kind == "dit_latents"
    noising = noising_config(recipe, rules)
    if offline:
        check_latents(recipe)
        encoder, tokenizer = None, None
        empty = (
            load_empty_prompt(recipe.data.train_files[0], device) if noising.prompt_dropout_prob > 0 else None
        )
    else:
        encoder = load_condition(recipe, rules, device)
        tokenizer = encoder.tokenizer
        empty = encoder.empty_prompt_embeds() if noising.prompt_dropout_prob > 0 else None
    topology = DataTopology.from_parallel_state(state)
    data = recipe.data
    columns, optional = (["shard", "index", "shape", "caption"], ()) if offline else (["caption"], MEDIA_COLUMNS)
    train_data = DitData(
        RowSource(data.train_files, data.file_format, columns, optional), media_root=data.media_root, rule=shape_rule(config, cond),
        topology=topology, samples_per_micro_batch=recipe.train.samples_per_micro_batch,
        grad_accum=recipe.grad_accum(topology.dp_size), seed=recipe.train.seed, shuffle=data.shuffle,
        num_workers=data.num_workers, pin_memory=device.type == "cuda", latents=offline,
    )  # fmt: skip
    task = DitTask(
        encoder=encoder, vae_config=cond.vae, schedule=cond.schedule, noising=noising, empty_prompt=empty,
        compute_dtype=getattr(torch, recipe.model.dtype), sp=state.dims.sp,
        make_inputs=resolve(rules.flow_matching_inputs),
        flops=DitFlops.from_counts(
            resolve(rules.weight_counts)(probe), recipe.dit.max_sequence_length, cond.image_tokens
        ),
    )  # fmt: skip
    if dist.get_rank() == 0:
        log.info(
            "dit: %s from %s; conditions %s (%s, shift %s, mode %s)", config.class_name, config.source,
            "read from " + str(data.train_files[0]) if offline else "computed online from " + str(recipe.dit.condition),
            recipe.dit.condition_init, cond.schedule.shift, recipe.dit.mode,
        )  # fmt: skip
    return TaskSetup(
        tokenizer=tokenizer,
        config=config,
        probe=probe,
        ops=ops,
        task=task,
        train_data=train_data,
        eval_data=None,
    )
