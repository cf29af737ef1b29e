"""The ``dit`` training task: a diffusers DiT (Wan2.1 ``WanTransformer3DModel``) trained by flow matching, its
inputs made online by the frozen Wan condition models (`veomni.models.dit_condition.WanConditionModel`).

Per micro-batch (one ``(F, H, W)`` shape, `veomni.train.data.dit`): ``get_condition`` (prompt embeddings, VAE
posterior; I2V also first-frame latents and CLIP embeddings), then ``process_condition`` with a generator seeded
by the micro-batch's ``noise_seed``, then one transformer forward on the stacked samples. The condition models
are plain modules on the compute device: frozen, run under ``no_grad``, never handed to FSDP or the optimizer.

Loss: per-sample MSE between the predicted and the target velocity (mean over the sample's elements), summed
over the micro-batch and divided by the step's sample count over all DP ranks (``num_items``), so a step's loss
is the mean over its samples whatever the grad accumulation and DP size. Under Ulysses SP every rank of an SP
group computes the same full loss (`veomni.models.wan_sp`); it is divided by the SP size so that the loop's
sum over all ranks (logging) and FSDP's average over the world (gradients) both count it once.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, ClassVar

import attrs
import torch
import torch.distributed as dist
from torch import nn

from veomni.core.parallel_state import ParallelState
from veomni.train.data import DataTopology, Step
from veomni.train.data.sources import DataError, RowSource
from veomni.train.preflight import PreflightError, check_trainable
from veomni.train.recipe import Recipe

log = logging.getLogger(__name__)

# Parameters (name fragments) that multiply context tokens rather than video tokens, or run once per sample.
_TEXT_PARAMS = ("condition_embedder.text_embedder.", ".attn2.to_k.", ".attn2.to_v.", ".attn2.to_kv.")
_IMAGE_PARAMS = ("condition_embedder.image_embedder.", ".attn2.add_k_proj.", ".attn2.add_v_proj.",
                 ".attn2.to_added_kv.")  # fmt: skip
_SAMPLE_PARAMS = ("condition_embedder.time_embedder.", "condition_embedder.time_proj.")
_INPUT_KEYS = ("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image")


@attrs.frozen
class DitOutput:
    """One micro-batch's result: ``loss`` (0-d, this rank's share of the step loss, see the module docstring)
    and ``per_sample`` (``[B]`` float32 MSE, detached)."""

    loss: torch.Tensor
    per_sample: torch.Tensor


@attrs.frozen(kw_only=True)
class DitFlops:
    """Training FLOPs of one sample of ``S`` transformer tokens (6x the forward's matmuls, attention included):
    ``per_token * S + per_sample + 12 * layers * width * S * (S + text_len + image_len)``.

    Attributes:
        per_token: ``6 *`` weights multiplying each video token (patch embedding, blocks, ``proj_out``).
        per_sample: ``6 *`` (text weights ``* text_len`` + image weights ``* image_len`` + timestep weights).
        layers, width: blocks and ``heads * head_dim`` (attention score and value FLOPs).
        text_len, image_len: context tokens of the cross-attention (text: the prompt length; image: CLIP's).
    """

    per_token: float
    per_sample: float
    layers: int
    width: int
    text_len: int
    image_len: int

    @classmethod
    def for_model(cls, probe: nn.Module, text_len: int, image_len: int) -> DitFlops:
        token = text = image = sample = 0
        for name, param in probe.named_parameters():
            if param.dim() < 2 or "scale_shift_table" in name:
                continue
            dotted = f".{name}"
            if any(k in dotted or name.startswith(k) for k in _TEXT_PARAMS):
                text += param.numel()
            elif any(k in dotted or name.startswith(k) for k in _IMAGE_PARAMS):
                image += param.numel()
            elif any(name.startswith(k) for k in _SAMPLE_PARAMS):
                sample += param.numel()
            else:
                token += param.numel()
        config = probe.config
        return cls(
            per_token=6.0 * token, per_sample=6.0 * (text * text_len + image * image_len + sample),
            layers=int(config.num_layers), width=int(config.num_attention_heads * config.attention_head_dim),
            text_len=text_len, image_len=image_len if image else 0,
        )  # fmt: skip

    def sample(self, tokens: int) -> float:
        """FLOPs of one training sample of ``tokens`` transformer tokens."""
        attention = 12.0 * self.layers * self.width * tokens * (tokens + self.text_len + self.image_len)
        return self.per_token * tokens + self.per_sample + attention


@attrs.frozen(kw_only=True, eq=False)
class DitTask:
    """Flow-matching training of a Wan DiT (see the module docstring).

    Attributes:
        condition: the frozen `WanConditionModel` (on the compute device).
        compute_dtype: dtype of the transformer's inputs (its parameters' compute dtype).
        sp: Ulysses SP degree (the loss is divided by it).
        flops: `DitFlops` of the transformer.
    """

    condition: Any
    compute_dtype: torch.dtype
    sp: int
    flops: DitFlops
    name: ClassVar[str] = "dit"
    model_task: ClassVar[str] = "diffusion_transformer"
    aux_loss_coef: ClassVar[float] = 0.0

    def _inputs(self, batch: dict[str, Any], device: torch.device) -> tuple[dict[str, Any], torch.Tensor]:
        generator = torch.Generator().manual_seed(int(batch["noise_seed"]))
        condition = batch.get("condition")
        if condition is None:
            condition = self.condition.get_condition(batch["captions"], batch["videos"])
        made = self.condition.process_condition(condition, generator)
        target = torch.cat(made["training_target"]).to(device)
        kwargs: dict[str, Any] = {"return_dict": False}
        for key in _INPUT_KEYS:
            if key in made:
                value = torch.cat(made[key]).to(device)
                kwargs[key] = value if key == "timestep" else value.to(self.compute_dtype)
        return kwargs, target

    def model_kwargs(
        self, batch: dict[str, Any], device: torch.device, num_items: torch.Tensor
    ) -> dict[str, Any]:
        """The transformer's keyword arguments for one micro-batch (conditioning and noising included):
        ``hidden_states`` ``[B, C, F', H', W']``, ``timestep`` float32 ``[B]``, ``encoder_hidden_states``
        ``[B, L, D]`` (and ``encoder_hidden_states_image`` for I2V), ``return_dict=False``."""
        return self._inputs(batch, device)[0]

    def forward(
        self, model: nn.Module, batch: dict[str, Any], device: torch.device, num_items: torch.Tensor
    ) -> DitOutput:
        """Condition, noise and run ``model`` on one micro-batch; ``num_items`` is the step's sample count."""
        kwargs, target = self._inputs(batch, device)
        prediction = model(**kwargs)[0]
        if prediction.shape != target.shape:
            raise ValueError(
                f"the transformer predicts {tuple(prediction.shape)} but the flow-matching target is "
                f"{tuple(target.shape)}: its out_channels must be the VAE's z_dim"
            )
        per_sample = (prediction.float() - target.float()).pow(2).flatten(1).mean(dim=1)
        return DitOutput(loss=per_sample.sum() / num_items / self.sp, per_sample=per_sample.detach())

    def trained_tokens(self, batch: dict[str, Any]) -> torch.Tensor:
        """Samples in the micro-batch (the loss is a mean over samples)."""
        return torch.tensor(len(batch["rows"]))

    def loss(self, outputs: DitOutput, aux_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        return outputs.loss, outputs.loss

    def export(self, model: nn.Module, out: Path, tokenizer: Any, parallel_state: ParallelState) -> None:
        """The transformer as diffusers writes it (``diffusion_pytorch_model*.safetensors`` and a pure diffusers
        ``config.json``): ``WanTransformer3DModel.from_pretrained(out)`` loads it, as a pipeline's
        ``transformer/`` subfolder does."""
        from veomni.models.export_diffusers import export_diffusers

        export_diffusers(model, out, parallel_state=parallel_state)

    def step_flops(self, step: Step) -> float:
        return sum(self.flops.sample(s) for s in getattr(step, "sample_tokens", ()))


# ---------------------------------------------------------------- setup


def _diffusers_config(recipe: Recipe) -> Any:
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


def _check_compatible(config: Any, condition: Any, recipe: Recipe) -> None:
    values, vae = config.values, condition.vae.config
    z_dim = int(vae.z_dim)
    want_in = z_dim if recipe.dit.mode == "t2v" else 2 * z_dim + int(vae.scale_factor_temporal)
    checks = [
        (
            "in_channels",
            values.get("in_channels"),
            want_in,
            f"the VAE's z_dim {z_dim} (mode {recipe.dit.mode})",
        ),
        ("out_channels", values.get("out_channels"), z_dim, f"the VAE's z_dim {z_dim}"),
        (
            "text_dim",
            values.get("text_dim"),
            int(condition.text_encoder.config.d_model),
            "the text encoder's d_model",
        ),
    ]
    if recipe.dit.mode == "i2v":
        clip = int(condition.image_encoder.config.hidden_size)
        checks.append(("image_dim", values.get("image_dim"), clip, "the CLIP image encoder's hidden_size"))
    bad = [f"{k}={found} (expected {want}: {why})" for k, found, want, why in checks if found != want]
    if bad:
        raise PreflightError(
            f"the transformer config {config.source} does not fit the condition models in {recipe.dit.condition}: "
            + "; ".join(bad)
        )


def _image_tokens(condition: Any) -> int:
    if condition.image_encoder is None:
        return 0
    c = condition.image_encoder.config
    return (int(c.image_size) // int(c.patch_size)) ** 2 + 1


def dit_setup(recipe: Recipe, state: ParallelState, device: torch.device) -> Any:
    """The dit task's `veomni.train.loop.TaskSetup`: the tokenizer (the condition's UMT5), the diffusers config,
    a meta probe, the task with its condition models, and the training data."""
    from diffusers import WanTransformer3DModel

    from veomni.models.dit_condition import ConditionCheckpointError, WanConditionConfig, WanConditionModel
    from veomni.models.registry import MODELS
    from veomni.train.data.dit import DitData, ShapeRule, parquet_columns
    from veomni.train.loop import TaskSetup

    chosen = {
        k: v for k, v in attrs.asdict(recipe.ops).items() if v is not None and (k, v) != ("compile", "auto")
    }
    if chosen:
        raise PreflightError(
            f"model.task=dit trains diffusers' own WanTransformer3DModel, to which veomni binds no kernels; ops sets "
            f"{chosen}: remove them"
        )
    config = _diffusers_config(recipe)
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
    if heads % state.dims.sp:
        raise PreflightError(
            f"parallel.sp={state.dims.sp} does not divide the transformer's {heads} attention heads ({config.source})"
        )
    dit = recipe.dit
    try:
        condition = WanConditionModel.from_pretrained(
            dit.condition,
            WanConditionConfig(
                mode=dit.mode, max_sequence_length=dit.max_sequence_length,
                latent_sample_mode=dit.latent_sample_mode, prompt_dropout_prob=dit.prompt_dropout_prob,
                shift=dit.shift,
            ),
            device=device, text_encoder_dtype=getattr(torch, dit.text_encoder_dtype), init=dit.condition_init,
            seed=recipe.train.seed,
        )  # fmt: skip
    except ConditionCheckpointError as err:
        # Bad input, said by the message: the CLI prints it without a traceback.
        raise PreflightError(f"dit.condition: {err}") from None
    _check_compatible(config, condition, recipe)
    vae = condition.vae.config
    rule = ShapeRule(
        temporal=int(vae.scale_factor_temporal), spatial=int(vae.scale_factor_spatial),
        patch=tuple(int(p) for p in config.values["patch_size"]),
    )  # fmt: skip
    topology = DataTopology.from_parallel_state(state)
    data = recipe.data
    source = RowSource(data.train_files, data.format, parquet_columns(data.train_files, data.format))
    train_data = DitData(
        source, media_root=data.media_root, rule=rule, topology=topology,
        samples_per_micro_batch=recipe.train.samples_per_micro_batch, grad_accum=recipe.grad_accum(topology.dp_size),
        seed=recipe.train.seed, shuffle=data.shuffle, num_workers=data.num_workers,
        pin_memory=device.type == "cuda",
    )  # fmt: skip
    task = DitTask(
        condition=condition, compute_dtype=getattr(torch, recipe.model.dtype), sp=state.dims.sp,
        flops=DitFlops.for_model(probe, dit.max_sequence_length, _image_tokens(condition)),
    )  # fmt: skip
    if dist.get_rank() == 0:
        log.info(
            "dit: %s from %s, condition models from %s (%s), %s", config.class_name, config.source, dit.condition,
            dit.condition_init, json.dumps({"shift": condition.schedule.shift, "mode": dit.mode}),
        )  # fmt: skip
    return TaskSetup(
        tokenizer=condition.tokenizer, config=config, probe=probe, ops=None, task=task, train_data=train_data,
        eval_data=None,
    )  # fmt: skip


__all__ = ["DataError", "DitFlops", "DitOutput", "DitTask", "dit_setup"]
