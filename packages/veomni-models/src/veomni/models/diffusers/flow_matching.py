"""Rectified-flow (flow-matching) training inputs for DiTs such as Wan2.1: the timestep schedule, timestep
sampling, noising and the velocity target, as plain tensor functions.

Convention (diffusers' ``FlowMatchEulerDiscreteScheduler`` used for training, which is also what VeOmni's
reference condition model does through ``scheduler.scale_noise``): the training table holds
``N = num_train_timesteps`` sigmas ``s_i = i / N`` for ``i = N..1``, each shifted as
``shift * s / (1 + (shift - 1) * s)``; the timestep fed to the transformer is ``sigma * N``. A training step
draws a table index uniformly per sample, and builds

    noisy  = sigma * noise + (1 - sigma) * latents      (== scheduler.scale_noise(latents, t, noise))
    target = noise - latents                            (the velocity the transformer predicts)

Randomness comes only from the ``torch.Generator`` passed in: seed one per data-parallel rank (`dp_generator`)
so that the ranks of one SP group, which are fed the same sample, draw the same timestep and noise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = [
    "FlowMatchingSchedule",
    "add_noise",
    "dp_generator",
    "flow_matching_target",
    "sample_timesteps",
    "schedule_from_scheduler_config",
]

# Scheduler classes whose config describes a flow-matching schedule, and the config key of their shift.
_SHIFT_KEYS = {
    "FlowMatchEulerDiscreteScheduler": "shift",
    "UniPCMultistepScheduler": "flow_shift",
    "DPMSolverMultistepScheduler": "flow_shift",
}
# FlowMatchEulerDiscreteScheduler options that change the training table away from the static shift above.
_UNSUPPORTED_FLOW_MATCH_OPTIONS = {
    "use_dynamic_shifting": False,
    "invert_sigmas": False,
    "shift_terminal": None,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
}


@dataclass(frozen=True)
class FlowMatchingSchedule:
    """The static flow-matching training table: ``num_train_timesteps`` sigmas shifted by ``shift``."""

    num_train_timesteps: int = 1000
    shift: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.num_train_timesteps, int) or self.num_train_timesteps < 1:
            raise ValueError(f"num_train_timesteps must be a positive int, got {self.num_train_timesteps!r}")
        if not (isinstance(self.shift, (int, float)) and math.isfinite(self.shift) and self.shift > 0):
            raise ValueError(f"shift must be a finite number > 0, got {self.shift!r}")

    def sigmas(self) -> torch.Tensor:
        """Float32 ``[num_train_timesteps]``, descending from 1: diffusers' training ``scheduler.sigmas``."""
        n = self.num_train_timesteps
        # Same float32 ops in the same order as the scheduler's __init__, so the table is bitwise equal.
        sigmas = torch.arange(n, 0, -1, dtype=torch.float32) / n
        return self.shift * sigmas / (1 + (self.shift - 1) * sigmas)

    def timesteps(self) -> torch.Tensor:
        """Float32 ``[num_train_timesteps]``: ``sigmas * num_train_timesteps`` (diffusers' ``scheduler.timesteps``)."""
        return self.sigmas() * self.num_train_timesteps


def schedule_from_scheduler_config(
    config: Mapping[str, object], source: str, shift: float | None = None
) -> FlowMatchingSchedule:
    """The training schedule a diffusers ``scheduler_config.json`` describes.

    Wan's diffusers checkpoints ship either ``FlowMatchEulerDiscreteScheduler`` (``shift``) or, for inference,
    ``UniPCMultistepScheduler`` with ``use_flow_sigmas`` (``flow_shift``); both give the same shifted table.

    Args:
        config: the parsed scheduler config (must hold ``_class_name``).
        source: where it was read from, for error messages.
        shift: overrides the config's shift (training often uses another shift than sampling).
    Raises:
        ValueError: an unknown scheduler class, a UniPC/DPM config without ``use_flow_sigmas``, or a
            FlowMatchEuler option (dynamic shifting, karras sigmas, ...) that changes the training table.
    """
    class_name = config.get("_class_name")
    if class_name not in _SHIFT_KEYS:
        raise ValueError(
            f"{source}: scheduler _class_name {class_name!r} is not a flow-matching scheduler; expected one of "
            f"{sorted(_SHIFT_KEYS)}"
        )
    if class_name == "FlowMatchEulerDiscreteScheduler":
        for key, default in _UNSUPPORTED_FLOW_MATCH_OPTIONS.items():
            if config.get(key, default) != default:
                raise ValueError(
                    f"{source}: {key}={config[key]!r} is not supported for training (expected {default!r}): "
                    "the flow-matching table would no longer be the static shifted one"
                )
    elif not config.get("use_flow_sigmas", False):
        raise ValueError(
            f"{source}: {class_name} without use_flow_sigmas=true is not a flow-matching schedule; Wan's "
            "checkpoints set it"
        )
    config_shift = config.get(_SHIFT_KEYS[class_name], 1.0)
    return FlowMatchingSchedule(
        num_train_timesteps=int(config.get("num_train_timesteps", 1000)),
        shift=float(config_shift if shift is None else shift),
    )


def dp_generator(seed: int, dp_rank: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded from ``(seed, dp_rank)``: distinct streams per data-parallel rank, and the same stream
    on every SP/TP rank sharing a DP rank (they are fed the same samples and must draw the same noise)."""
    if dp_rank < 0 or dp_rank >= 1 << 20:
        raise ValueError(f"dp_rank must be in [0, 2**20), got {dp_rank}")
    if seed < 0 or seed >= 1 << 40:
        raise ValueError(f"seed must be in [0, 2**40), got {seed}")
    return torch.Generator(device=device).manual_seed((seed << 20) | dp_rank)


def sample_timesteps(
    batch_size: int, schedule: FlowMatchingSchedule, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one training timestep per sample, uniformly over the schedule's table.

    Returns:
        ``(timesteps, sigmas)``, both float32 ``[batch_size]`` on the generator's device; ``timesteps`` are
        values of ``scheduler.timesteps`` (what the transformer's ``timestep`` argument takes) and ``sigmas``
        the matching ``scheduler.sigmas``.
    """
    index = torch.randint(
        0, schedule.num_train_timesteps, (batch_size,), generator=generator, device=generator.device
    )
    sigmas = schedule.sigmas().to(generator.device)[index]
    timesteps = schedule.timesteps().to(generator.device)[index]
    return timesteps, sigmas


def add_noise(latents: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """``sigma * noise + (1 - sigma) * latents``, sigma broadcast over all but the first (batch) dim.

    Args:
        latents: ``[B, ...]`` clean (normalised) latents.
        noise: same shape and dtype as ``latents``.
        sigmas: ``[B]``.
    Returns:
        ``[B, ...]`` in ``latents``' dtype, equal to diffusers' ``scale_noise`` for the matching timesteps.
    """
    if noise.shape != latents.shape:
        raise ValueError(f"noise shape {tuple(noise.shape)} != latents shape {tuple(latents.shape)}")
    if sigmas.shape != latents.shape[:1]:
        raise ValueError(
            f"sigmas must have shape [{latents.shape[0]}] (one per sample), got {tuple(sigmas.shape)}"
        )
    sigma = sigmas.to(device=latents.device, dtype=latents.dtype).view(-1, *([1] * (latents.dim() - 1)))
    return sigma * noise + (1.0 - sigma) * latents


def flow_matching_target(latents: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The velocity target ``noise - latents`` (``d noisy / d sigma``), same shape/dtype as ``latents``."""
    if noise.shape != latents.shape:
        raise ValueError(f"noise shape {tuple(noise.shape)} != latents shape {tuple(latents.shape)}")
    return noise - latents
