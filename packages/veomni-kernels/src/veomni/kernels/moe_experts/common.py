"""Input checks and the expert-major permutation shared by every `moe_experts` backend.

Notation: ``T`` tokens, ``k`` experts per token, ``N = T*k`` (token, slot) pairs, ``E`` experts, ``H`` hidden
size, ``I`` expert intermediate size. Weights follow HF's fused layout: ``gate_up_proj [E, 2I, H]`` (gate rows
first, then up rows) and ``down_proj [E, H, I]``; an expert computes ``down(silu(gate(x)) * up(x))``.

Checks that need the values of device tensors (expert ids in range, counts summing to ``N``) never read them
back to the host on CUDA: they are queued with ``torch._assert_async``, which fails the next CUDA call with the
message below. On CPU they raise ``ValueError`` at once.
"""

from __future__ import annotations

import torch

_INDEX_DTYPES = (torch.int32, torch.int64)


def check_on_device(ok: torch.Tensor, message: str) -> None:
    """Raise ``ValueError(message)`` unless the 0-d bool tensor ``ok`` is true; on CUDA without a host sync.

    Under ``torch.compile`` the check is a graph op on every device (``_assert_async``: a RuntimeError when it
    fails), since reading the value on the host would be a data-dependent branch.
    """
    if ok.device.type == "cpu" and not torch.compiler.is_compiling():
        if not bool(ok):
            raise ValueError(message)
    else:
        torch._assert_async(ok, message)


def check_weights(gate_up_proj: torch.Tensor, down_proj: torch.Tensor, x: torch.Tensor, name: str) -> None:
    """Shapes, dtypes and devices of the expert weights against the activations ``x [rows, H]``."""
    if gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        raise ValueError(
            f"moe_experts: gate_up_proj must be [E, 2I, H] and down_proj [E, H, I]; got "
            f"{tuple(gate_up_proj.shape)} and {tuple(down_proj.shape)}"
        )
    experts, two_i, hidden = gate_up_proj.shape
    if experts < 1 or two_i % 2 or two_i == 0:
        raise ValueError(
            f"moe_experts: gate_up_proj must be [E, 2I, H] with E, I >= 1; got {tuple(gate_up_proj.shape)}"
        )
    if tuple(down_proj.shape) != (experts, hidden, two_i // 2):
        raise ValueError(
            f"moe_experts: down_proj must be [E, H, I] = {[experts, hidden, two_i // 2]} to match gate_up_proj "
            f"{tuple(gate_up_proj.shape)}; got {tuple(down_proj.shape)}"
        )
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"moe_experts: {name} must be [rows, H] with H = {hidden}; got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"moe_experts: {name} must be floating point, got {x.dtype}")
    if gate_up_proj.dtype != x.dtype or down_proj.dtype != x.dtype:
        raise TypeError(
            f"moe_experts: {name}, gate_up_proj and down_proj must share one dtype; got {x.dtype}, "
            f"{gate_up_proj.dtype} and {down_proj.dtype}"
        )
    if gate_up_proj.device != x.device or down_proj.device != x.device:
        raise ValueError(
            f"moe_experts: {name}, gate_up_proj and down_proj must be on one device; got {x.device}, "
            f"{gate_up_proj.device} and {down_proj.device}"
        )


def check_routed_inputs(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> None:
    """Validate the `routed` variant's arguments; expert ids are range-checked on the device (see module doc)."""
    check_weights(gate_up_proj, down_proj, hidden, "hidden")
    tokens = hidden.shape[0]
    if top_k_index.dim() != 2 or top_k_index.shape[0] != tokens or top_k_index.shape[1] < 1:
        raise ValueError(
            f"moe_experts: top_k_index must be [T, k] with T = {tokens} and k >= 1; got {tuple(top_k_index.shape)}"
        )
    if top_k_index.dtype != torch.int64:
        raise TypeError(f"moe_experts: top_k_index must be int64, got {top_k_index.dtype}")
    if tuple(top_k_weights.shape) != tuple(top_k_index.shape):
        raise ValueError(
            f"moe_experts: top_k_weights must be [T, k] = {list(top_k_index.shape)}; got {list(top_k_weights.shape)}"
        )
    if not top_k_weights.is_floating_point():
        raise TypeError(f"moe_experts: top_k_weights must be floating point, got {top_k_weights.dtype}")
    if top_k_index.device != hidden.device or top_k_weights.device != hidden.device:
        raise ValueError(
            f"moe_experts: hidden, top_k_index and top_k_weights must be on one device; got {hidden.device}, "
            f"{top_k_index.device} and {top_k_weights.device}"
        )
    if top_k_index.numel():
        experts = gate_up_proj.shape[0]
        ok = (top_k_index.min() >= 0) & (top_k_index.max() < experts)
        check_on_device(ok, f"moe_experts: top_k_index holds expert ids outside [0, {experts})")


def check_grouped_inputs(
    x: torch.Tensor, tokens_per_expert: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor
) -> None:
    """Validate the `grouped` variant's arguments; counts are checked on the device (see module doc)."""
    check_weights(gate_up_proj, down_proj, x, "x")
    experts = gate_up_proj.shape[0]
    if not isinstance(tokens_per_expert, torch.Tensor):
        raise TypeError(
            f"moe_experts: tokens_per_expert must be a [E] int32/int64 tensor on x's device, got "
            f"{type(tokens_per_expert).__name__}"
        )
    if tokens_per_expert.dim() != 1 or tokens_per_expert.shape[0] != experts:
        raise ValueError(
            f"moe_experts: tokens_per_expert must be [E] = [{experts}]; got {list(tokens_per_expert.shape)}"
        )
    if tokens_per_expert.dtype not in _INDEX_DTYPES:
        raise TypeError(
            f"moe_experts: tokens_per_expert must be int32 or int64, got {tokens_per_expert.dtype}"
        )
    if tokens_per_expert.device != x.device:
        raise ValueError(
            f"moe_experts: tokens_per_expert is on {tokens_per_expert.device} but x on {x.device}; keep the "
            "counts on the device (e.g. DispatchHandle.local_expert_counts)"
        )
    ok = (tokens_per_expert.min() >= 0) & (tokens_per_expert.sum() == x.shape[0])
    check_on_device(ok, f"moe_experts: tokens_per_expert must be >= 0 and sum to the {x.shape[0]} rows of x")


def group_offsets(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """``[E] -> [E + 1]`` int32 exclusive prefix sums on the same device (row ``offsets[e]`` starts expert ``e``)."""
    offsets = torch.zeros(tokens_per_expert.shape[0] + 1, dtype=torch.int32, device=tokens_per_expert.device)
    offsets[1:] = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
    return offsets


def expert_major_order(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the ``N = T*k`` (token, slot) pairs by expert, stably; no host sync.

    Args:
        top_k_index: ``[T, k]`` int64 expert ids in ``[0, E)``.
        num_experts: ``E``.
    Returns:
        ``(order, offsets)``: ``order [N]`` int64, the flat ``token*k + slot`` index at each expert-major row
        (rows of one expert keep token order); ``offsets [E + 1]`` int32, where each expert's rows start.
    """
    # Narrow keys: a radix sort makes one pass per key byte, and ids are < E.
    key = torch.int16 if num_experts < 2**15 - 1 else torch.int32
    sorted_ids, order = torch.sort(top_k_index.reshape(-1).to(key), stable=True)
    bounds = torch.arange(num_experts + 1, device=top_k_index.device, dtype=key)
    # Boundaries of the sorted ids give the counts without bincount (which syncs on CUDA to size its output).
    offsets = torch.searchsorted(sorted_ids, bounds, out_int32=True)
    return order, offsets


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[order[i]] = i``, in O(N) (one scatter, no second sort)."""
    positions = torch.arange(order.numel(), device=order.device, dtype=order.dtype)
    return torch.empty_like(order).scatter_(0, order, positions)
