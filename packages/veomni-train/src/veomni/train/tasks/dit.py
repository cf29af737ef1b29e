"""The ``dit`` training task: a diffusers DiT (e.g. Wan2.1's ``WanTransformer3DModel``) trained by flow matching,
its inputs made online by its family's frozen condition models (`veomni.models.family.DiffusionRules`; Wan's:
`veomni.models.wan.condition.WanConditionModel`).

Per micro-batch (one ``(F, H, W)`` shape, `veomni.train.data.dit`): ``get_condition`` (prompt embeddings, VAE
posterior; I2V also first-frame latents and CLIP embeddings), then ``process_condition`` with a generator seeded
by the micro-batch's ``noise_seed``, then one transformer forward on the stacked samples. The condition models
are plain modules on the compute device: frozen, run under ``no_grad``, never handed to FSDP or the optimizer.

Loss: per-sample MSE between the predicted and the target velocity (mean over the sample's elements), summed
over the micro-batch and divided by the step's sample count over all DP ranks (``num_items``), so a step's loss
is the mean over its samples whatever the grad accumulation and DP size. Under Ulysses SP every rank of an SP
group computes the same full loss (Wan: `veomni.models.wan.sp`); it is divided by the SP size so that the loop's
sum over all ranks (logging) and FSDP's average over the world (gradients) both count it once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import torch
from torch import nn

from veomni.core.parallel_state import ParallelState
from veomni.train.data import Step

if TYPE_CHECKING:
    from veomni.models.diffusers.rules import WeightCounts

log = logging.getLogger(__name__)

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
    def from_counts(cls, counts: WeightCounts, text_len: int, image_len: int) -> DitFlops:
        """The FLOPs of a transformer whose weights its family counted (`DiffusionRules.weight_counts`), for
        ``text_len`` prompt tokens and ``image_len`` image-condition tokens per sample."""
        return cls(
            per_token=6.0 * counts.token,
            per_sample=6.0 * (counts.text * text_len + counts.image * image_len + counts.sample),
            layers=counts.layers, width=counts.width, text_len=text_len, image_len=image_len if counts.image else 0,
        )  # fmt: skip

    def sample(self, tokens: int) -> float:
        """FLOPs of one training sample of ``tokens`` transformer tokens."""
        attention = 12.0 * self.layers * self.width * tokens * (tokens + self.text_len + self.image_len)
        return self.per_token * tokens + self.per_sample + attention


@attrs.frozen(kw_only=True, eq=False)
class DitTask:
    """Flow-matching training of a diffusion transformer (see the module docstring).

    Attributes:
        encoder: the family's frozen condition models on the compute device (online; Wan: `WanConditionModel`),
            or None when the batches carry their conditions (``data.kind: dit_latents``, written by
            ``veomni-dit-embed``).
        vae_config: the VAE config (``z_dim``, ``latents_mean``, ``latents_std``).
        schedule: the flow-matching `FlowMatchingSchedule`.
        noising: the family's condition config (Wan: `WanConditionConfig`: posterior sampling mode, prompt
            dropout).
        empty_prompt: ``[1, L, D]`` embeddings of the empty prompt (prompt dropout), or None without dropout.
        compute_dtype: dtype of the transformer's inputs (its parameters' compute dtype).
        sp: Ulysses SP degree (the loss is divided by it).
        flops: `DitFlops` of the transformer.
        make_inputs: the family's `DiffusionRules.flow_matching_inputs`: conditions -> the transformer's noised
            inputs and the velocity target, per sample.
    """

    encoder: Any
    vae_config: Any
    schedule: Any
    noising: Any
    empty_prompt: torch.Tensor | None
    compute_dtype: torch.dtype
    sp: int
    flops: DitFlops
    make_inputs: Callable[..., dict[str, list[torch.Tensor]]]
    name: ClassVar[str] = "dit"
    model_task: ClassVar[str] = "diffusion_transformer"
    aux_loss_coef: ClassVar[float] = 0.0
    data_kinds: ClassVar[tuple[str, ...]] = ("dit", "dit_latents")

    @classmethod
    def prepare(cls, recipe: Any, state: Any, device: torch.device) -> Any:
        """The run's `veomni.train.tasks.TaskSetup` (`veomni.train.tasks.dit_setup.dit_setup`)."""
        from veomni.train.tasks.dit_setup import dit_setup

        return dit_setup(recipe, state, device)

    def _inputs(self, batch: dict[str, Any], device: torch.device) -> tuple[dict[str, Any], torch.Tensor]:
        generator = torch.Generator().manual_seed(int(batch["noise_seed"]))
        condition = batch.get("condition")
        if condition is None:
            condition = self.encoder.get_condition(batch["captions"], batch["videos"])
        else:  # stored conditions: noised where the online path noises them, on the compute device
            condition = {k: [t.to(device) for t in v] for k, v in condition.items()}
        made = self.make_inputs(
            condition, vae_config=self.vae_config, schedule=self.schedule, generator=generator,
            latent_sample_mode=self.noising.latent_sample_mode, prompt_dropout_prob=self.noising.prompt_dropout_prob,
            empty_prompt_embeds=self.empty_prompt,
        )  # fmt: skip
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
        ``config.json``): the diffusers class's ``from_pretrained(out)`` loads it, as a pipeline's
        ``transformer/`` subfolder does."""
        from veomni.models.diffusers.export import export_diffusers

        export_diffusers(model, out, parallel_state=parallel_state)

    def checkpoint_files(self, model: nn.Module, out: Path, tokenizer: Any) -> None:
        """The trained diffusers ``config.json`` (``model.config_overrides`` included), which the offline export
        (``veomni-export-hf step_N/dcp``, `veomni.models.diffusers.export.export_dcp_to_diffusers`) builds from."""
        from veomni.models.diffusers.export import save_diffusers_config

        save_diffusers_config(model, out)

    def step_flops(self, step: Step) -> float:
        return sum(self.flops.sample(s) for s in step.sample_tokens)


__all__ = ["DitFlops", "DitOutput", "DitTask"]
