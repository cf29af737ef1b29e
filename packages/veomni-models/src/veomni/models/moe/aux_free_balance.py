"""DeepSeek-V3's auxiliary-loss-free load balancing: the router's ``e_score_correction_bias`` moved outside the
gradient after every optimizer step.

The model adds the bias to the sigmoid scores for the choice of experts only (never to the routing weights).
DeepSeek-V3's rule (its report, section 2.1.2): at the end of each step, an expert that received more tokens than
the mean has its bias lowered by ``speed``, one that received fewer has it raised by ``speed``::

    bias += speed * sign(mean(load) - load)

with ``load[e]`` the number of (token, choice) pairs the router sent to expert ``e`` over the whole step: every
micro-batch, every rank. transformers defines no update (its bias is a fixed buffer), so veomni applies it here when
``optim.moe_bias_update_speed`` > 0.

Counting is a forward hook on each router (``DeepseekV3TopkRouter`` returns ``(logits, weights, indices)``), adding
into a non-persistent fp32 buffer, so it also runs inside compiled blocks and CUDA graphs. Activation checkpointing
runs the router twice per forward: every expert's count doubles, which the sign leaves unchanged. Only training
forwards with gradients on count (``module.training``, not compiled blocks' no-grad priming run); padding tokens are
routed and counted as the model sees them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

LOAD = "veomni_expert_load"


def _count(module: nn.Module, args: tuple, output: tuple) -> None:
    # Gradients on: compiled blocks' eager priming run (`veomni.core.compile`) is a no-grad training-mode forward
    # whose result is thrown away; counting it weighed the run's first micro-batch twice.
    if module.training and torch.is_grad_enabled():
        indices = output[2].reshape(-1)
        load = getattr(module, LOAD)
        load.index_add_(0, indices, torch.ones_like(indices, dtype=load.dtype))


def attach_load_counters(model: nn.Module) -> list[nn.Module]:
    """Give every router with an ``e_score_correction_bias`` a load counter; returns those routers (FQN order).

    Call after the model's tensors are materialised (the counter lives beside the bias, on its device).
    """
    routers = [
        m
        for _, m in model.named_modules()
        if isinstance(getattr(m, "e_score_correction_bias", None), torch.Tensor)
    ]
    for router in routers:
        bias = router.e_score_correction_bias
        router.register_buffer(LOAD, torch.zeros_like(bias, dtype=torch.float32), persistent=False)
        router.register_forward_hook(_count)
    return routers


@torch.no_grad()
def update_correction_biases(
    routers: list[nn.Module], speed: float, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Apply the rule above to every router and reset its counter; returns the step's loads ``[routers, E]``
    (fp32, summed over ``group``, the default group: every rank routes its own tokens).

    One all-reduce for all routers. No host sync: the update stays on the device.
    """
    loads = torch.stack([getattr(r, LOAD) for r in routers])
    if dist.is_initialized():
        dist.all_reduce(loads, group=group)
    step = speed * torch.sign(loads.mean(dim=1, keepdim=True) - loads)
    for router, delta in zip(routers, step, strict=True):
        router.e_score_correction_bias.add_(delta.to(router.e_score_correction_bias.dtype))
        getattr(router, LOAD).zero_()
    return loads


@torch.no_grad()
def reset_load_counters(routers: list[nn.Module]) -> None:
    """Zero every router's counter without updating its bias: a step that applies nothing (an fp16 overflow,
    `veomni.train.numerics`) must not add its loads to the next step's update."""
    for router in routers:
        getattr(router, LOAD).zero_()
