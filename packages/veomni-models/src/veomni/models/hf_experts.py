"""veomni's MoE experts, registered in HF's experts interface (``ALL_EXPERTS_FUNCTIONS``) as ``"veomni"``.

HF experts classes decorated with ``@use_experts_implementation`` (Qwen3-MoE's ``Qwen3MoeExperts``, with fused
``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``) dispatch their forward through that interface by
``config._experts_implementation``. `apply_ops` selects ``"veomni"``, which runs:

- without expert parallelism: the ``moe_experts/routed`` kernel of the instance's kernel set, or, when the
  configured backend is ``eager``, the untouched upstream forward;
- with expert parallelism (the module's parameters were sharded by ``apply_expert_plan``): veomni-core's
  ``dispatch_tokens`` -> the ``moe_experts/grouped`` kernel on the local experts -> ``combine_tokens``. The
  upstream eager loop is refused there: it indexes experts by global id and would run on the wrong weights.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from veomni.core.ep import combine_tokens, dispatch_tokens, expert_shards
from veomni.core.parallel_state import current_parallel_state
from veomni.models.kernel_hooks import ATTR

EXPERTS_IMPLEMENTATION = "veomni"


def veomni_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """HF experts-interface forward.

    Args:
        self: an HF fused experts module (``gate_up_proj [E_local, 2I, H]``, ``down_proj [E_local, H, I]``).
        hidden_states: ``[T, H]``; top_k_index: ``[T, k]`` int64 global expert ids; top_k_weights: ``[T, k]``.
    Returns:
        ``[T, H]`` in ``hidden_states.dtype``.
    """
    kernels = getattr(self, ATTR, None)
    if kernels is None:
        raise RuntimeError(
            f"{type(self).__name__} uses experts_implementation={EXPERTS_IMPLEMENTATION!r} but has no veomni "
            "kernels attached; bind them with veomni.models.kernel_hooks.apply_ops(model, ops)"
        )
    backend = kernels.config.moe_experts
    shards = expert_shards(self)
    shard = shards.get("gate_up_proj")
    if shard is None or shard.ep_size == 1:
        if backend == "eager":
            upstream = type(self).forward.__wrapped__  # the class's own forward, under HF's dispatch wrapper
            return upstream(self, hidden_states, top_k_index, top_k_weights)
        routed = kernels.get("moe_experts", "routed")
        return routed(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)

    if backend == "eager":
        raise ValueError(
            "OpsConfig.moe_experts='eager' runs the upstream per-expert loop, which indexes experts by global id "
            f"and cannot run on expert-parallel shards ({type(self).__name__} holds {shard.local_experts} of "
            f"{shard.num_experts} experts); choose a grouped backend such as 'torch' or 'triton'"
        )
    if "down_proj" not in shards:
        raise ValueError(
            f"{type(self).__name__}: both gate_up_proj and down_proj must be expert-sharded, found {sorted(shards)}"
        )
    group = current_parallel_state().ep_group
    rows, _, handle = dispatch_tokens(hidden_states, top_k_index, shard.num_experts, group)
    grouped = kernels.get("moe_experts", "grouped")
    out = grouped(rows, handle.local_expert_counts, self.gate_up_proj, self.down_proj)
    return combine_tokens(out, top_k_weights, handle)


def register_hf_experts() -> str:
    """Register `veomni_experts_forward` in HF's experts interface (idempotent); returns its name."""
    existing = ALL_EXPERTS_FUNCTIONS._global_mapping.get(EXPERTS_IMPLEMENTATION)
    if existing is not None and existing is not veomni_experts_forward:
        raise ValueError(
            f"experts implementation {EXPERTS_IMPLEMENTATION!r} is already registered by someone else: {existing}"
        )
    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, veomni_experts_forward)
    return EXPERTS_IMPLEMENTATION
