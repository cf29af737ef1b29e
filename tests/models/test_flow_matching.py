"""Flow-matching training pieces against diffusers' FlowMatchEulerDiscreteScheduler: the shifted sigma/timestep
table, ``scale_noise`` for the same timesteps, the noisy/target identity, scheduler-config parsing and seeded
sampling."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler
from hypothesis import given, settings
from hypothesis import strategies as st

from veomni.models.diffusers.flow_matching import (
    FlowMatchingSchedule,
    add_noise,
    dp_generator,
    flow_matching_target,
    sample_timesteps,
    schedule_from_scheduler_config,
)

EXAMPLES = settings(max_examples=30, deadline=None)


def saved_config(scheduler) -> dict:
    """What ``scheduler_config.json`` holds (``_class_name`` included)."""
    return json.loads(scheduler.to_json_string())


@EXAMPLES
@given(n=st.integers(1, 1200), shift=st.floats(0.1, 20.0, allow_nan=False))
def test_table_equals_scheduler_sigmas_and_timesteps(n: int, shift: float) -> None:
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=n, shift=shift)
    schedule = FlowMatchingSchedule(num_train_timesteps=n, shift=shift)
    assert torch.equal(schedule.sigmas(), scheduler.sigmas)
    assert torch.equal(schedule.timesteps(), scheduler.timesteps)


@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0])
def test_add_noise_equals_scale_noise(shift: float) -> None:
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    schedule = FlowMatchingSchedule(1000, shift)
    g = torch.Generator().manual_seed(0)
    timesteps, sigmas = sample_timesteps(6, schedule, g)
    latents = torch.randn(6, 4, 3, 5, 7, generator=g)
    noise = torch.randn(6, 4, 3, 5, 7, generator=g)
    expected = scheduler.scale_noise(latents, timesteps, noise)
    assert torch.equal(add_noise(latents, noise, sigmas), expected)
    # The sampled timesteps are entries of the scheduler's table and sigma matches its row.
    index = [scheduler.index_for_timestep(t, scheduler.timesteps) for t in timesteps]
    assert torch.equal(scheduler.sigmas[index], sigmas)


@EXAMPLES
@given(
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    batch=st.integers(1, 3),
    seed=st.integers(0, 2**31),
)
def test_flow_matching_identity(shape: list[int], batch: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(batch, *shape, generator=g, dtype=torch.float64)
    noise = torch.randn(batch, *shape, generator=g, dtype=torch.float64)
    sigmas = torch.rand(batch, generator=g, dtype=torch.float64).requires_grad_(True)
    noisy = add_noise(latents, noise, sigmas)
    target = flow_matching_target(latents, noise)
    assert torch.equal(target, noise - latents)
    torch.testing.assert_close(
        noisy, latents + sigmas.view(-1, *[1] * len(shape)) * target, rtol=0, atol=1e-12
    )
    # The target is the velocity d(noisy)/d(sigma), per sample.
    (grad,) = torch.autograd.grad(noisy.sum(), sigmas)
    torch.testing.assert_close(grad, target.flatten(1).sum(1), rtol=1e-12, atol=1e-12)
    # Endpoints are exact: sigma 0 is the data, sigma 1 the noise.
    assert torch.equal(add_noise(latents, noise, torch.zeros(batch, dtype=torch.float64)), latents)
    assert torch.equal(add_noise(latents, noise, torch.ones(batch, dtype=torch.float64)), noise)


def test_shape_errors() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="noise shape"):
        add_noise(x, torch.zeros(2, 4), torch.zeros(2))
    with pytest.raises(ValueError, match="one per sample"):
        add_noise(x, x, torch.zeros(3))
    with pytest.raises(ValueError, match="noise shape"):
        flow_matching_target(x, torch.zeros(3, 3))
    with pytest.raises(ValueError, match="shift must be"):
        FlowMatchingSchedule(1000, 0.0)
    with pytest.raises(ValueError, match="num_train_timesteps"):
        FlowMatchingSchedule(0, 1.0)


def test_schedule_from_scheduler_configs() -> None:
    euler = saved_config(FlowMatchEulerDiscreteScheduler(num_train_timesteps=500, shift=3.0))
    assert schedule_from_scheduler_config(euler, "euler") == FlowMatchingSchedule(500, 3.0)
    assert schedule_from_scheduler_config(euler, "euler", shift=5.0) == FlowMatchingSchedule(500, 5.0)
    # Wan's diffusers repos ship UniPC with flow sigmas for inference; its flow_shift is the same shift.
    unipc = saved_config(
        UniPCMultistepScheduler(use_flow_sigmas=True, flow_shift=3.0, prediction_type="flow_prediction")
    )
    assert schedule_from_scheduler_config(unipc, "unipc") == FlowMatchingSchedule(1000, 3.0)
    with pytest.raises(ValueError, match="use_flow_sigmas"):
        schedule_from_scheduler_config(saved_config(UniPCMultistepScheduler()), "plain-unipc")
    dynamic = saved_config(FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True))
    with pytest.raises(ValueError, match="use_dynamic_shifting"):
        schedule_from_scheduler_config(dynamic, "dyn")
    with pytest.raises(ValueError, match="'DDPMScheduler' is not a flow-matching scheduler"):
        schedule_from_scheduler_config({"_class_name": "DDPMScheduler"}, "ddpm")


def test_seeded_sampling_is_deterministic_per_dp_rank() -> None:
    schedule = FlowMatchingSchedule(1000, 3.0)
    a = sample_timesteps(64, schedule, dp_generator(7, 0))
    b = sample_timesteps(64, schedule, dp_generator(7, 0))
    c = sample_timesteps(64, schedule, dp_generator(7, 1))
    d = sample_timesteps(64, schedule, dp_generator(8, 0))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    assert not torch.equal(a[0], d[0])
    assert a[0].dtype == torch.float32 and a[0].shape == (64,)
    with pytest.raises(ValueError, match="dp_rank"):
        dp_generator(0, -1)
