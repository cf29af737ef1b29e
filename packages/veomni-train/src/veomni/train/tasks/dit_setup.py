"""What the dit task prepares before the model is built (`veomni.train.loop.SETUPS`): the diffusers transformer
config and its meta probe, the condition side, the data, the `veomni.train.tasks.dit.DitTask`.

Online (``data.kind: dit``) the frozen condition models are loaded on the compute device. Offline
(``data.kind: dit_latents``, files written by ``veomni-dit-embed``) only the condition directory's configs are
read (VAE statistics, schedule, model widths) plus the stored empty-prompt embeddings: no text encoder or VAE
takes GPU memory. Everything that can be checked is checked here, before the model is built.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist

from veomni.core.parallel_state import ParallelState
from veomni.train.data import DataTopology
from veomni.train.data.sources import RowSource
from veomni.train.model_setup import _hardware
from veomni.train.preflight import PreflightError, check_ops_backend, check_parallel_fit, check_trainable
from veomni.train.recipe import Recipe
from veomni.train.tasks.dit import DitFlops, DitTask

log = logging.getLogger(__name__)


def transformer_config(recipe: Recipe) -> Any:
    """The recipe's diffusers transformer config (`veomni.models.registry.DiffusersConfig`), or a
    `PreflightError` naming the file when it is a transformers checkpoint or a whole pipeline directory."""
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
            "a diffusers DiT: expected a diffusers config.json with _class_name (e.g. Wan's transformer/ "
            "subfolder, _class_name 'WanTransformer3DModel')"
        )
    return config


def noising_config(recipe: Recipe) -> Any:
    """The recipe's `veomni.models.dit_condition.WanConditionConfig`."""
    from veomni.models.dit_condition import WanConditionConfig

    d = recipe.dit
    return WanConditionConfig(
        mode=d.mode, max_sequence_length=d.max_sequence_length, latent_sample_mode=d.latent_sample_mode,
        prompt_dropout_prob=d.prompt_dropout_prob, shift=d.shift,
    )  # fmt: skip


def load_condition(recipe: Recipe, device: torch.device) -> Any:
    """The frozen `WanConditionModel` of ``dit.condition`` on ``device`` (a missing component or weight file: a
    `PreflightError` naming it)."""
    from veomni.models.dit_condition import WanConditionModel
    from veomni.models.wan_pipeline_dir import ConditionCheckpointError

    d = recipe.dit
    try:
        return WanConditionModel.from_pretrained(
            d.condition, noising_config(recipe), device=device, text_encoder_dtype=getattr(torch, d.text_encoder_dtype),
            init=d.condition_init, seed=recipe.train.seed,
        )  # fmt: skip
    except ConditionCheckpointError as err:
        # Bad input, said by the message: the CLI prints it without a traceback.
        raise PreflightError(f"dit.condition: {err}") from None


@attrs.frozen(kw_only=True)
class ConditionConfigs:
    """The condition side as configs: VAE config, schedule, text width, CLIP width and tokens (I2V)."""

    vae: Mapping[str, Any]
    schedule: Any
    text_dim: int
    image_dim: int | None
    image_tokens: int


def condition_configs(recipe: Recipe) -> ConditionConfigs:
    """Read `ConditionConfigs` from ``dit.condition`` without building any model (a missing component: a
    `PreflightError` naming it)."""
    from veomni.models.flow_matching import schedule_from_scheduler_config
    from veomni.models.wan_pipeline_dir import ConditionCheckpointError, locate_wan_components

    try:
        parts = locate_wan_components(recipe.dit.condition, recipe.dit.mode)
    except ConditionCheckpointError as err:
        raise PreflightError(f"dit.condition: {err}") from None

    def read(name: str, file: str = "config.json") -> dict[str, Any]:
        return json.loads((parts[name] / file).read_text())

    from diffusers import AutoencoderKLWan

    # The class's defaults fill what the file leaves out (older Wan configs lack the scale factors), as
    # from_config would.
    signature = inspect.signature(AutoencoderKLWan.__init__).parameters.items()
    vae = {k: v.default for k, v in signature if v.default is not inspect.Parameter.empty} | read("vae")
    scheduler_file = parts["scheduler"] / "scheduler_config.json"
    schedule = schedule_from_scheduler_config(
        read("scheduler", "scheduler_config.json"), source=str(scheduler_file), shift=recipe.dit.shift
    )
    image_dim, image_tokens = None, 0
    if recipe.dit.mode == "i2v":
        clip = read("image_encoder")
        clip = clip.get("vision_config", clip)
        image_dim = int(clip["hidden_size"])
        image_tokens = (int(clip["image_size"]) // int(clip["patch_size"])) ** 2 + 1
    return ConditionConfigs(
        vae=vae, schedule=schedule, text_dim=int(read("text_encoder")["d_model"]), image_dim=image_dim,
        image_tokens=image_tokens,
    )  # fmt: skip


def check_compatible(config: Any, cond: ConditionConfigs, recipe: Recipe) -> None:
    """The transformer's channels and context widths must be those the condition models produce."""
    values, z_dim = config.values, int(cond.vae["z_dim"])
    want_in = z_dim if recipe.dit.mode == "t2v" else 2 * z_dim + int(cond.vae["scale_factor_temporal"])
    checks = [
        (
            "in_channels",
            values.get("in_channels"),
            want_in,
            f"the VAE's z_dim {z_dim} (mode {recipe.dit.mode})",
        ),
        ("out_channels", values.get("out_channels"), z_dim, f"the VAE's z_dim {z_dim}"),
        ("text_dim", values.get("text_dim"), cond.text_dim, "the text encoder's d_model"),
    ]
    if cond.image_dim is not None:
        checks.append(
            ("image_dim", values.get("image_dim"), cond.image_dim, "the CLIP image encoder's hidden_size")
        )
    if values.get("added_kv_proj_dim") is not None:
        from veomni.models.wan_kernels import WAN_TEXT_CONTEXT_LEN

        # The image-conditioned cross-attention splits its context as [image tokens; the last 512 tokens as text]
        # (diffusers' WanAttnProcessor and ours): any other prompt length feeds CLIP tokens through the text
        # projections, or text tokens through the image ones, without an error.
        checks.append(
            (
                "dit.max_sequence_length",
                recipe.dit.max_sequence_length,
                WAN_TEXT_CONTEXT_LEN,
                "Wan's image-conditioned cross-attention takes the last 512 context tokens as the prompt",
            )
        )
    bad = [f"{k}={found} (expected {want}: {why})" for k, found, want, why in checks if found != want]
    if bad:
        raise PreflightError(
            f"the transformer config {config.source} does not fit the condition models in {recipe.dit.condition}: "
            + "; ".join(bad)
        )


def shape_rule(config: Any, cond: ConditionConfigs) -> Any:
    """The `veomni.train.data.dit.ShapeRule` of this transformer and VAE."""
    from veomni.train.data.dit import ShapeRule

    return ShapeRule(
        temporal=int(cond.vae["scale_factor_temporal"]), spatial=int(cond.vae["scale_factor_spatial"]),
        patch=tuple(int(p) for p in config.values["patch_size"]),
    )  # fmt: skip


def _probe(recipe: Recipe, config: Any, sp: int) -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    from veomni.models.registry import MODELS

    cls = MODELS.model_class(config, "diffusion_transformer").cls
    if not issubclass(cls, WanTransformer3DModel):
        raise PreflightError(
            f"model.task=dit trains Wan2.1 DiTs (WanTransformer3DModel) with Wan's condition models; {config.source} "
            f"is a {config.class_name!r}"
        )
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

    # veomni's RMSNorm / rotary / attention kernels bound to diffusers' Wan attention (veomni.models.wan_kernels),
    # blocks compiled per ops.compile; validated for the training device like the text tasks' ops. backend=hf
    # binds none (diffusers' own processors), so ops must then stay unset.
    check_ops_backend(recipe)
    ops = recipe.ops.to_ops_config(hardware=_hardware(device))
    config = transformer_config(recipe)
    probe = _probe(recipe, config, state.dims.sp)
    # Wan's Ulysses SP is applied by the diffusers build itself (veomni.models.wan_sp), not a registry fast path.
    check_parallel_fit(probe, ("sp",), backend=recipe.model.backend, sp=state.dims.sp, ep=state.dims.ep)
    cond = condition_configs(recipe)
    check_compatible(config, cond, recipe)
    offline = recipe.data.kind == "dit_latents"
    noising = noising_config(recipe)
    if offline:
        check_latents(recipe)
        encoder, tokenizer = None, None
        empty = (
            load_empty_prompt(recipe.data.train_files[0], device) if noising.prompt_dropout_prob > 0 else None
        )
    else:
        encoder = load_condition(recipe, device)
        tokenizer = encoder.tokenizer
        empty = encoder.empty_prompt_embeds() if noising.prompt_dropout_prob > 0 else None
    topology = DataTopology.from_parallel_state(state)
    data = recipe.data
    columns, optional = (["shard", "index", "shape", "caption"], ()) if offline else (["caption"], MEDIA_COLUMNS)
    train_data = DitData(
        RowSource(data.train_files, data.format, columns, optional), media_root=data.media_root, rule=shape_rule(config, cond),
        topology=topology, samples_per_micro_batch=recipe.train.samples_per_micro_batch,
        grad_accum=recipe.grad_accum(topology.dp_size), seed=recipe.train.seed, shuffle=data.shuffle,
        num_workers=data.num_workers, pin_memory=device.type == "cuda", latents=offline,
    )  # fmt: skip
    task = DitTask(
        encoder=encoder, vae_config=cond.vae, schedule=cond.schedule, noising=noising, empty_prompt=empty,
        compute_dtype=getattr(torch, recipe.model.dtype), sp=state.dims.sp,
        flops=DitFlops.for_model(probe, recipe.dit.max_sequence_length, cond.image_tokens),
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
