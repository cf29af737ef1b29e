"""How evenly a MoE model's routers spread tokens over their experts: per-layer load counts for the metrics.

A forward pre-hook on every HF fused experts module (any family: the experts interface passes ``top_k_index``,
the global expert ids of this rank's tokens, before any expert-parallel dispatch) adds each (token, choice) pair
into a per-layer fp32 buffer on the device: no host sync, and it runs inside compiled blocks. Only training forwards
with gradients count (not evaluation, nor compiled blocks' no-grad priming run). Activation checkpointing runs a
layer's forward twice, doubling its counts; the reported figures are shares and ratios, which that leaves
unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from veomni.models.hf.experts import is_hf_experts_module

COUNTS = "veomni_routed_tokens"


def _count(module: nn.Module, args: tuple, kwargs: dict) -> None:
    if module.training and torch.is_grad_enabled():
        indices = (args[1] if len(args) > 1 else kwargs["top_k_index"]).reshape(-1)
        counts = getattr(module, COUNTS)
        counts.index_add_(0, indices, torch.ones_like(indices, dtype=counts.dtype))


def attach_expert_load_counters(model: nn.Module) -> list[str]:
    """Give every HF experts module of ``model`` a token counter ``[num_experts]`` (global ids); returns their
    module names, in order. Call once the model's tensors are on their device. Empty for a dense model."""
    names = []
    for name, module in model.named_modules():
        if not is_hf_experts_module(module) or not hasattr(module, "num_experts"):
            continue
        device = next(module.parameters()).device
        if device.type == "meta":
            raise ValueError(
                f"{name}: attach expert load counters after the model is materialised, not on meta"
            )
        module.register_buffer(COUNTS, torch.zeros(module.num_experts, device=device), persistent=False)
        module.register_forward_pre_hook(_count, with_kwargs=True)
        names.append(name)
    return names


@torch.no_grad()
def read_expert_loads(
    model: nn.Module, names: list[str], group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The (token, choice) counts since the last read, summed over ``group``'s ranks (default: the world, as every
    rank routes its own tokens), as ``[layers, num_experts]`` fp32 on the host; the counters restart at zero.
    A collective when the group has several ranks: every rank calls it at the same point."""
    modules = dict(model.named_modules())
    counts = torch.stack([getattr(modules[n], COUNTS) for n in names])
    total = counts.clone()
    for n in names:
        getattr(modules[n], COUNTS).zero_()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return total.cpu()


def load_summary(loads: torch.Tensor) -> dict[str, float | list[float]]:
    """From ``[layers, E]`` counts: ``moe_imbalance`` (the largest max/mean expert load of any layer: 1.0 is a
    perfectly even spread, E is every token on one expert), ``moe_imbalance_mean`` (its mean over layers),
    ``moe_idle_experts`` (the share of (layer, expert) pairs that got no token) and ``moe_imbalance_per_layer``."""
    mean = loads.mean(dim=1).clamp_min(1e-12)
    per_layer = loads.max(dim=1).values / mean
    return {
        "moe_imbalance": float(per_layer.max()),
        "moe_imbalance_mean": float(per_layer.mean()),
        "moe_idle_experts": float((loads == 0).float().mean()),
        "moe_imbalance_per_layer": [round(float(x), 4) for x in per_layer],
    }
