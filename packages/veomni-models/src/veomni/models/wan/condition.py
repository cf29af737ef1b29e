"""The frozen condition models of a Wan2.1 DiT, loaded from the diffusers checkpoint directory Wan ships, and
the flow-matching training inputs built from their outputs.

The pipeline directory's layout, its checks (`locate_wan_components`, raising `ConditionCheckpointError`) and the
random-weight builds for toy runs are in `veomni.models.wan.pipeline_dir`.

The models are plain modules on one device: frozen (``requires_grad_(False)``, ``eval()``), run under
``torch.no_grad``, never handed to FSDP. Every encoding equals the pipeline's: prompts as
``WanPipeline.encode_prompt`` (cleaned, tokenized to ``max_sequence_length``, embeddings past each prompt's
length zeroed), latents normalised as the pipelines do (``(z - latents_mean) / latents_std``), and for I2V the
first-frame condition of ``WanImageToVideoPipeline.prepare_latents`` (4 mask channels + the normalised latents
of the first frame followed by black frames) and its CLIP image embeddings (penultimate hidden state).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from veomni.models.diffusers.flow_matching import (
    FlowMatchingSchedule,
    add_noise,
    flow_matching_target,
    sample_timesteps,
    schedule_from_scheduler_config,
)
from veomni.models.wan.pipeline_dir import (
    ConditionCheckpointError,
    check_weight_files,
    locate_wan_components,
    random_condition_models,
)

__all__ = [
    "WanConditionConfig",
    "WanConditionModel",
    "flow_matching_inputs",
    "normalize_latents",
]


@dataclass(frozen=True)
class WanConditionConfig:
    """How the condition model encodes and noises a sample.

    Attributes:
        mode: ``"t2v"``, or ``"i2v"`` (Wan2.1 I2V: also the first-frame condition and CLIP image embeddings).
        max_sequence_length: prompt token length; the pipelines' ``__call__`` default is 512.
        latent_sample_mode: ``"sample"`` draws from the VAE posterior (the usual training choice), ``"mode"``
            takes its mean.
        prompt_dropout_prob: probability of replacing a sample's prompt embeddings by the empty prompt's
            (classifier-free guidance training); 0 disables it.
        shift: training timestep shift; ``None`` takes the scheduler config's (``shift`` / ``flow_shift``).
    """

    mode: Literal["t2v", "i2v"] = "t2v"
    max_sequence_length: int = 512
    latent_sample_mode: Literal["sample", "mode"] = "sample"
    prompt_dropout_prob: float = 0.0
    shift: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("t2v", "i2v"):
            raise ValueError(f"WanConditionConfig.mode must be 't2v' or 'i2v', got {self.mode!r}")
        if self.latent_sample_mode not in ("sample", "mode"):
            raise ValueError(
                f"WanConditionConfig.latent_sample_mode must be 'sample' or 'mode', got {self.latent_sample_mode!r}"
            )
        if not 0.0 <= self.prompt_dropout_prob <= 1.0:
            raise ValueError(
                f"WanConditionConfig.prompt_dropout_prob must be in [0, 1], got {self.prompt_dropout_prob}"
            )
        if self.max_sequence_length < 1:
            raise ValueError(
                f"WanConditionConfig.max_sequence_length must be >= 1, got {self.max_sequence_length}"
            )


def _freeze(module: nn.Module) -> nn.Module:
    module.requires_grad_(False)
    return module.eval()


def _latent_stats(vae_config: Mapping[str, object], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    z_dim = int(vae_config["z_dim"])
    mean = torch.tensor(vae_config["latents_mean"], dtype=torch.float32)
    std = torch.tensor(vae_config["latents_std"], dtype=torch.float32)
    if mean.shape != (z_dim,) or std.shape != (z_dim,):
        raise ValueError(
            f"VAE config latents_mean/latents_std must have z_dim={z_dim} entries, got {tuple(mean.shape)} and "
            f"{tuple(std.shape)}"
        )
    # The pipelines multiply by a float32 reciprocal cast to the latents' dtype; do the same for equal bits.
    return mean.view(1, z_dim, 1, 1, 1).to(dtype), (1.0 / std).view(1, z_dim, 1, 1, 1).to(dtype)


def normalize_latents(latents: torch.Tensor, vae_config: Mapping[str, object]) -> torch.Tensor:
    """``(latents - latents_mean) / latents_std`` per channel, as Wan's pipelines normalise VAE latents.

    Args:
        latents: ``[B, z_dim, F, H, W]`` raw VAE latents.
        vae_config: the VAE config (``z_dim``, ``latents_mean``, ``latents_std``).
    """
    mean, inv_std = _latent_stats(vae_config, latents.dtype)
    return (latents - mean.to(latents.device)) * inv_std.to(latents.device)


def flow_matching_inputs(
    condition: Mapping[str, Sequence[torch.Tensor]],
    *,
    vae_config: Mapping[str, object],
    schedule: FlowMatchingSchedule,
    generator: torch.Generator,
    latent_sample_mode: Literal["sample", "mode"] = "sample",
    prompt_dropout_prob: float = 0.0,
    empty_prompt_embeds: torch.Tensor | None = None,
) -> dict[str, list[torch.Tensor]]:
    """Turn per-sample conditions into the transformer's training inputs (no text encoder or VAE needed, so the
    offline path can call it on stored conditions).

    Per sample, in this order from ``generator``: a uniform draw for prompt dropout, the timestep index, the VAE
    posterior noise (``latent_sample_mode="sample"``), the flow noise.

    Args:
        condition: lists with one tensor per sample: ``latent_params`` ``[1, 2*z_dim, F, H, W]`` (the VAE
            posterior's mean and log-variance), ``prompt_embeds`` ``[1, L, D]``; for I2V also
            ``image_condition`` ``[1, 4 + z_dim, F, H, W]`` and optionally ``image_embeds`` ``[1, T, D_img]``.
        vae_config: the VAE config, for ``latents_mean`` / ``latents_std``.
        schedule: the timestep table.
        generator: the DP-rank generator (`veomni.models.diffusers.flow_matching.dp_generator`).
        prompt_dropout_prob: probability of using ``empty_prompt_embeds`` ``[1, L, D]`` instead of the prompt.
    Returns:
        lists, one tensor per sample, keyed by the ``WanTransformer3DModel.forward`` argument they feed:
        ``hidden_states`` ``[1, C, F, H, W]`` (I2V: the noisy latents concatenated with ``image_condition`` on
        channels), ``timestep`` float32 ``[1]``, ``encoder_hidden_states``, ``encoder_hidden_states_image`` (when
        given), plus ``latents`` (normalised, clean) and ``training_target`` ``[1, z_dim, F, H, W]``.
    """
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    if latent_sample_mode not in ("sample", "mode"):
        raise ValueError(f"latent_sample_mode must be 'sample' or 'mode', got {latent_sample_mode!r}")
    for key in ("latent_params", "prompt_embeds"):
        if key not in condition:
            raise KeyError(f"condition lacks {key!r}; it has {sorted(condition)}")
    n = len(condition["latent_params"])
    for key, values in condition.items():
        if len(values) != n:
            raise ValueError(
                f"condition[{key!r}] has {len(values)} samples, condition['latent_params'] has {n}"
            )
    if prompt_dropout_prob > 0 and empty_prompt_embeds is None:
        raise ValueError("prompt_dropout_prob > 0 needs empty_prompt_embeds (the empty prompt's embeddings)")

    out: dict[str, list[torch.Tensor]] = {
        "hidden_states": [],
        "timestep": [],
        "encoder_hidden_states": [],
        "latents": [],
        "training_target": [],
    }
    for i in range(n):
        params = condition["latent_params"][i]
        prompt = condition["prompt_embeds"][i]
        if params.dim() != 5 or params.shape[0] != 1:
            raise ValueError(f"latent_params[{i}] must be [1, 2*z_dim, F, H, W], got {tuple(params.shape)}")
        drop = torch.rand((), generator=generator, device=generator.device).item() < prompt_dropout_prob
        if drop:
            prompt = empty_prompt_embeds.to(device=prompt.device, dtype=prompt.dtype)
        timestep, sigma = sample_timesteps(1, schedule, generator)
        posterior = DiagonalGaussianDistribution(params)
        raw = posterior.sample(generator) if latent_sample_mode == "sample" else posterior.mode()
        latents = normalize_latents(raw, vae_config)
        noise = torch.randn(latents.shape, generator=generator, device=generator.device, dtype=torch.float32)
        noise = noise.to(device=latents.device, dtype=latents.dtype)
        noisy = add_noise(latents, noise, sigma)
        if "image_condition" in condition:
            noisy = torch.cat([noisy, condition["image_condition"][i].to(noisy)], dim=1)
        out["hidden_states"].append(noisy)
        out["timestep"].append(timestep.to(latents.device))
        out["encoder_hidden_states"].append(prompt)
        out["latents"].append(latents)
        out["training_target"].append(flow_matching_target(latents, noise))
    if "image_embeds" in condition:
        out["encoder_hidden_states_image"] = list(condition["image_embeds"])
    return out


class WanConditionModel:
    """Wan2.1's frozen condition models (UMT5, AutoencoderKLWan, and for I2V CLIP vision) plus the training
    schedule. Not an ``nn.Module`` on purpose: nothing here may reach an optimizer, FSDP or a state dict.

    Use `from_pretrained` on the pipeline directory, then per batch ``get_condition`` (the expensive, cacheable
    encodings) and ``process_condition`` (the random part of a training step).
    """

    def __init__(
        self,
        *,
        tokenizer,
        text_encoder: nn.Module,
        vae: nn.Module,
        schedule: FlowMatchingSchedule,
        config: WanConditionConfig = WanConditionConfig(),
        image_encoder: nn.Module | None = None,
        image_processor=None,
    ) -> None:
        if config.mode == "i2v" and (image_encoder is None or image_processor is None):
            raise ValueError("WanConditionConfig(mode='i2v') needs image_encoder and image_processor (CLIP)")
        self.tokenizer = tokenizer
        self.text_encoder = _freeze(text_encoder)
        self.vae = _freeze(vae)
        self.image_encoder = None if image_encoder is None else _freeze(image_encoder)
        self.image_processor = image_processor
        self.schedule = schedule
        self.config = config
        self._empty_prompt_embeds: torch.Tensor | None = None

    @classmethod
    def from_pretrained(
        cls,
        root: str | Path,
        config: WanConditionConfig = WanConditionConfig(),
        *,
        device: torch.device | str = "cpu",
        text_encoder_dtype: torch.dtype = torch.float32,
        vae_dtype: torch.dtype = torch.float32,
        init: Literal["pretrained", "random"] = "pretrained",
        seed: int = 0,
    ) -> WanConditionModel:
        """Load the condition components from a Wan diffusers pipeline directory (`locate_wan_components`).

        The VAE stays in float32 by default, as the pipelines' examples load it; the text encoder's dtype is the
        embeddings' dtype. ``init="random"`` builds the text encoder, VAE (and CLIP) from their configs alone,
        with random weights drawn from a generator seeded by ``seed`` (toy runs and tests; the global RNG is left
        as it was); ``"pretrained"`` requires their weight files and names any that are missing.
        """
        from diffusers import AutoencoderKLWan
        from transformers import AutoTokenizer, UMT5EncoderModel

        if init not in ("pretrained", "random"):
            raise ValueError(f"init must be 'pretrained' or 'random', got {init!r}")
        parts = locate_wan_components(root, config.mode)
        if init == "pretrained":
            check_weight_files(parts)
        te_type = json.loads((parts["text_encoder"] / "config.json").read_text()).get("model_type")
        if te_type != "umt5":
            raise ConditionCheckpointError(
                f"{parts['text_encoder'] / 'config.json'}: model_type {te_type!r}, expected 'umt5' (Wan's text encoder)"
            )
        vae_class = json.loads((parts["vae"] / "config.json").read_text()).get("_class_name")
        if vae_class != "AutoencoderKLWan":
            raise ConditionCheckpointError(
                f"{parts['vae'] / 'config.json'}: _class_name {vae_class!r}, expected 'AutoencoderKLWan'"
            )
        scheduler_file = parts["scheduler"] / "scheduler_config.json"
        schedule = schedule_from_scheduler_config(
            json.loads(scheduler_file.read_text()), source=str(scheduler_file), shift=config.shift
        )
        image_encoder = image_processor = None
        if init == "random":
            text_encoder, vae, image_encoder = random_condition_models(parts, config.mode, seed)
            text_encoder, vae = text_encoder.to(device, text_encoder_dtype), vae.to(device)
            if vae_dtype != torch.float32:
                vae = vae.to(vae_dtype)
        else:
            text_encoder = UMT5EncoderModel.from_pretrained(parts["text_encoder"], dtype=text_encoder_dtype)
            vae = AutoencoderKLWan.from_pretrained(parts["vae"], torch_dtype=vae_dtype).to(device)
            text_encoder = text_encoder.to(device)
        if config.mode == "i2v":
            from transformers import CLIPImageProcessor, CLIPVisionModel

            if image_encoder is None:
                image_encoder = CLIPVisionModel.from_pretrained(parts["image_encoder"], dtype=torch.float32)
            image_encoder = image_encoder.to(device)
            image_processor = CLIPImageProcessor.from_pretrained(parts["image_processor"])
        return cls(
            tokenizer=AutoTokenizer.from_pretrained(parts["tokenizer"]),
            text_encoder=text_encoder,
            vae=vae,
            schedule=schedule,
            config=config,
            image_encoder=image_encoder,
            image_processor=image_processor,
        )

    @property
    def device(self) -> torch.device:
        return next(self.text_encoder.parameters()).device

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> torch.Tensor:
        """``[B, max_sequence_length, d_model]`` in the text encoder's dtype, equal to
        ``WanPipeline.encode_prompt(prompts, do_classifier_free_guidance=False)``: rows past each prompt's token
        count (incl. EOS) are zero."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
            raise TypeError(f"prompts must be a sequence of str, got {type(prompts).__name__}")
        length = self.config.max_sequence_length
        tokens = self.tokenizer(
            [prompt_clean(p) for p in prompts],
            padding="max_length",
            max_length=length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        mask = tokens.attention_mask.to(self.device)
        hidden = self.text_encoder(tokens.input_ids.to(self.device), mask).last_hidden_state
        # Trimming to each prompt's length and zero-padding back (the pipeline's way) == zeroing masked rows.
        keep = torch.arange(length, device=self.device)[None, :] < mask.gt(0).sum(dim=1, keepdim=True)
        return torch.where(keep[..., None], hidden, torch.zeros((), dtype=hidden.dtype, device=hidden.device))

    def empty_prompt_embeds(self) -> torch.Tensor:
        """``[1, max_sequence_length, d_model]``: the empty prompt's embeddings (the pipelines' default negative
        prompt), used for prompt dropout; computed once."""
        if self._empty_prompt_embeds is None:
            self._empty_prompt_embeds = self.encode_prompts([""])
        return self._empty_prompt_embeds

    def _check_video(self, video: torch.Tensor, index: int) -> None:
        cfg = self.vae.config
        t, s = cfg.scale_factor_temporal, cfg.scale_factor_spatial
        if video.dim() != 4 or video.shape[0] != 3:
            raise ValueError(
                f"videos[{index}] must be [3, F, H, W] (RGB in [-1, 1]), got {tuple(video.shape)}"
            )
        _, frames, height, width = video.shape
        if (frames - 1) % t or height % s or width % s:
            raise ValueError(
                f"videos[{index}] has F={frames}, H={height}, W={width}; the Wan VAE needs F = 1 + {t}k and H, W "
                f"divisible by {s}"
            )

    @torch.no_grad()
    def encode_videos(self, videos: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per video ``[3, F, H, W]`` in [-1, 1]: the VAE posterior's parameters ``[1, 2*z_dim, F', H', W']``
        (mean then log-variance on channels; ``F' = (F-1)/4 + 1``, ``H' = H/8``), float32."""
        out = []
        for i, video in enumerate(videos):
            self._check_video(video, i)
            x = video[None].to(device=self.device, dtype=self.vae.dtype)
            out.append(self.vae.encode(x).latent_dist.parameters.float())
        return out

    @torch.no_grad()
    def encode_first_frames(self, videos: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """I2V condition per video, as ``WanImageToVideoPipeline.prepare_latents`` builds it from the first frame:
        ``[1, 4 + z_dim, F', H', W']`` float32 = 4 mask channels (1 on the first latent frame) + the normalised
        VAE mean of (first frame, then F-1 black frames)."""
        out = []
        for i, video in enumerate(videos):
            self._check_video(video, i)
            frames = video.shape[1]
            x = torch.cat([video[:, :1], video.new_zeros(3, frames - 1, *video.shape[2:])], dim=1)
            mean = self.vae.encode(x[None].to(device=self.device, dtype=self.vae.dtype)).latent_dist.mode()
            latents = normalize_latents(mean.float(), self.vae.config)
            mask = torch.zeros(
                1, self.vae.config.scale_factor_temporal, *latents.shape[2:], device=latents.device
            )
            mask[:, :, 0] = 1.0
            out.append(torch.cat([mask, latents], dim=1))
        return out

    @torch.no_grad()
    def encode_images(self, images: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """CLIP image embeddings ``[1, T, D]`` (penultimate hidden state, as the I2V pipeline's ``encode_image``)
        per image ``[3, H, W]`` in [-1, 1]; the image is quantised to uint8 first, like the PIL image the
        pipeline receives."""
        if self.image_encoder is None:
            raise ValueError("encode_images needs the CLIP image encoder (WanConditionConfig(mode='i2v'))")
        out = []
        for image in images:
            pixels = ((image.float() + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8).cpu()
            inputs = self.image_processor(images=pixels, return_tensors="pt").to(self.device)
            out.append(self.image_encoder(**inputs, output_hidden_states=True).hidden_states[-2])
        return out

    def get_condition(
        self, prompts: Sequence[str], videos: Sequence[torch.Tensor]
    ) -> dict[str, list[torch.Tensor]]:
        """The deterministic, cacheable encodings of a batch (what offline embedding stores).

        Args:
            prompts: one caption per sample.
            videos: one ``[3, F, H, W]`` clip in [-1, 1] per sample (an image is ``F = 1``).
        Returns:
            lists of per-sample tensors: ``prompt_embeds`` ``[1, L, D]``, ``latent_params``
            ``[1, 2*z_dim, F', H', W']``; for I2V also ``image_condition`` and ``image_embeds``.
        """
        if len(prompts) != len(videos):
            raise ValueError(f"get_condition: {len(prompts)} prompts but {len(videos)} videos")
        embeds = self.encode_prompts(prompts)
        condition = {"prompt_embeds": list(embeds.split(1)), "latent_params": self.encode_videos(videos)}
        if self.config.mode == "i2v":
            condition["image_condition"] = self.encode_first_frames(videos)
            condition["image_embeds"] = self.encode_images([v[:, 0] for v in videos])
        return condition

    def process_condition(
        self, condition: Mapping[str, Sequence[torch.Tensor]], generator: torch.Generator
    ) -> dict[str, list[torch.Tensor]]:
        """The random part of a step: `flow_matching_inputs` with this model's VAE stats, schedule and config."""
        return flow_matching_inputs(
            condition,
            vae_config=self.vae.config,
            schedule=self.schedule,
            generator=generator,
            latent_sample_mode=self.config.latent_sample_mode,
            prompt_dropout_prob=self.config.prompt_dropout_prob,
            empty_prompt_embeds=self.empty_prompt_embeds() if self.config.prompt_dropout_prob > 0 else None,
        )
