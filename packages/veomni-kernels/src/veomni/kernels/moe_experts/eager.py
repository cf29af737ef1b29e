"""Reference MoE experts: a loop over experts on tokens already grouped expert-major (as dispatch returns them)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def experts_swiglu(
    x: torch.Tensor, tokens_per_expert: Sequence[int], gate_up_proj: torch.Tensor, down_proj: torch.Tensor
) -> torch.Tensor:
    """``down_e(silu(gate_e(x)) * up_e(x))`` for each expert ``e`` on its contiguous run of rows.

    Args:
        x: ``[N, H]`` rows grouped by expert, ``tokens_per_expert[e]`` rows for expert ``e`` in order.
        tokens_per_expert: host ints, length ``E``, summing to ``N``.
        gate_up_proj: ``[E, 2*I, H]`` fused gate (first ``I`` rows) and up projections.
        down_proj: ``[E, H, I]``.
    Returns:
        ``[N, H]`` in ``x.dtype``.
    """
    num_experts = gate_up_proj.shape[0]
    if len(tokens_per_expert) != num_experts or sum(tokens_per_expert) != x.shape[0]:
        raise ValueError(
            f"tokens_per_expert must have {num_experts} entries summing to {x.shape[0]} rows, "
            f"got {list(tokens_per_expert)}"
        )
    if down_proj.shape[0] != num_experts or gate_up_proj.shape[1] != 2 * down_proj.shape[2]:
        raise ValueError(
            f"gate_up_proj {tuple(gate_up_proj.shape)} and down_proj {tuple(down_proj.shape)} disagree; "
            "expected [E, 2I, H] and [E, H, I]"
        )
    outputs = []
    for rows, w_gate_up, w_down in zip(x.split(list(tokens_per_expert)), gate_up_proj, down_proj, strict=True):
        gate, up = F.linear(rows, w_gate_up).chunk(2, dim=-1)
        outputs.append(F.linear(F.silu(gate) * up, w_down))
    return torch.cat(outputs) if outputs else x.new_zeros(0, down_proj.shape[1])
