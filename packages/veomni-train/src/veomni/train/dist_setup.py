"""Distributed setup of a training run: the default process group, this rank's device, and the recipe's parallel
degrees on the world size (`veomni.train.loop.build_run` calls both first)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from veomni.core.parallel_dims import ParallelDims
from veomni.train.preflight import PreflightError
from veomni.train.recipe import Recipe


def setup_distributed(device_pref: str) -> torch.device:
    """Initialise the default process group (torchrun's env, or a one-process group) and pick this rank's device.

    Args:
        device_pref: ``auto`` (CUDA when available), ``cuda`` or ``cpu``.

    Raises:
        PreflightError: ``cuda`` where torch sees no CUDA device.
    """
    if device_pref == "cuda" and not torch.cuda.is_available():
        raise PreflightError(
            f"train.device: cuda, but torch {torch.__version__} sees no CUDA device (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}; veomni-doctor shows what this machine has); use "
            "train.device=auto or cpu"
        )
    use_cuda = device_pref == "cuda" or (device_pref == "auto" and torch.cuda.is_available())
    if use_cuda:
        # torchrun names the GPU; a caller that initialised the group itself has already picked one.
        local = os.environ.get("LOCAL_RANK")
        device = torch.device("cuda", int(local) if local is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, device_id=device if use_cuda else None)
        else:
            # A single process still gets a real (one-rank) group, so that one code path serves every size.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return device


def parallel_dims(recipe: Recipe, world_size: int) -> ParallelDims:
    """The recipe's degrees on ``world_size`` ranks (``dp_shard`` None: whatever the others leave).

    Raises:
        PreflightError: degrees that do not fit ``world_size`` (bad input the CLI reports without a traceback).
    """
    p = recipe.parallel
    try:
        dims = ParallelDims.for_world(world_size, dp_replicate=p.dp_replicate, sp=p.sp, ep=p.ep)
    except ValueError as err:
        # ParallelDims names its own class; the user wrote the recipe's parallel section.
        message = str(err).removeprefix("ParallelDims.for_world: ").removeprefix("ParallelDims: ")
        raise PreflightError(f"parallel: {message}") from None
    if p.dp_shard is not None and p.dp_shard != dims.dp_shard:
        raise PreflightError(
            f"parallel.dp_shard={p.dp_shard} but {world_size} ranks / (dp_replicate={p.dp_replicate} * sp={p.sp}) "
            f"= {dims.dp_shard}; leave it null or launch a matching number of ranks"
        )
    return dims
